//! Injected panics, for the tests that prove a panicked stage ends the worker with a non-zero
//! exit after the usual NACKs.
//!
//! In debug builds `SPOTINFER_TEST_PANIC=<stage>` (`source`, `batcher`, `embed` or `sink`) makes
//! that stage panic the first time it handles a message. Release builds compile [`point`] to
//! nothing and never read the variable.

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
