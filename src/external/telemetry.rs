//! Telemetry: logs through `tracing`, counters for Prometheus, and the worker's HTTP port.
//!
//! The metrics live in a `prometheus-client` registry (atomic counters, gauges and histograms,
//! rendered in the OpenMetrics text format); axum serves them with the health and readiness
//! probes, only when `SPOTINFER_METRICS_ADDR` is set.
//!
//! Liveness is about progress, not only about the process answering: `/healthz` fails once the
//! worker has held messages continuously for longer than its stall threshold without committing
//! any (see [`Metrics::liveness`] and [`stall_threshold`]), so Kubernetes restarts a wedged
//! worker (a hung model thread or device, a deadlocked stage) instead of leaving it to sit on its
//! leases.

use crate::choice::Choice;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tower::limit::GlobalConcurrencyLimitLayer;

/// Log output format (`SPOTINFER_LOG_FORMAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, with Cloud Logging's `severity` field.
    Json,
}

impl Choice for LogFormat {
    const NAMES: &'static [(&'static str, Self)] = &[("text", Self::Text), ("json", Self::Json)];
}

/// Installs the global tracing subscriber. `RUST_LOG` filters (default `info`, PostgreSQL's
/// notices at `warn`). Logs go to
/// stderr so stdout stays clean for command output.
pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    // PostgreSQL's notices ("relation … already exists, skipping" on every migration run) say
    // nothing an operator can act on: shown from RUST_LOG=sqlx::postgres::notice=info.
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx::postgres::notice=warn"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        // No colour codes inside JSON strings (span fields are pre-formatted text).
        LogFormat::Json => builder
            .with_ansi(false)
            .event_format(CloudLoggingJson)
            .try_init(),
    };
}

/// A JSON event format with `severity` (Cloud Logging's name for the level), `message`,
/// `target`, `timestamp`, the event's fields at the top level under their own names, and the
/// enclosing spans (name and fields, outermost first) under `spans`.
///
/// Kept rather than `tracing-stackdriver` because that layer renames every field to camelCase
/// (`retry_in` becomes `retryIn`, `drain_seconds` becomes `drainSeconds`) and writes `time` for
/// `timestamp`: the field names operators query and alert on (docs/operations.md) would change.
struct CloudLoggingJson;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for CloudLoggingJson
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let mut fields = JsonFields(serde_json::Map::new());
        event.record(&mut fields);
        let mut obj = fields.0;
        let severity = match *event.metadata().level() {
            tracing::Level::ERROR => "ERROR",
            tracing::Level::WARN => "WARNING",
            tracing::Level::INFO => "INFO",
            tracing::Level::DEBUG | tracing::Level::TRACE => "DEBUG",
        };
        obj.insert("severity".into(), severity.into());
        if let Some(scope) = ctx.event_scope() {
            let spans: Vec<serde_json::Value> = scope
                .from_root()
                .map(|span| {
                    let ext = span.extensions();
                    let fields = ext
                        .get::<tracing_subscriber::fmt::FormattedFields<N>>()
                        .map(|f| f.fields.clone())
                        .unwrap_or_default();
                    serde_json::json!({"name": span.name(), "fields": fields})
                })
                .collect();
            if !spans.is_empty() {
                obj.insert("spans".into(), spans.into());
            }
        }
        obj.insert("target".into(), event.metadata().target().into());
        obj.insert(
            "timestamp".into(),
            chrono::Utc::now()
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
                .into(),
        );
        let line = serde_json::Value::Object(obj).to_string();
        writeln!(writer, "{line}")
    }
}

struct JsonFields(serde_json::Map<String, serde_json::Value>);

impl tracing::field::Visit for JsonFields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
}

