//! `spotinfer publish`: JSONL in, one Pub/Sub message per valid line out.
//!
//! Lines are validated against the same contract the worker enforces; a bad line is reported on
//! stderr with its line number and skipped, never silently, and with `--job` it is recorded in
//! the job (line number, reason, its bytes): a batch user accounts for every line of the input.
//! Publishes are pipelined (many in flight, batched by the client) and each one is awaited, so
//! the final count is what Pub/Sub confirmed.

use crate::external::pubsub::QueueError;
use crate::external::store::{RefusedLine, Store, StoreError, REFUSED_RAW_BYTES};
use crate::record;
use futures::future::{Join, Ready};
use futures::stream::{FuturesUnordered, StreamExt};
use google_cloud_pubsub::client::Publisher;
use google_cloud_pubsub::model::Message;
use google_cloud_pubsub::publisher::PublishFuture;
use sha2::{Digest, Sha256};
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
    /// Lines skipped as invalid (with a job: recorded in it as refused).
    pub skipped: u64,
    /// Publishes that failed.
    pub failed: u64,
    /// Records not published because they already have a result (`--skip-done`).
    pub already_done: u64,
    /// Most message bytes held at once (read ahead and in flight): what `--max-publish-bytes`
    /// bounds, reported so the bound can be checked.
    pub held_bytes_peak: u64,
}

/// The job a publish feeds: every record id is registered in the database before its message
/// is published, so the job's total survives a crash and a re-run without doubling.
#[derive(Debug, Clone, Copy)]
pub struct JobTarget<'a> {
    /// Where jobs are kept.
    pub store: &'a Store,
    /// The job.
    pub job: &'a str,
    /// The input's name in the job (its refused lines are kept under it).
    pub input: &'a str,
    /// Its model (what "done" means for `skip_done`).
    pub model: &'a str,
    /// Publish only records with no result from `model` yet.
    pub skip_done: bool,
}

/// Most publishes awaited at once.
const IN_FLIGHT: usize = 2000;

/// Records registered (and looked up for `--skip-done`) per database round trip.
const CHUNK: usize = 1000;

/// Refused lines gathered before they are written to the job (or this many kept bytes).
const REFUSED_CHUNK: usize = 1000;
const REFUSED_CHUNK_BYTES: usize = 8 << 20;

/// The longest line read: Pub/Sub's 10 MB message limit. A longer line is reported and skipped
/// without being held in memory.
pub const MAX_LINE_BYTES: usize = 10_000_000;

/// Publishes every valid line of `input`, stamping `job` on records that carry none. Reads as it
/// publishes: memory holds a chunk of lines and the publishes in flight, whatever the input's
/// size, together at most `max_held_bytes` of messages (plus the line being read and its parse,
/// each at most [`MAX_LINE_BYTES`], and the refused lines waiting to be recorded). With a `target`, each chunk's ids are registered with the job before its messages go
/// out, and every refused line is recorded in the job. `progress` advances by the bytes read.
pub async fn publish_lines(
    publisher: &Publisher,
    mut input: impl AsyncBufRead + Unpin,
    job: Option<&str>,
    target: Option<JobTarget<'_>>,
    max_held_bytes: usize,
    progress: &indicatif::ProgressBar,
) -> Result<PublishSummary, PublishError> {
    let mut out = Outbox {
        publisher,
        target,
        pending: FuturesUnordered::new(),
        chunk: Vec::with_capacity(CHUNK),
        chunk_bytes: 0,
        held: Held {
            bytes: 0,
            peak: 0,
            max: max_held_bytes,
        },
        refused: Vec::new(),
        refused_bytes: 0,
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
        if let Some(sha256) = read.too_long {
            let error = format!(
                "longer than {MAX_LINE_BYTES} bytes (Pub/Sub's message limit): {} bytes",
                read.len
            );
            progress.suspend(|| eprintln!("line {n}: {error}; skipped"));
            out.refuse(|| RefusedLine::from_prefix(n, &error, &line, read.len, sha256))
                .await?;
            continue;
        }
        match message_data(&line, job) {
            Ok(Some(message)) => out.add(message).await?,
            Ok(None) => {}
            Err(error) => {
                progress.suspend(|| eprintln!("line {n}: {error}; skipped"));
                out.refuse(|| RefusedLine::new(n, &error, &line)).await?;
            }
        }
    }
    out.finish().await
}

