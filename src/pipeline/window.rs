//! How much a worker holds: a few seconds of its own work, not a fixed count.
//!
//! Every message a worker holds when it is preempted goes back to Pub/Sub unprocessed, and on a
//! subscription with a dead-letter policy that return counts as a delivery attempt. A worker
//! that holds minutes of work and is preempted again and again walks healthy records towards
//! the dead-letter topic. So the worker measures its model's throughput once at start-up (one
//! batch of synthetic texts of [`CALIBRATION_WORDS`] words, after a one-text warm-up: a fraction
//! of a second in a release build) and asks Pub/Sub, through each stream's flow control, for
//! about [`WINDOW_SECONDS`] of work. The batcher's window is the same number. Flow control
//! is the server's limit on messages delivered and not yet settled, so it also bounds what the
//! stream's buffers hold, which the batcher's window alone could not.

use crate::model::{ModelError, ModelHandle};
use std::time::Instant;

/// Seconds of work a worker holds.
pub const WINDOW_SECONDS: f64 = 2.0;
/// Batches an image model's worker holds at most, whatever its measured rate: the rate is timed
/// on pixel values, and a record's decoding and resizing, which depend on the picture's size
/// (ten times longer for a 12-megapixel photograph than for a 1-megapixel one), come on top.
/// Sized from the network alone the window held ten times its two seconds, and every SIGTERM
/// handed that much back, a delivery attempt each (the CLIP load test dead-lettered healthy
/// records). Four batches keep one computing, one decoded and two arriving: the rate a window
/// is sized from is capped at four batches per [`WINDOW_SECONDS`].
pub const IMAGE_WINDOW_BATCHES: usize = 4;
/// Batches a generation model's worker holds: one decoding and one queued. Its rate is not
/// measured (a completion's length decides it), and every message held at a SIGTERM goes back
/// (its tokens checkpointed), a delivery attempt each.
pub const GENERATION_WINDOW_BATCHES: usize = 2;
/// The most messages a worker holds, however fast its model.
pub const MAX_WINDOW: usize = 10_000;
/// Words in each calibration text: a long sentence, a short paragraph.
pub const CALIBRATION_WORDS: usize = 48;
/// Messages/s one streaming pull is counted on for when the worker picks its number of
/// streams: below the emulator's measured 1,900 per stream, far below a Pub/Sub stream's
/// 10 MB/s for short texts.
pub const STREAM_RATE: f64 = 1_500.0;
/// The most streams the worker opens by itself: past 8, each message cost the worker more CPU
/// (more lease loops, smaller flow-control windows) and the emulator delivered less (14,000
/// messages/s with 8 streams, 10,000-11,000 with 16, docs/benchmarks.md).
pub const MAX_AUTO_STREAMS: usize = 8;

/// Streams enough for `rate` messages/s: one per [`STREAM_RATE`], 1 to [`MAX_AUTO_STREAMS`].
pub fn streams_for(rate: f64) -> usize {
    let wanted = (rate.max(0.0) / STREAM_RATE).ceil();
    if wanted.is_finite() {
        (wanted as usize).clamp(1, MAX_AUTO_STREAMS)
    } else {
        1
    }
}

/// What a worker holds: its streams, the batcher's window and each stream's flow control.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// Streaming pulls (at least 1).
    pub streams: usize,
    /// Messages the batcher holds to choose batches from.
    pub messages: usize,
    /// Flow control of each stream: messages delivered and not yet settled.
    pub per_stream: i64,
    /// The model's measured records/s, when the window was sized from it.
    pub measured_rate: Option<f64>,
}

impl Window {
    /// `per_stream` messages per stream, as set by the user.
    pub fn fixed(per_stream: i64, streams: usize) -> Self {
        let (per_stream, streams) = (per_stream.max(1), streams.max(1));
        Self {
            streams,
            messages: usize::try_from(per_stream)
                .unwrap_or(usize::MAX)
                .saturating_mul(streams),
            per_stream,
            measured_rate: None,
        }
    }

