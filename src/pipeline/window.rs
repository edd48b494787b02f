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
//! stream's buffers hold, which the batcher's window alone could not. The task may cap the
//! window or fix it in batches ([`crate::model::Infer::window`]): the rule is asked through the
//! seam, never by which task it is.

use crate::external::telemetry;
use crate::model::{ModelError, Served, WindowRule};
use std::time::{Duration, Instant};

/// Seconds of work a worker holds.
pub const WINDOW_SECONDS: f64 = 2.0;
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

/// What the worker's flags say of its window.
#[derive(Debug, Clone, Copy)]
pub struct WindowSettings {
    /// `--max-outstanding`: messages per stream, set by hand (none: measured).
    pub max_outstanding: Option<i64>,
    /// `--streams` (none: from the measured rate).
    pub streams: Option<usize>,
    /// `--batch-size`.
    pub batch_size: usize,
}

/// The window for `model`: as the flags set it, else from its rate measured here on a batch of
/// synthetic inputs, within the rule its task gives ([`WindowRule`]).
pub async fn size(model: &Served, s: WindowSettings) -> Result<Window, ModelError> {
    let batch = s.batch_size.max(1);
    let rule = model.task.window();
    if let WindowRule::Batches(n) = rule {
        let streams = s.streams.unwrap_or(1).max(1);
        let per_stream = s
            .max_outstanding
            .unwrap_or(((n * batch) / streams).max(1) as i64);
        return Ok(Window::fixed(per_stream, streams));
    }
    let rate = match (s.max_outstanding, s.streams) {
        (Some(_), Some(_)) => None,
        _ => Some(measure_rate(model, batch).await?),
    };
    let rate = match (rate, rule) {
        (Some(r), WindowRule::MeasuredAtMost(n)) => {
            Some(r.min((n * batch) as f64 / WINDOW_SECONDS))
        }
        (r, _) => r,
    };
    let streams = s
        .streams
        .unwrap_or_else(|| streams_for(rate.unwrap_or(0.0)));
    Ok(match s.max_outstanding {
        Some(n) => Window::fixed(n, streams),
        // Measured above whenever no limit is given.
        None => Window::from_rate(rate.unwrap_or(0.0), batch, streams),
    })
}

/// What the worker's flags say of its liveness threshold.
#[derive(Debug, Clone, Copy)]
pub struct StallSettings {
    /// `--batch-size`.
    pub batch_size: usize,
    /// `--stall-timeout`: the threshold's floor.
    pub stall_timeout: Duration,
    /// `--batch-wait`.
    pub batch_wait: Duration,
    /// `--commit-timeout`.
    pub commit_timeout: Duration,
    /// `--exit-when-idle`, in job mode (`--exit-when-job-complete`): warned about when shorter
    /// than a batch may run.
    pub job_idle: Option<Duration>,
}

/// The liveness threshold for `model` (`telemetry::stall_threshold`): the longest a batch may
/// run without a commit, as its task bounds it ([`crate::model::Infer::longest_batch`]: a
/// generation's time limit) or else from the rate `window` was measured at, scaled to the
/// model's longest input. Warns when a job-mode idle limit is shorter than that.
pub fn stall_threshold(model: &Served, window: &Window, s: StallSettings) -> Duration {
    let measured = window.measured_rate.map(|rate| {
        let max_tokens = model.info().max_seq_len;
        let words = CALIBRATION_WORDS.min(max_tokens);
        telemetry::longest_batch(s.batch_size, rate, max_tokens, words)
    });
    let longest_batch = model.task.longest_batch(s.batch_size).or(measured);
    if let Some((idle, longest_batch)) = s.job_idle.zip(longest_batch).filter(|(i, b)| i < b) {
        tracing::warn!(
            ?idle,
            ?longest_batch,
            "--exit-when-idle is shorter than a batch may run without a commit: a job whose last records are all in long batches may be taken for stuck"
        );
    }
    telemetry::stall_threshold(
        s.stall_timeout,
        s.batch_wait,
        s.commit_timeout,
        longest_batch,
    )
}

/// Records/s of `model` on a batch of `batch_size` (at most 64) inputs its task makes from a
/// text of [`CALIBRATION_WORDS`] words ([`crate::model::Infer::probe`]: an image model's are
/// gray pictures), after a one-input warm-up (allocations, CUDA kernels): the best of up to
/// three batches within about a second, as a slow first batch would under-size a fast model's
/// window and streams.
pub async fn measure_rate(model: &Served, batch_size: usize) -> Result<f64, ModelError> {
    let info = model.info();
    let words = CALIBRATION_WORDS.min(info.max_seq_len).max(1);
    let input = model.task.probe(info, calibration_text(words));
    model.handle.predict(vec![input.clone()]).await?;
    let batch = vec![input; batch_size.clamp(1, 64)];
    let began = Instant::now();
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let started = Instant::now();
        model.handle.predict(batch.clone()).await?;
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