/// A publish in flight, with the bytes its message holds until Pub/Sub confirms it.
type InFlight = Join<PublishFuture, Ready<usize>>;

/// The message bytes publish holds: read ahead into the chunk, and in flight.
struct Held {
    bytes: usize,
    peak: usize,
    /// `--max-publish-bytes`.
    max: usize,
}

impl Held {
    fn take(&mut self, n: usize) {
        self.bytes += n;
        self.peak = self.peak.max(self.bytes);
    }

    fn release(&mut self, n: usize) {
        self.bytes = self.bytes.saturating_sub(n);
    }
}

/// The bytes one (id, data) message holds.
fn message_bytes((id, data): &(String, String)) -> usize {
    id.len() + data.len()
}

/// The publishes in flight and the chunk of messages waiting to be registered and sent.
struct Outbox<'a> {
    publisher: &'a Publisher,
    target: Option<JobTarget<'a>>,
    pending: FuturesUnordered<InFlight>,
    chunk: Vec<(String, String)>,
    /// The chunk's message bytes (counted in `held` too).
    chunk_bytes: usize,
    held: Held,
    /// Refused lines not yet written to the job, and the bytes they keep.
    refused: Vec<RefusedLine>,
    refused_bytes: usize,
    summary: PublishSummary,
}

impl Outbox<'_> {
    /// Counts a refused line and, with a job, queues it (`line` builds it: without a job its
    /// hash is not computed); a full queue is written.
    async fn refuse(&mut self, line: impl FnOnce() -> RefusedLine) -> Result<(), PublishError> {
        self.summary.skipped += 1;
        if self.target.is_none() {
            return Ok(());
        }
        let line = line();
        self.refused_bytes += line.raw.len();
        self.refused.push(line);
        if self.refused.len() >= REFUSED_CHUNK || self.refused_bytes >= REFUSED_CHUNK_BYTES {
            self.write_refused().await?;
        }
        Ok(())
    }

    /// Writes the queued refused lines to the job.
    async fn write_refused(&mut self) -> Result<(), PublishError> {
        if let Some(t) = self.target {
            if !self.refused.is_empty() {
                t.store.refuse_lines(t.job, t.input, &self.refused).await?;
            }
        }
        self.refused.clear();
        self.refused_bytes = 0;
        Ok(())
    }

    /// Queues one (id, data) message, once what is held leaves room for it; a chunk full by
    /// count, or holding half the bound, is sent.
    async fn add(&mut self, message: (String, String)) -> Result<(), PublishError> {
        let size = message_bytes(&message);
        self.make_room(size).await?;
        self.held.take(size);
        self.chunk_bytes += size;
        self.chunk.push(message);
        if self.chunk.len() >= CHUNK || self.chunk_bytes >= self.held.max / 2 {
            self.send_chunk().await?;
        }
        Ok(())
    }

    /// Waits for publishes in flight (sending the chunk first when nothing else is in flight)
    /// until `size` more bytes fit under the bound. A message is at most [`MAX_LINE_BYTES`] and
    /// the bound at least that, so room always comes.
    async fn make_room(&mut self, size: usize) -> Result<(), PublishError> {
        while self.held.bytes + size > self.held.max {
            if !self.pending.is_empty() {
                self.settle_one().await;
            } else if !self.chunk.is_empty() {
                self.send_chunk().await?;
            } else {
                break;
            }
        }
        Ok(())
    }

    /// Waits for the oldest-finishing publish in flight and releases its bytes.
    async fn settle_one(&mut self) {
        if let Some((r, size)) = self.pending.next().await {
            settle(Some(r), &mut self.summary);
            self.held.release(size);
        }
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
                let held = &mut self.held;
                chunk.retain(|m| {
                    let keep = !done.contains(&m.0);
                    if !keep {
                        held.release(message_bytes(m));
                    }
                    keep
                });
                self.summary.already_done += (before - chunk.len()) as u64;
            }
        }
        self.chunk_bytes = 0;
        for message in chunk {
            let size = message_bytes(&message);
            let publish = self.publisher.publish(Message::new().set_data(message.1));
            self.pending
                .push(futures::future::join(publish, futures::future::ready(size)));
            if self.pending.len() >= IN_FLIGHT {
                self.settle_one().await;
            }
        }
        Ok(())
    }

    /// Sends the last chunk, writes the last refused lines and waits for every publish.
    async fn finish(mut self) -> Result<PublishSummary, PublishError> {
        self.send_chunk().await?;
        self.write_refused().await?;
        self.publisher.flush().await;
        while !self.pending.is_empty() {
            self.settle_one().await;
        }
        self.summary.held_bytes_peak = self.held.peak as u64;
        Ok(self.summary)
    }
}

