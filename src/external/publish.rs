//! `spotinfer publish`: JSONL in, one Pub/Sub message per valid line out.
//!
//! Lines are validated against the same contract the worker enforces; a bad line is reported on
//! stderr with its line number and skipped, never silently. Publishes are pipelined (many in
//! flight, batched by the client) and each one is awaited, so the final count is what Pub/Sub
//! confirmed.

use crate::external::pubsub::QueueError;
use crate::external::store::{Store, StoreError};
use crate::record;
use futures::stream::{FuturesUnordered, StreamExt};
use google_cloud_pubsub::client::Publisher;
use google_cloud_pubsub::model::Message;
use google_cloud_pubsub::publisher::PublishFuture;
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
    /// The job's records could not be registered (nothing of theirs was published).
    #[error(transparent)]
    Store(#[from] StoreError),
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
    /// Records not published because they already have a result (`--skip-done`).
    pub already_done: u64,
}

/// The job a publish feeds: every record id is registered in the database before its message
/// is published, so the job's total survives a crash and a re-run without doubling.
#[derive(Debug, Clone, Copy)]
pub struct JobTarget<'a> {
    /// Where jobs are kept.
    pub store: &'a Store,
    /// The job.
    pub job: &'a str,
    /// Its model (what "done" means for `skip_done`).
    pub model: &'a str,
    /// Publish only records with no result from `model` yet.
    pub skip_done: bool,
}

/// Most publishes awaited at once.
const IN_FLIGHT: usize = 2000;

/// Records registered (and looked up for `--skip-done`) per database round trip.
const CHUNK: usize = 1000;

/// The longest line read: Pub/Sub's 10 MB message limit. A longer line is reported and skipped
/// without being held in memory.
pub const MAX_LINE_BYTES: usize = 10_000_000;

/// Publishes every valid line of `input`, stamping `job` on records that carry none. Reads as it
/// publishes: memory holds a chunk of lines and the publishes in flight, whatever the input's
/// size. With a `target`, each chunk's ids are registered with the job before its messages go
/// out. `progress` advances by the bytes read.
pub async fn publish_lines(
    publisher: &Publisher,
    mut input: impl AsyncBufRead + Unpin,
    job: Option<&str>,
    target: Option<JobTarget<'_>>,
    progress: &indicatif::ProgressBar,
) -> Result<PublishSummary, PublishError> {
    let mut out = Outbox {
        publisher,
        target,
        pending: FuturesUnordered::new(),
        chunk: Vec::with_capacity(CHUNK),
        summary: PublishSummary::default(),
    };
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
            out.summary.skipped += 1;
            continue;
        }
        match message_data(&line, n, job, progress) {
            Some(message) => out.add(message).await?,
            None => out.summary.skipped += u64::from(!line.iter().all(u8::is_ascii_whitespace)),
        }
    }
    out.finish().await
}

/// The publishes in flight and the chunk of messages waiting to be registered and sent.
struct Outbox<'a> {
    publisher: &'a Publisher,
    target: Option<JobTarget<'a>>,
    pending: FuturesUnordered<PublishFuture>,
    chunk: Vec<(String, String)>,
    summary: PublishSummary,
}

impl Outbox<'_> {
    /// Queues one (id, data) message; a full chunk is sent.
    async fn add(&mut self, message: (String, String)) -> Result<(), PublishError> {
        self.chunk.push(message);
        if self.chunk.len() >= CHUNK {
            self.send_chunk().await?;
        }
        Ok(())
    }

    /// Registers the chunk's ids with the job (dropping those already done, with `skip_done`),
    /// then publishes its messages.
    async fn send_chunk(&mut self) -> Result<(), PublishError> {
        let mut chunk = std::mem::take(&mut self.chunk);
        if let Some(t) = self.target {
            let ids: Vec<&str> = chunk.iter().map(|(id, _)| id.as_str()).collect();
            t.store.register_records(t.job, &ids).await?;
            if t.skip_done {
                let done = t.store.done_ids(t.model, &ids).await?;
                let before = chunk.len();
                chunk.retain(|(id, _)| !done.contains(id));
                self.summary.already_done += (before - chunk.len()) as u64;
            }
        }
        for (_, data) in chunk {
            self.pending
                .push(self.publisher.publish(Message::new().set_data(data)));
            if self.pending.len() >= IN_FLIGHT {
                settle(self.pending.next().await, &mut self.summary);
            }
        }
        Ok(())
    }

    /// Sends the last chunk and waits for every publish.
    async fn finish(mut self) -> Result<PublishSummary, PublishError> {
        self.send_chunk().await?;
        self.publisher.flush().await;
        while let Some(r) = self.pending.next().await {
            settle(Some(r), &mut self.summary);
        }
        Ok(self.summary)
    }
}

/// The record id and message data for line `n`, or `None` for a blank line or a bad one
/// (reported on stderr). With a `job`, a record that names another job is a bad line: a job's
/// count must hold exactly what was published to it.
fn message_data(
    line: &[u8],
    n: usize,
    job: Option<&str>,
    progress: &indicatif::ProgressBar,
) -> Option<(String, String)> {
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
    match (&rec.job, job) {
        (Some(own), Some(j)) if own != j => {
            progress.suspend(|| {
                eprintln!("line {n}: the record names job {own:?}, not {j:?}; skipped")
            });
            return None;
        }
        (None, _) => rec.job = job.map(str::to_string),
        _ => {}
    }
    Some((rec.id.clone(), record_json(&rec).to_string()))
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
        let (id, data) = message_data(line, 1, Some("j"), &bar).expect("a valid line");
        assert_eq!(id, "q1");
        let back = record::parse(data.as_bytes(), usize::MAX).expect("the worker reads it");
        assert_eq!(back.prompt_name.as_deref(), Some("query"));
        assert_eq!(back.job.as_deref(), Some("j"));
        assert_eq!(back.text, "how far");
    }

    #[test]
    fn a_record_naming_another_job_is_not_counted_in_this_one() {
        let bar = indicatif::ProgressBar::hidden();
        let line = br#"{"id":"a","text":"t","job":"other"}"#;
        assert_eq!(message_data(line, 1, Some("j"), &bar), None);
        assert!(message_data(line, 1, None, &bar).is_some());
        assert!(message_data(line, 1, Some("other"), &bar).is_some());
    }
}
