//! Whether the worker is ready and alive: the readiness conditions `/readyz` reports, and the
//! liveness rule behind `/healthz` (messages held past the stall threshold without progress),
//! with how that threshold is worked out from the worker's own speed.

use super::metrics::Metrics;
use std::sync::atomic::Ordering;
use std::time::Duration;

impl Metrics {
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

#[cfg(test)]
mod tests {
    use super::super::metrics::on_fake_clock;
    use super::*;

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