/// The record id and message data for a line, `None` for a blank line, or why the line is
/// refused. With a `job`, a record that names another job is refused: a job's count must hold
/// exactly what was published to it.
fn message_data(line: &[u8], job: Option<&str>) -> Result<Option<(String, String)>, String> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    // Lines are bytes: an invalid UTF-8 line is refused like any other bad line.
    let mut rec = record::parse(line, usize::MAX).map_err(|e| e.to_string())?;
    match (&rec.job, job) {
        (Some(own), Some(j)) if own != j => {
            return Err(format!("the record names job {own:?}, not {j:?}"));
        }
        (None, _) => rec.job = job.map(str::to_string),
        _ => {}
    }
    let data = record_json(&rec).to_string();
    // The message is the record re-written (with the job added): it can outgrow the line.
    if data.len() > MAX_LINE_BYTES {
        return Err(format!(
            "the message would be {} bytes, more than {MAX_LINE_BYTES} (Pub/Sub's message limit)",
            data.len()
        ));
    }
    Ok(Some((rec.id, data)))
}

/// The message data for a parsed record: what the worker's contract reads, nothing else.
fn record_json(rec: &record::Record) -> serde_json::Value {
    let inline = match &rec.image {
        Some(record::Image {
            data: record::ImageData::Encoded(bytes),
            ..
        }) => Some(bytes),
        _ => None,
    };
    if let Some(g) = &rec.generation {
        return generation_json(rec, g);
    }
    let mut data = match (&rec.uri, inline) {
        (Some(uri), _) => serde_json::json!({"id": rec.id, "uri": uri, "job": rec.job}),
        (None, Some(bytes)) => {
            use base64::Engine;
            let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
            serde_json::json!({"id": rec.id, "image_base64": b64, "job": rec.job})
        }
        (None, None) => serde_json::json!({"id": rec.id, "text": rec.text, "job": rec.job}),
    };
    if let Some(name) = &rec.prompt_name {
        data["prompt_name"] = serde_json::Value::from(name.as_str());
    }
    if let Some(pair) = &rec.text_pair {
        data["text_pair"] = serde_json::Value::from(pair.as_str());
    }
    data
}

/// A generation record's message data: its prompt or messages and the options it gave (its
/// seed written out, the one the worker would derive from the id when it gave none).
fn generation_json(
    rec: &record::Record,
    g: &crate::model::engines::decoder::Input,
) -> serde_json::Value {
    use crate::model::engines::decoder::Prompt;
    let mut data = serde_json::json!({"id": rec.id, "job": rec.job, "seed": g.seed});
    match &g.prompt {
        Prompt::Raw(p) => data["prompt"] = p.as_str().into(),
        Prompt::Chat(m) => data["messages"] = serde_json::json!(m),
    }
    let options = [
        (
            "max_new_tokens",
            g.max_new_tokens.map(serde_json::Value::from),
        ),
        ("temperature", g.temperature.map(serde_json::Value::from)),
        ("top_p", g.top_p.map(serde_json::Value::from)),
        ("top_k", g.top_k.map(serde_json::Value::from)),
    ];
    for (key, value) in options {
        if let Some(v) = value {
            data[key] = v;
        }
    }
    if !g.stop.is_empty() {
        data["stop"] = serde_json::json!(g.stop);
    }
    data
}

/// What [`next_line`] read.
struct LineRead {
    /// Bytes consumed, newline included.
    bytes: usize,
    /// The line's length, newline excluded.
    len: usize,
    /// The line was longer than the limit: `line` holds only its start, and this is the hex
    /// SHA-256 of the whole line (measured as it streamed past).
    too_long: Option<String>,
}