const SECONDS_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
const ATTEMPT_BUCKETS: [f64; 9] = [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0, 50.0, 100.0];
const SIZE_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// The worker's counters, shared by every stage: a `prometheus-client` registry whose counters
/// and gauges are atomics, so the hot path pays an atomic add and nothing else, plus the
/// readiness conditions and the idle clock.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    started: Instant,
    received: Counter,
    acked: Counter,
    nacked: Counter,
    released: Counter,
    committed: Counter,
    failed: Counter,
    commit_errors: Counter,
    model_errors: Counter,
    tokens: Counter,
    in_flight: Gauge,
    ready_gauge: Gauge,
    stalled_gauge: Gauge<f64, std::sync::atomic::AtomicU64>,
    last_received_ms: AtomicU64,
    progress: Progress,
    clock: Clock,
    /// Records per model batch.
    pub batch_size: Histogram,
    /// Seconds the model spent on one batch.
    pub inference_seconds: Histogram,
    /// Seconds one commit took.
    pub commit_seconds: Histogram,
    delivery_attempts: Histogram,
    model_loaded: AtomicBool,
    store_ok: AtomicBool,
    stream_open: AtomicBool,
    draining: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let mut counter = |name: &str, help: &str| {
            let c = Counter::default();
            // The encoder appends `_total`: spotinfer_messages_received_total, ...
            registry.register(name, help, c.clone());
            c
        };
        let received = counter(
            "spotinfer_messages_received",
            "Messages received from Pub/Sub.",
        );
        let acked = counter(
            "spotinfer_messages_acked",
            "Messages acked after their commit.",
        );
        let nacked = counter(
            "spotinfer_messages_nacked",
            "Messages nacked for redelivery after a failure (commit, model, input read).",
        );
        let released = counter(
            "spotinfer_messages_released_on_shutdown",
            "Messages nacked at shutdown, unprocessed; each counts as a delivery attempt.",
        );
        let committed = counter("spotinfer_records_committed", "Result rows committed.");
        let failed = counter(
            "spotinfer_records_failed",
            "Bad payloads recorded in failed_records.",
        );
        let commit_errors = counter("spotinfer_commit_errors", "Commits that failed.");
        let model_errors = counter("spotinfer_model_errors", "Model batches that failed.");
        let tokens = counter("spotinfer_tokens", "Tokens embedded.");
        let in_flight = Gauge::default();
        registry.register(
            "spotinfer_in_flight_messages",
            "Messages held and not yet settled.",
            in_flight.clone(),
        );
        let ready_gauge = Gauge::default();
        registry.register(
            "spotinfer_ready",
            "Whether the worker is ready.",
            ready_gauge.clone(),
        );
        let stalled_gauge = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "spotinfer_stalled_seconds",
            "Seconds the worker has held messages without a commit while the database answers (/healthz fails past the stall threshold).",
            stalled_gauge.clone(),
        );
        let mut histogram = |name: &str, help: &str, buckets: &[f64]| {
            let h = Histogram::new(buckets.iter().copied());
            registry.register(name, help, h.clone());
            h
        };
        let batch_size = histogram(
            "spotinfer_batch_size",
            "Records per model batch.",
            &SIZE_BUCKETS,
        );
        let inference_seconds = histogram(
            "spotinfer_inference_seconds",
            "Model time per batch.",
            &SECONDS_BUCKETS,
        );
        let commit_seconds = histogram(
            "spotinfer_commit_seconds",
            "Time per commit transaction.",
            &SECONDS_BUCKETS,
        );
        let delivery_attempts = histogram(
            "spotinfer_delivery_attempt",
            "Delivery attempt of each message received (dead-letter subscriptions only).",
            &ATTEMPT_BUCKETS,
        );
        Self {
            registry,
            started: Instant::now(),
            received,
            acked,
            nacked,
            released,
            committed,
            failed,
            commit_errors,
            model_errors,
            tokens,
            in_flight,
            ready_gauge,
            stalled_gauge,
            last_received_ms: AtomicU64::new(0),
            progress: Progress::default(),
            clock: Clock::Real,
            batch_size,
            inference_seconds,
            commit_seconds,
            delivery_attempts,
            model_loaded: AtomicBool::new(false),
            store_ok: AtomicBool::new(false),
            stream_open: AtomicBool::new(false),
            draining: AtomicBool::new(false),
        }
    }
}

/// A snapshot of the counters, for summaries and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    /// Messages received from Pub/Sub.
    pub received: u64,
    /// Messages acked after commit.
    pub acked: u64,
    /// Messages nacked after a failure (commit, model, input read).
    pub nacked: u64,
    /// Messages nacked unprocessed at shutdown.
    pub released: u64,
    /// Result rows committed.
    pub committed: u64,
    /// Failure rows committed.
    pub failed: u64,
    /// Commits that failed and were retried through redelivery.
    pub commit_errors: u64,
    /// Model batches that failed.
    pub model_errors: u64,
    /// Tokens embedded.
    pub tokens: u64,
}

