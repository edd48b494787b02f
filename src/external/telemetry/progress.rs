//! The liveness clock's state: when the worker last made progress and since when it has held
//! messages. Kept apart so that the metrics that feed it and the health rule that reads it do
//! not import each other.

use std::sync::atomic::{AtomicU64, Ordering};

/// When the worker last made progress and since when it has held messages, in milliseconds on
/// its clock.
#[derive(Debug, Default)]
pub(super) struct Progress {
    last_ms: AtomicU64,
    busy_since_ms: AtomicU64,
    /// 0: not set, never stalled.
    pub(super) threshold_ms: AtomicU64,
}

impl Progress {
    pub(super) fn made(&self, now_ms: u64) {
        self.last_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    pub(super) fn busy_from(&self, now_ms: u64) {
        self.busy_since_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    pub(super) fn stalled_ms(&self, now_ms: u64) -> u64 {
        let since = self
            .last_ms
            .load(Ordering::Relaxed)
            .max(self.busy_since_ms.load(Ordering::Relaxed));
        now_ms.saturating_sub(since)
    }
}
