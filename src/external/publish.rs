//! `spotinfer publish`: JSONL in, one Pub/Sub message per valid line out.
//!
//! Lines are validated against the same contract the worker enforces; a bad line is reported on
//! stderr with its line number and skipped, never silently. Publishes are pipelined (many in
//! flight, batched by the client) and each one is awaited, so the final count is what Pub/Sub
//! confirmed.

use crate::external::pubsub::QueueError;
use crate::record;
use futures::stream::{FuturesUnordered, StreamExt};
use google_cloud_pubsub::client::Publisher;
use google_cloud_pubsub::model::Message;
use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// Errors publishing a file.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The input cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Pub/Sub refused.
    #[error(transparent)]
    Queue(#[from] QueueError),
}

/// What a publish run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PublishSummary {
    /// Messages Pub/Sub confirmed.
    pub published: u64,
    /// Lines skipped as invalid.
    pub skipped: u64,
    /// Publishes that failed.
    pub failed: u64,
}

/// Most publishes awaited at once.
const IN_FLIGHT: usize = 2000;

/// The longest line read: Pub/Sub's 10 MB message limit. A longer line is reported and skipped
/// without being held in memory.
pub const MAX_LINE_BYTES: usize = 10_000_000;

/// Publishes every valid line of `input`, stamping `job` on records that carry none. Reads as it
/// publishes: memory holds one line and the publishes in flight, whatever the input's size.
/// `progress` advances by the bytes read.
pub async fn publish_lines(
    publisher: &Publisher,
    mut input: impl AsyncBufRead + Unpin,
    job: Option<&str>,
    progress: &indicatif::ProgressBar,
) -> Result<PublishSummary, PublishError> {
    let mut summary = PublishSummary::default();
    let mut pending = FuturesUnordered::new();
    let mut line = Vec::new();
    let mut n = 0;
    loop {
        let read = next_line(&mut input, &mut line, MAX_LINE_BYTES)
            .await
            .map_err(|source| PublishError::Read {
                path: "input".into(),
                source,
            })?;
        let Some(read) = read else { break };
        n += 1;
        progress.inc(read.bytes as u64);
        if read.too_long {
            progress.suspend(|| {
                eprintln!("line {n}: longer than {MAX_LINE_BYTES} bytes (Pub/Sub's message limit); skipped")
            });
            summary.skipped += 1;
            continue;
        }
        let Some(data) = message_data(&line, n, job, progress) else {
            summary.skipped += u64::from(!line.iter().all(u8::is_ascii_whitespace));
            continue;
        };
        pending.push(publisher.publish(Message::new().set_data(data)));
        if pending.len() >= IN_FLIGHT {
            settle(pending.next().await, &mut summary);
        }
    }
    publisher.flush().await;
    while let Some(r) = pending.next().await {
        settle(Some(r), &mut summary);
    }
    Ok(summary)
}

/// The message for line `n`, or `None` for a blank line or a bad one (reported on stderr).
fn message_data(
    line: &[u8],
    n: usize,
    job: Option<&str>,
    progress: &indicatif::ProgressBar,
) -> Option<String> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    // Lines are bytes: an invalid UTF-8 line is reported and skipped like any other bad line.
    let mut rec = match record::parse(line, usize::MAX) {
        Ok(r) => r,
        Err(e) => {
            progress.suspend(|| eprintln!("line {n}: {e}; skipped"));
            return None;
        }
    };
    if rec.job.is_none() {
        rec.job = job.map(str::to_string);
    }
    Some(record_json(&rec).to_string())
}

/// The message data for a parsed record: what the worker's contract reads, nothing else.
fn record_json(rec: &record::Record) -> serde_json::Value {
    let mut data = match &rec.uri {
        Some(uri) => serde_json::json!({"id": rec.id, "uri": uri, "job": rec.job}),
        None => serde_json::json!({"id": rec.id, "text": rec.text, "job": rec.job}),
    };
    if let Some(name) = &rec.prompt_name {
        data["prompt_name"] = serde_json::Value::from(name.as_str());
    }
    data
}

/// What [`next_line`] read.
struct LineRead {
    /// Bytes consumed, newline included.
    bytes: usize,
    /// The line was longer than the limit: `line` holds only its start.
    too_long: bool,
}

/// Reads the next line (without its newline) into `line`, keeping at most `max` bytes of it;
/// `None` at the end of the input.
async fn next_line(
    input: &mut (impl AsyncBufRead + Unpin),
    line: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Option<LineRead>> {
    line.clear();
    let mut read = LineRead {
        bytes: 0,
        too_long: false,
    };
    loop {
        let buf = input.fill_buf().await?;
        if buf.is_empty() {
            return Ok((read.bytes > 0).then_some(read));
        }
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..=i], true),
            None => (buf, false),
        };
        let content = chunk.strip_suffix(b"\n").unwrap_or(chunk);
        if line.len() + content.len() > max {
            read.too_long = true;
        } else {
            line.extend_from_slice(content);
        }
        let used = chunk.len();
        input.consume(used);
        read.bytes += used;
        if done {
            return Ok(Some(read));
        }
    }
}

fn settle(
    r: Option<Result<String, google_cloud_pubsub::error::PublishError>>,
    summary: &mut PublishSummary,
) {
    match r {
        Some(Ok(_)) => summary.published += 1,
        Some(Err(e)) => {
            summary.failed += 1;
            tracing::error!(error = %e, "publish failed");
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_record_keeps_its_prompt_name_and_gains_the_job() {
        let bar = indicatif::ProgressBar::hidden();
        let line = br#"{"id":"q1","text":"how far","prompt_name":"query"}"#;
        let data = message_data(line, 1, Some("j"), &bar).expect("a valid line");
        let back = record::parse(data.as_bytes(), usize::MAX).expect("the worker reads it");
        assert_eq!(back.prompt_name.as_deref(), Some("query"));
        assert_eq!(back.job.as_deref(), Some("j"));
        assert_eq!(back.text, "how far");
    }
}