impl Metrics {
    /// A fresh set of counters.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Counts messages received, and notes the time for idle detection.
    pub fn received(&self, n: u64) {
        self.received.inc_by(n);
        self.mark_active();
    }
    /// Restarts the idle clock (the worker calls it when it starts pulling, so time spent
    /// waiting for the database or loading the model does not count as idle).
    pub fn mark_active(&self) {
        self.last_received_ms
            .store(self.now_ms(), Ordering::Relaxed);
    }
    /// Counts acks.
    pub fn acked(&self, n: u64) {
        self.acked.inc_by(n);
    }
    /// Counts nacks after a failure. A NACK settles a message: the worker is not stuck (a
    /// storage outage NACKs `uri` records, and restarting would not help).
    pub fn nacked(&self, n: u64) {
        self.nacked.inc_by(n);
        self.progress.made(self.now_ms());
    }
    /// Counts messages handed back unprocessed at shutdown.
    pub fn released(&self, n: u64) {
        self.released.inc_by(n);
    }
    /// Records a message's delivery attempt (0, unknown, is not recorded).
    pub fn delivery_attempt(&self, attempt: u32) {
        if attempt > 0 {
            self.delivery_attempts.observe(f64::from(attempt));
        }
    }
    /// Counts committed result rows and failure rows: progress, for liveness.
    pub fn committed(&self, results: u64, failures: u64) {
        self.committed.inc_by(results);
        self.failed.inc_by(failures);
        self.progress.made(self.now_ms());
    }
    /// Counts a failed commit.
    pub fn commit_error(&self) {
        self.commit_errors.inc();
    }
    /// Counts a failed model batch.
    pub fn model_error(&self) {
        self.model_errors.inc();
    }
    /// Counts embedded tokens.
    pub fn tokens(&self, n: u64) {
        self.tokens.inc_by(n);
    }
    /// Adjusts the number of messages held and not yet settled. Going from none to some starts
    /// the stall clock.
    pub fn in_flight_add(&self, n: i64) {
        let before = self.in_flight.inc_by(n);
        if before <= 0 && before + n > 0 {
            self.progress.busy_from(self.now_ms());
        }
    }
    /// Messages held and not yet settled.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.get()
    }
    /// Time since the last message arrived (or since start, if none has).
    pub fn idle_for(&self) -> Duration {
        let last = self.last_received_ms.load(Ordering::Relaxed);
        Duration::from_millis(self.now_ms().saturating_sub(last))
    }
    /// Marks a readiness condition.
    pub fn set_model_loaded(&self, v: bool) {
        self.model_loaded.store(v, Ordering::Relaxed);
    }
    /// Marks a readiness condition. While the database fails, the stall clock stands still:
    /// a commit retried in place through an outage is not a stalled worker, and a restart would
    /// not bring the database back (it would only hand every message held back to Pub/Sub, one
    /// delivery attempt each). Each change restarts the stall clock.
    pub fn set_store_ok(&self, v: bool) {
        if self.store_ok.swap(v, Ordering::Relaxed) != v {
            self.progress.made(self.now_ms());
        }
    }
    /// Marks a readiness condition.
    pub fn set_stream_open(&self, v: bool) {
        self.stream_open.store(v, Ordering::Relaxed);
    }
    /// Marks the worker as draining (no longer ready) or, after an early drain whose notice
    /// cleared, as pulling again.
    pub fn set_draining(&self, draining: bool) {
        self.draining.store(draining, Ordering::Relaxed);
    }
    /// Ready: model loaded, database reachable, stream open, not draining.
    pub fn ready(&self) -> bool {
        self.model_loaded.load(Ordering::Relaxed)
            && self.store_ok.load(Ordering::Relaxed)
            && self.stream_open.load(Ordering::Relaxed)
            && !self.draining.load(Ordering::Relaxed)
    }

    /// Sets the liveness threshold ([`stall_threshold`]); until it is set the worker is never
    /// counted as stalled.
    pub fn set_stall_threshold(&self, threshold: Duration) {
        let ms = u64::try_from(threshold.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        self.progress.threshold_ms.store(ms, Ordering::Relaxed);
    }

    /// How long the worker has held messages without progress: 0 while it holds none or while
    /// the database fails; otherwise the time since the later of the last progress (a commit, a
    /// NACK after a failure, a change of the database's state) and the moment it went from
    /// holding nothing to holding messages.
    pub fn stalled_for(&self) -> Duration {
        if self.in_flight.get() <= 0 || !self.store_ok.load(Ordering::Relaxed) {
            return Duration::ZERO;
        }
        Duration::from_millis(self.progress.stalled_ms(self.now_ms()))
    }

    /// The liveness rule behind `/healthz`: `Err` (with why) once [`Metrics::stalled_for`]
    /// exceeds the stall threshold.
    pub fn liveness(&self) -> Result<(), String> {
        let threshold = self.progress.threshold_ms.load(Ordering::Relaxed);
        let stalled = self.stalled_for();
        if threshold == 0 || stalled <= Duration::from_millis(threshold) {
            return Ok(());
        }
        Err(format!(
            "stalled: {} messages held for {:.0}s without a commit (threshold {:.0}s)",
            self.in_flight(),
            stalled.as_secs_f64(),
            Duration::from_millis(threshold).as_secs_f64()
        ))
    }

    /// Milliseconds on this worker's clock.
    fn now_ms(&self) -> u64 {
        match &self.clock {
            Clock::Real => self.started.elapsed().as_millis() as u64,
            #[cfg(test)]
            Clock::Fake(ms) => ms.load(Ordering::Relaxed),
        }
    }

    /// A snapshot of the counters.
    pub fn counts(&self) -> Counts {
        Counts {
            received: self.received.get(),
            acked: self.acked.get(),
            nacked: self.nacked.get(),
            released: self.released.get(),
            committed: self.committed.get(),
            failed: self.failed.get(),
            commit_errors: self.commit_errors.get(),
            model_errors: self.model_errors.get(),
            tokens: self.tokens.get(),
        }
    }

    /// Every metric in the OpenMetrics text format (which Prometheus scrapes).
    pub fn render(&self) -> String {
        self.ready_gauge.set(i64::from(self.ready()));
        self.stalled_gauge.set(self.stalled_for().as_secs_f64());
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The clock the liveness and idle rules read.
#[derive(Debug)]
enum Clock {
    /// Time since the metrics were created.
    Real,
    /// Milliseconds a test sets.
    #[cfg(test)]
    Fake(Arc<AtomicU64>),
}

/// When the worker last made progress and since when it has held messages, in milliseconds on
/// its clock.
#[derive(Debug, Default)]
struct Progress {
    last_ms: AtomicU64,
    busy_since_ms: AtomicU64,
    /// 0: not set, never stalled.
    threshold_ms: AtomicU64,
}

impl Progress {
    fn made(&self, now_ms: u64) {
        self.last_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    fn busy_from(&self, now_ms: u64) {
        self.busy_since_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    fn stalled_ms(&self, now_ms: u64) -> u64 {
        let since = self
            .last_ms
            .load(Ordering::Relaxed)
            .max(self.busy_since_ms.load(Ordering::Relaxed));
        now_ms.saturating_sub(since)
    }
}

/// The liveness threshold: `floor` (`--stall-timeout`), or, where that is longer, twice the
/// longest a working worker can go between two commits while it holds messages: the batcher's
/// wait, one batch of the longest texts (`longest_batch`, when known) and one commit (a commit
/// slower than `commit_timeout` fails, and while commits fail the stall clock stands still).
/// A slow worker that is still working commits at least that often, so it never reaches it.
pub fn stall_threshold(
    floor: Duration,
    batch_wait: Duration,
    commit_timeout: Duration,
    longest_batch: Option<Duration>,
) -> Duration {
    let between = batch_wait
        .saturating_add(commit_timeout)
        .saturating_add(longest_batch.unwrap_or_default());
    floor.max(between.saturating_mul(2))
}

/// The longest one batch of `batch_size` texts can take the model: the batch measured at
/// start-up (`records_per_s` on texts of `measured_tokens` tokens) scaled to texts of the
/// model's token limit, `max_tokens`, by the square of the ratio (attention grows with the
/// square of the length and everything else linearly, so this over-estimates). At most a week.
pub fn longest_batch(
    batch_size: usize,
    records_per_s: f64,
    max_tokens: usize,
    measured_tokens: usize,
) -> Duration {
    let ratio = max_tokens.max(1) as f64 / measured_tokens.max(1) as f64;
    let seconds = batch_size.max(1) as f64 / records_per_s * ratio.max(1.0).powi(2);
    let week = Duration::from_secs(7 * 86_400);
    Duration::try_from_secs_f64(seconds).map_or(week, |d| d.min(week))
}

/// Requests the endpoint serves at once; more wait their turn.
const MAX_CONCURRENT_REQUESTS: usize = 32;

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until the process ends.
///
/// `/healthz` answers 200 while [`Metrics::liveness`] holds (the worker is not stalled), 503
/// otherwise; `/readyz` answers 200 only when [`Metrics::ready`] holds, 503 otherwise.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(health))
        .route("/readyz", get(readiness))
        .layer(GlobalConcurrencyLimitLayer::new(MAX_CONCURRENT_REQUESTS))
        .with_state(metrics);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "metrics endpoint stopped");
    }
}

async fn render_metrics(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics.render(),
    )
}

