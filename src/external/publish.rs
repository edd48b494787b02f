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
use std::io::BufRead;

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

/// Publishes every valid line of `input`, stamping `job` on records that carry none.
pub async fn publish_lines(
    publisher: &Publisher,
    input: impl BufRead,
    job: Option<&str>,
    progress: &indicatif::ProgressBar,
) -> Result<PublishSummary, PublishError> {
    let mut summary = PublishSummary::default();
    let mut pending = FuturesUnordered::new();
    for (i, line) in input.split(b'\n').enumerate() {
        let line = line.map_err(|source| PublishError::Read {
            path: "input".into(),
            source,
        })?;
        let n = i + 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        // Lines are bytes: an invalid UTF-8 line is reported and skipped like any other bad line.
        let mut rec = match record::parse(&line, usize::MAX) {
            Ok(r) => r,
            Err(e) => {
                progress.suspend(|| eprintln!("line {n}: {e}; skipped"));
                summary.skipped += 1;
                continue;
            }
        };
        if rec.job.is_none() {
            rec.job = job.map(str::to_string);
        }
        let data = match &rec.uri {
            Some(uri) => serde_json::json!({"id": rec.id, "uri": uri, "job": rec.job}),
            None => serde_json::json!({"id": rec.id, "text": rec.text, "job": rec.job}),
        }
        .to_string();
        pending.push(publisher.publish(Message::new().set_data(data)));
        if pending.len() >= IN_FLIGHT {
            settle(pending.next().await, &mut summary, progress);
        }
    }
    publisher.flush().await;
    while let Some(r) = pending.next().await {
        settle(Some(r), &mut summary, progress);
    }
    Ok(summary)
}

fn settle(
    r: Option<Result<String, google_cloud_pubsub::error::PublishError>>,
    summary: &mut PublishSummary,
    progress: &indicatif::ProgressBar,
) {
    match r {
        Some(Ok(_)) => {
            summary.published += 1;
            progress.inc(1);
        }
        Some(Err(e)) => {
            summary.failed += 1;
            progress.suspend(|| eprintln!("publish failed: {e}"));
        }
        None => {}
    }
}