    /// About [`WINDOW_SECONDS`] at `rate` records/s, split over `streams`: at least two batches
    /// (one computing while the next forms), at most [`MAX_WINDOW`].
    pub fn from_rate(rate: f64, batch_size: usize, streams: usize) -> Self {
        let streams = streams.max(1);
        let floor = (2 * batch_size.max(1)).max(streams);
        let wanted = (rate.max(0.0) * WINDOW_SECONDS).round() as usize;
        let total = wanted.clamp(floor, MAX_WINDOW.max(floor));
        let per_stream = total.div_ceil(streams);
        Self {
            streams,
            messages: per_stream * streams,
            per_stream: i64::try_from(per_stream).unwrap_or(i64::MAX),
            measured_rate: Some(rate),
        }
    }
}

/// Records/s of `model` on a batch of `batch_size` (at most 64) texts of [`CALIBRATION_WORDS`]
/// words, after a one-text warm-up (allocations, CUDA kernels): the best of up to three batches
/// within about a second, as a slow first batch would under-size a fast model's window and
/// streams.
pub async fn measure_rate(model: &ModelHandle, batch_size: usize) -> Result<f64, ModelError> {
    let info = model.info();
    let words = CALIBRATION_WORDS.min(info.max_seq_len).max(1);
    let text = calibration_text(words);
    let input = match info.processor.as_ref().and_then(|p| p.output_len()) {
        // An image model is timed on images (gray, of the size its processor gives).
        Some(len) => crate::model::Item::Pixels(vec![0.0; len].into()),
        // A cross-encoder reads pairs: the text paired with itself.
        None => crate::model::Item::Text(crate::model::Text {
            text_pair: info.task.needs_pairs().then(|| text.clone()),
            ..crate::model::Text::from(text)
        }),
    };
    model.predict(vec![input.clone()]).await?;
    let batch = vec![input; batch_size.clamp(1, 64)];
    let began = Instant::now();
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let started = Instant::now();
        model.predict(batch.clone()).await?;
        best = best.min(started.elapsed().as_secs_f64());
        if began.elapsed().as_secs_f64() > 1.0 {
            break;
        }
    }
    Ok(batch.len() as f64 / best.max(1e-6))
}

/// English-like text of about `words` tokens (common words, one token each in BERT
/// vocabularies).
fn calibration_text(words: usize) -> String {
    const WORDS: [&str; 12] = [
        "the", "worker", "reads", "a", "record", "and", "writes", "its", "vector", "to", "the",
        "table",
    ];
    WORDS
        .iter()
        .cycle()
        .take(words)
        .copied()
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_is_a_few_seconds_of_work_within_bounds() {
        // 150 records/s: 300 messages, over two streams 150 each.
        let w = Window::from_rate(150.0, 32, 2);
        assert_eq!((w.messages, w.per_stream), (300, 150));
        // A slow model still gets two batches; a fast one is capped.
        assert_eq!(Window::from_rate(3.0, 32, 1).messages, 64);
        assert_eq!(Window::from_rate(1e6, 32, 4).messages, MAX_WINDOW);
        assert_eq!(Window::from_rate(f64::NAN, 8, 1).messages, 16);
        // A user's fixed limit is per stream.
        let f = Window::fixed(256, 3);
        assert_eq!(
            (f.messages, f.per_stream, f.measured_rate),
            (768, 256, None)
        );
    }

    #[test]
    fn streams_follow_the_measured_rate_within_bounds() {
        assert_eq!(streams_for(200.0), 1);
        assert_eq!(streams_for(1_500.0), 1);
        assert_eq!(streams_for(1_501.0), 2);
        assert_eq!(streams_for(7_000.0), 5);
        assert_eq!(streams_for(1e9), MAX_AUTO_STREAMS);
        assert_eq!(streams_for(f64::NAN), 1);
        assert_eq!(streams_for(-5.0), 1);
    }

    #[test]
    fn the_calibration_text_has_the_asked_length() {
        assert_eq!(calibration_text(128).split(' ').count(), 128);
        assert_eq!(calibration_text(1), "the");
    }
}