async fn health(State(metrics): State<Arc<Metrics>>) -> (StatusCode, String) {
    match metrics.liveness() {
        Ok(()) => (StatusCode::OK, "ok\n".into()),
        Err(why) => {
            tracing::error!(reason = %why, "liveness check failed: the worker makes no progress");
            (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"))
        }
    }
}

async fn readiness(State(metrics): State<Arc<Metrics>>) -> (StatusCode, &'static str) {
    if metrics.ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_renders_cumulative_buckets() {
        let m = Metrics::default();
        m.batch_size.observe(3.0);
        m.batch_size.observe(32.0);
        m.batch_size.observe(1000.0);
        let text = m.render();
        assert!(
            text.contains("spotinfer_batch_size_bucket{le=\"4.0\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("spotinfer_batch_size_bucket{le=\"32.0\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("spotinfer_batch_size_bucket{le=\"+Inf\"} 3"),
            "{text}"
        );
        assert!(text.contains("spotinfer_batch_size_count 3"), "{text}");
    }

    /// An event inside spans carries them: name and fields, outermost first.
    #[test]
    fn json_logs_keep_span_fields() {
        use tracing_subscriber::fmt::MakeWriter;
        #[derive(Clone, Default)]
        struct Buf(Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        impl<'a> MakeWriter<'a> for Buf {
            type Writer = Buf;
            fn make_writer(&'a self) -> Buf {
                self.clone()
            }
        }
        let buf = Buf::default();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .event_format(CloudLoggingJson)
            .with_writer(buf.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let outer = tracing::info_span!("batch", records = 32);
            let _o = outer.enter();
            let inner = tracing::info_span!("commit", attempt = 2);
            let _i = inner.enter();
            tracing::warn!(retry_in = 5, "commit failed");
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(line["severity"], "WARNING");
        assert_eq!(line["retry_in"], 5);
        assert_eq!(line["spans"][0]["name"], "batch");
        assert_eq!(line["spans"][0]["fields"], "records=32");
        assert_eq!(line["spans"][1]["name"], "commit");
        assert_eq!(line["spans"][1]["fields"], "attempt=2");
    }

    /// Metrics on a clock the test moves, in seconds.
    fn on_fake_clock() -> (Metrics, impl Fn(u64)) {
        let ms = Arc::new(AtomicU64::new(0));
        let m = Metrics {
            clock: Clock::Fake(ms.clone()),
            ..Metrics::default()
        };
        m.set_store_ok(true);
        (m, move |secs: u64| ms.store(secs * 1000, Ordering::Relaxed))
    }

    /// Finding 6 of issue 25: /healthz said nothing about progress. Held messages with no commit
    /// for longer than the threshold fail it; a slow worker that commits within it never does.
    #[test]
    fn liveness_fails_when_messages_are_held_past_the_threshold_without_a_commit() {
        let (m, at) = on_fake_clock();
        m.set_stall_threshold(Duration::from_secs(300));
        // Holding nothing is never a stall, however long.
        at(5_000);
        assert!(m.liveness().is_ok());
        assert_eq!(m.stalled_for(), Duration::ZERO);
        // The clock starts when messages arrive, not at the last commit before an idle spell.
        m.in_flight_add(5);
        at(5_300);
        assert!(m.liveness().is_ok(), "exactly the threshold is still alive");
        at(5_301);
        let why = m.liveness().unwrap_err();
        assert!(why.contains("5 messages held for 301s"), "{why}");
        assert_eq!(m.stalled_for(), Duration::from_secs(301));
        // A commit is progress: alive again, and a slow worker committing every 299 s stays so.
        m.committed(3, 0);
        assert!(m.liveness().is_ok());
        for t in (5_600..20_000).step_by(299) {
            at(t);
            assert!(m.liveness().is_ok(), "at {t}s");
            m.committed(1, 0);
        }
        // Settling everything stops the clock; new work starts it afresh.
        m.in_flight_add(-5);
        at(30_000);
        assert!(m.liveness().is_ok());
        m.in_flight_add(1);
        at(30_250);
        assert!(m.liveness().is_ok());
        at(30_400);
        assert!(m.liveness().is_err());
        // A NACK after a failure settles a message too: not stuck.
        m.nacked(1);
        assert!(m.liveness().is_ok());
    }

    /// A commit retried in place through a database outage is not a stall (a restart would not
    /// bring the database back); the clock restarts once the database answers again.
    #[test]
    fn a_database_outage_does_not_count_as_a_stall() {
        let (m, at) = on_fake_clock();
        m.set_stall_threshold(Duration::from_secs(300));
        m.in_flight_add(32);
        at(100);
        m.set_store_ok(false);
        at(100 + 3_600);
        assert!(m.liveness().is_ok(), "an hour-long outage");
        assert_eq!(m.stalled_for(), Duration::ZERO);
        m.set_store_ok(true);
        at(100 + 3_600 + 300);
        assert!(m.liveness().is_ok());
        at(100 + 3_600 + 301);
        assert!(m.liveness().is_err());
        // Without a threshold (not configured yet), never stalled.
        let (m, at) = on_fake_clock();
        m.in_flight_add(1);
        at(1_000_000);
        assert!(m.liveness().is_ok());
        assert!(m.render().contains("spotinfer_stalled_seconds 1000000.0"));
    }

    #[test]
    fn the_stall_threshold_covers_the_longest_batch_and_commit() {
        let five_min = Duration::from_secs(300);
        let wait = Duration::from_millis(50);
        let commit = Duration::from_secs(15);
        // all-MiniLM-L6-v2 at 100 records/s: 32 texts of 256 tokens against the 48-word probe.
        let batch = longest_batch(32, 100.0, 256, 48);
        assert!((batch.as_secs_f64() - 0.32 * (256.0f64 / 48.0).powi(2)).abs() < 1e-6);
        assert_eq!(
            stall_threshold(five_min, wait, commit, Some(batch)),
            five_min
        );
        // A model whose longest batch takes 10 minutes gets twice (wait + batch + commit).
        let slow = Duration::from_secs(600);
        assert_eq!(
            stall_threshold(five_min, wait, commit, Some(slow)),
            (wait + commit + slow) * 2
        );
        assert_eq!(stall_threshold(five_min, wait, commit, None), five_min);
        // A rate of 0 or NaN (nothing measured) cannot overflow: a week at most.
        assert_eq!(
            longest_batch(32, 0.0, 512, 48),
            Duration::from_secs(7 * 86_400)
        );
        assert_eq!(
            longest_batch(32, f64::NAN, 512, 48),
            Duration::from_secs(7 * 86_400)
        );
    }

    /// The probe itself: 200 while alive, 503 with the reason once stalled.
    #[tokio::test]
    async fn healthz_answers_503_when_stalled() {
        let (m, at) = on_fake_clock();
        let m = Arc::new(m);
        m.set_stall_threshold(Duration::from_secs(60));
        m.in_flight_add(1);
        at(60);
        assert_eq!(health(State(m.clone())).await.0, StatusCode::OK);
        at(61);
        let (code, body) = health(State(m.clone())).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("without a commit"), "{body}");
    }

    #[test]
    fn ready_needs_every_condition_and_not_draining() {
        let m = Metrics::default();
        assert!(!m.ready());
        m.set_model_loaded(true);
        m.set_store_ok(true);
        m.set_stream_open(true);
        assert!(m.ready());
        m.set_draining(true);
        assert!(!m.ready());
    }
}