/// Reads the next line (without its newline) into `line`, keeping at most `max` bytes of it;
/// `None` at the end of the input. Once a line is past `max`, only its first
/// [`REFUSED_RAW_BYTES`] are kept (all a refusal stores).
async fn next_line(
    input: &mut (impl AsyncBufRead + Unpin),
    line: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Option<LineRead>> {
    line.clear();
    let mut read = LineRead {
        bytes: 0,
        len: 0,
        too_long: None,
    };
    let mut hasher: Option<Sha256> = None;
    loop {
        let buf = input.fill_buf().await?;
        if buf.is_empty() {
            read.too_long = hasher.map(|h| hex::encode(h.finalize()));
            return Ok((read.bytes > 0).then_some(read));
        }
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..=i], true),
            None => (buf, false),
        };
        let content = chunk.strip_suffix(b"\n").unwrap_or(chunk);
        if hasher.is_none() && line.len() + content.len() > max {
            let mut h = Sha256::new();
            h.update(&line);
            line.truncate(REFUSED_RAW_BYTES);
            hasher = Some(h);
        }
        match &mut hasher {
            Some(h) => {
                h.update(content);
                let room = REFUSED_RAW_BYTES.saturating_sub(line.len());
                line.extend_from_slice(&content[..content.len().min(room)]);
            }
            None => line.extend_from_slice(content),
        }
        read.len += content.len();
        let used = chunk.len();
        input.consume(used);
        read.bytes += used;
        if done {
            read.too_long = hasher.map(|h| hex::encode(h.finalize()));
            return Ok(Some(read));
        }
    }
}

/// Counts a publish's outcome.
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
    fn a_published_record_keeps_its_prompt_name_and_pair_and_gains_the_job() {
        let line = br#"{"id":"q1","text":"how far","prompt_name":"query","text_pair":"a mile"}"#;
        let (id, data) = message_data(line, Some("j"))
            .expect("a valid line")
            .expect("not blank");
        assert_eq!(id, "q1");
        let back = record::parse(data.as_bytes(), usize::MAX).expect("the worker reads it");
        assert_eq!(back.prompt_name.as_deref(), Some("query"));
        assert_eq!(back.text_pair.as_deref(), Some("a mile"));
        assert_eq!(back.job.as_deref(), Some("j"));
        assert_eq!(back.text, "how far");
    }

    #[test]
    fn a_record_naming_another_job_is_not_counted_in_this_one() {
        let line = br#"{"id":"a","text":"t","job":"other"}"#;
        let refused = message_data(line, Some("j")).expect_err("another job's record");
        assert!(refused.contains("names job \"other\""), "{refused}");
        assert!(matches!(message_data(line, None), Ok(Some(_))));
        assert!(matches!(message_data(line, Some("other")), Ok(Some(_))));
        assert_eq!(
            message_data(b"  \t", Some("j")),
            Ok(None),
            "blank: not refused"
        );
    }

    /// A line past the limit is read to its end without being held: its first 64 KiB, its
    /// length and the SHA-256 of all of it; the next line reads normally.
    #[tokio::test]
    async fn an_over_long_line_keeps_its_start_size_and_hash() {
        let long: Vec<u8> = (0..300_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let mut input = long.clone();
        input.extend_from_slice(b"\nnext\n");
        // A small buffer, so the line arrives in many pieces.
        let mut reader = tokio::io::BufReader::with_capacity(4096, input.as_slice());
        let mut line = Vec::new();
        let read = next_line(&mut reader, &mut line, 100_000)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(read.len, long.len());
        assert_eq!(read.bytes, long.len() + 1);
        assert_eq!(read.too_long, Some(hex::encode(Sha256::digest(&long))));
        assert_eq!(line, &long[..REFUSED_RAW_BYTES]);
        let read = next_line(&mut reader, &mut line, 100_000)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((read.too_long, line.as_slice()), (None, &b"next"[..]));
        assert!(next_line(&mut reader, &mut line, 100_000)
            .await
            .unwrap()
            .is_none());
    }
}
