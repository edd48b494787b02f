//! Telemetry: logs through `tracing`, counters for Prometheus, and the worker's HTTP port.
//!
//! The metrics are plain atomics rendered in the Prometheus text format, so the hot path pays an
//! atomic add and nothing else. The HTTP endpoint is deliberately tiny (three GET routes) and is
//! only started when `SPOTINFER_METRICS_ADDR` is set.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Log output format (`SPOTINFER_LOG_FORMAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, with Cloud Logging's `severity` field.
    Json,
}

/// Installs the global tracing subscriber. `RUST_LOG` filters (default `info`). Logs go to
/// stderr so stdout stays clean for command output.
pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.event_format(CloudLoggingJson).try_init(),
    };
}

/// A JSON event format with `severity` (Cloud Logging's name for the level), `message`,
/// `target`, `timestamp` and the event's fields at the top level.
struct CloudLoggingJson;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for CloudLoggingJson
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
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

/// A fixed-bucket histogram (cumulative buckets are computed when rendered).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((v * 1e6).max(0.0) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        cumulative += self.counts[self.bounds.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {}", self.count.load(Ordering::Relaxed));
    }
}

const SECONDS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
const SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// The worker's counters, shared by every stage.
#[derive(Debug)]
pub struct Metrics {
    started: Instant,
    received: AtomicU64,
    acked: AtomicU64,
    nacked: AtomicU64,
    committed: AtomicU64,
    failed: AtomicU64,
    commit_errors: AtomicU64,
    model_errors: AtomicU64,
    tokens: AtomicU64,
    in_flight: AtomicI64,
    last_received_ms: AtomicU64,
    /// Records per model batch.
    pub batch_size: Histogram,
    /// Seconds the model spent on one batch.
    pub inference_seconds: Histogram,
    /// Seconds one commit took.
    pub commit_seconds: Histogram,
    model_loaded: AtomicBool,
    store_ok: AtomicBool,
    stream_open: AtomicBool,
    draining: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            received: AtomicU64::new(0),
            acked: AtomicU64::new(0),
            nacked: AtomicU64::new(0),
            committed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            commit_errors: AtomicU64::new(0),
            model_errors: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            in_flight: AtomicI64::new(0),
            last_received_ms: AtomicU64::new(0),
            batch_size: Histogram::new(SIZE_BUCKETS),
            inference_seconds: Histogram::new(SECONDS_BUCKETS),
            commit_seconds: Histogram::new(SECONDS_BUCKETS),
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
    /// Messages nacked (shutdown, failed commit, model error).
    pub nacked: u64,
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
        self.received.fetch_add(n, Ordering::Relaxed);
        self.mark_active();
    }
    /// Restarts the idle clock (the worker calls it when it starts pulling, so time spent
    /// waiting for the database or loading the model does not count as idle).
    pub fn mark_active(&self) {
        self.last_received_ms
            .store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
    /// Counts acks.
    pub fn acked(&self, n: u64) {
        self.acked.fetch_add(n, Ordering::Relaxed);
    }
    /// Counts nacks.
    pub fn nacked(&self, n: u64) {
        self.nacked.fetch_add(n, Ordering::Relaxed);
    }
    /// Counts committed result rows and failure rows.
    pub fn committed(&self, results: u64, failures: u64) {
        self.committed.fetch_add(results, Ordering::Relaxed);
        self.failed.fetch_add(failures, Ordering::Relaxed);
    }
    /// Counts a failed commit.
    pub fn commit_error(&self) {
        self.commit_errors.fetch_add(1, Ordering::Relaxed);
    }
    /// Counts a failed model batch.
    pub fn model_error(&self) {
        self.model_errors.fetch_add(1, Ordering::Relaxed);
    }
    /// Counts embedded tokens.
    pub fn tokens(&self, n: u64) {
        self.tokens.fetch_add(n, Ordering::Relaxed);
    }
    /// Adjusts the number of messages held and not yet settled.
    pub fn in_flight_add(&self, n: i64) {
        self.in_flight.fetch_add(n, Ordering::Relaxed);
    }
    /// Messages held and not yet settled.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }
    /// Time since the last message arrived (or since start, if none has).
    pub fn idle_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_received_ms.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(last)
    }
    /// Marks a readiness condition.
    pub fn set_model_loaded(&self, v: bool) {
        self.model_loaded.store(v, Ordering::Relaxed);
    }
    /// Marks a readiness condition.
    pub fn set_store_ok(&self, v: bool) {
        self.store_ok.store(v, Ordering::Relaxed);
    }
    /// Marks a readiness condition.
    pub fn set_stream_open(&self, v: bool) {
        self.stream_open.store(v, Ordering::Relaxed);
    }
    /// Marks the worker as draining: no longer ready.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }
    /// Ready: model loaded, database reachable, stream open, not draining.
    pub fn ready(&self) -> bool {
        self.model_loaded.load(Ordering::Relaxed)
            && self.store_ok.load(Ordering::Relaxed)
            && self.stream_open.load(Ordering::Relaxed)
            && !self.draining.load(Ordering::Relaxed)
    }

    /// A snapshot of the counters.
    pub fn counts(&self) -> Counts {
        Counts {
            received: self.received.load(Ordering::Relaxed),
            acked: self.acked.load(Ordering::Relaxed),
            nacked: self.nacked.load(Ordering::Relaxed),
            committed: self.committed.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            commit_errors: self.commit_errors.load(Ordering::Relaxed),
            model_errors: self.model_errors.load(Ordering::Relaxed),
            tokens: self.tokens.load(Ordering::Relaxed),
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let c = self.counts();
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        counter(
            "spotinfer_messages_received_total",
            "Messages received from Pub/Sub.",
            c.received,
        );
        counter(
            "spotinfer_messages_acked_total",
            "Messages acked after their commit.",
            c.acked,
        );
        counter(
            "spotinfer_messages_nacked_total",
            "Messages nacked for redelivery.",
            c.nacked,
        );
        counter(
            "spotinfer_records_committed_total",
            "Result rows committed.",
            c.committed,
        );
        counter(
            "spotinfer_records_failed_total",
            "Bad payloads recorded in failed_records.",
            c.failed,
        );
        counter(
            "spotinfer_commit_errors_total",
            "Commits that failed.",
            c.commit_errors,
        );
        counter(
            "spotinfer_model_errors_total",
            "Model batches that failed.",
            c.model_errors,
        );
        counter("spotinfer_tokens_total", "Tokens embedded.", c.tokens);
        let _ = writeln!(
            out,
            "# HELP spotinfer_in_flight_messages Messages held and not yet settled.\n# TYPE spotinfer_in_flight_messages gauge\nspotinfer_in_flight_messages {}",
            self.in_flight()
        );
        let _ = writeln!(
            out,
            "# HELP spotinfer_ready Whether the worker is ready.\n# TYPE spotinfer_ready gauge\nspotinfer_ready {}",
            u8::from(self.ready())
        );
        self.batch_size
            .render(&mut out, "spotinfer_batch_size", "Records per model batch.");
        self.inference_seconds.render(
            &mut out,
            "spotinfer_inference_seconds",
            "Model time per batch.",
        );
        self.commit_seconds.render(
            &mut out,
            "spotinfer_commit_seconds",
            "Time per commit transaction.",
        );
        out
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until the process ends.
///
/// `/healthz` answers 200 while the process runs; `/readyz` answers 200 only when
/// [`Metrics::ready`] holds, 503 otherwise.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let n = match tokio::time::timeout(Duration::from_secs(5), sock.read(&mut buf)).await {
                Ok(Ok(n)) => n,
                _ => return,
            };
            let req = String::from_utf8_lossy(&buf[..n]);
            let path = req.split_whitespace().nth(1).unwrap_or("/");
            let (status, body, ctype) = match path {
                "/metrics" => ("200 OK", metrics.render(), "text/plain; version=0.0.4"),
                "/healthz" => ("200 OK", "ok\n".to_string(), "text/plain"),
                "/readyz" if metrics.ready() => ("200 OK", "ready\n".to_string(), "text/plain"),
                "/readyz" => (
                    "503 Service Unavailable",
                    "not ready\n".to_string(),
                    "text/plain",
                ),
                _ => ("404 Not Found", "not found\n".to_string(), "text/plain"),
            };
            let head = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
        });
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
            text.contains("spotinfer_batch_size_bucket{le=\"4\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("spotinfer_batch_size_bucket{le=\"32\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("spotinfer_batch_size_bucket{le=\"+Inf\"} 3"),
            "{text}"
        );
        assert!(text.contains("spotinfer_batch_size_count 3"), "{text}");
    }

    #[test]
    fn ready_needs_every_condition_and_not_draining() {
        let m = Metrics::default();
        assert!(!m.ready());
        m.set_model_loaded(true);
        m.set_store_ok(true);
        m.set_stream_open(true);
        assert!(m.ready());
        m.set_draining();
        assert!(!m.ready());
    }
}
