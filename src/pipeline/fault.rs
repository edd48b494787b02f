//! Injected panics, for the tests that prove a panicked stage ends the worker with a non-zero
//! exit after the usual NACKs.
//!
//! In debug builds `SPOTINFER_TEST_PANIC=<stage>` (`source`, `batcher`, `embed` or `sink`) makes
//! that stage panic the first time it handles a message, and `SPOTINFER_TEST_SLOW_BATCH_MS=N`
//! makes every batch wait N ms at the model (a long generation batch, which commits nothing
//! meanwhile). Release builds compile [`point`] and [`slow_batch`] to nothing and never read the
//! variables.

/// A stage that can be told to panic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The queue source.
    Source,
    /// The batcher.
    Batcher,
    /// The infer stage.
    Embed,
    /// The store sink.
    Sink,
}

impl Stage {
    #[cfg(debug_assertions)]
    fn name(self) -> &'static str {
        match self {
            Stage::Source => "source",
            Stage::Batcher => "batcher",
            Stage::Embed => "embed",
            Stage::Sink => "sink",
        }
    }
}

/// Panics here if this is a debug build told to panic in `stage`.
#[inline]
pub fn point(stage: Stage) {
    #[cfg(debug_assertions)]
    {
        static TARGET: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        let target = TARGET.get_or_init(|| std::env::var("SPOTINFER_TEST_PANIC").ok());
        if target.as_deref() == Some(stage.name()) {
            panic!(
                "SPOTINFER_TEST_PANIC: injected panic in the {} stage",
                stage.name()
            );
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = stage;
}

/// How long a debug build told so holds each batch at the model (`SPOTINFER_TEST_SLOW_BATCH_MS`).
#[inline]
pub fn slow_batch() -> Option<std::time::Duration> {
    #[cfg(debug_assertions)]
    {
        static DELAY: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
        let ms = DELAY.get_or_init(|| {
            std::env::var("SPOTINFER_TEST_SLOW_BATCH_MS")
                .ok()
                .and_then(|v| v.parse().ok())
        });
        ms.map(std::time::Duration::from_millis)
    }
    #[cfg(not(debug_assertions))]
    None
}
