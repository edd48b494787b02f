//! The worker's counters: one `prometheus-client` registry that every stage updates with an
//! atomic add, rendered for Prometheus, plus the clock the idle and liveness rules read. The
//! readiness and liveness rules themselves are in `health`.

use super::progress::Progress;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    pub(super) in_flight: Gauge,
    ready_gauge: Gauge,
    stalled_gauge: Gauge<f64, std::sync::atomic::AtomicU64>,
    last_received_ms: AtomicU64,
    pub(super) progress: Progress,
    pub(super) clock: Clock,
    /// Records per model batch.
    pub batch_size: Histogram,
    /// Seconds the model spent on one batch.
    pub inference_seconds: Histogram,
    /// Seconds one commit took.
    pub commit_seconds: Histogram,
    delivery_attempts: Histogram,
    pub(super) model_loaded: AtomicBool,
    pub(super) store_ok: AtomicBool,
    pub(super) stream_open: AtomicBool,
    pub(super) draining: AtomicBool,
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
            "Messages nacked for redelivery outside a shutdown (a uri object still unreadable after its retries, a failure row the database refuses).",
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
    /// Messages nacked outside a shutdown: a `uri` object still unreadable after its retries, a
    /// failure row the database refuses (failed commits and model faults are retried in place).
    pub nacked: u64,
    /// Messages nacked unprocessed at shutdown.
    pub released: u64,
    /// Result rows committed.
    pub committed: u64,
    /// Failure rows committed.
    pub failed: u64,
    /// Commits that failed and were retried in place (or, refused for their data, halved).
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
            .fetch_max(self.now_ms(), Ordering::Relaxed);
    }
    /// Holds the idle clock at zero for `period` from now. After an early drain, messages the
    /// closed stream had been sent but never read come back only when their lease runs out
    /// (`--lease-extension`): until then the subscription is not idle, only quiet.
    pub fn not_idle_for(&self, period: Duration) {
        let until = self.now_ms().saturating_add(period.as_millis() as u64);
        self.last_received_ms.fetch_max(until, Ordering::Relaxed);
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

    /// Milliseconds on this worker's clock.
    pub(super) fn now_ms(&self) -> u64 {
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
pub(super) enum Clock {
    /// Time since the metrics were created.
    Real,
    /// Milliseconds a test sets.
    #[cfg(test)]
    Fake(Arc<AtomicU64>),
}

/// Metrics on a clock the test moves, in seconds.
#[cfg(test)]
pub(super) fn on_fake_clock() -> (Metrics, impl Fn(u64)) {
    let ms = Arc::new(AtomicU64::new(0));
    let m = Metrics {
        clock: Clock::Fake(ms.clone()),
        ..Metrics::default()
    };
    m.set_store_ok(true);
    (m, move |secs: u64| ms.store(secs * 1000, Ordering::Relaxed))
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

    #[test]
    fn the_idle_clock_waits_out_the_lease_of_what_a_closed_stream_held() {
        let (m, at) = on_fake_clock();
        at(5);
        m.received(1);
        at(8);
        assert_eq!(m.idle_for(), Duration::from_secs(3));
        m.not_idle_for(Duration::from_secs(10));
        at(17);
        assert_eq!(m.idle_for(), Duration::ZERO, "inside the lease");
        m.mark_active();
        at(20);
        assert_eq!(
            m.idle_for(),
            Duration::from_secs(2),
            "counted from the lease's end"
        );
    }
}
