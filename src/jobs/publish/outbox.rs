//! The messages on their way out: gathered in chunks, each chunk's ids registered with the job
//! before its messages are published, at most `--max-publish-bytes` held at once, every
//! publish awaited, and each shard marked finished in the job once all of its publishes are
//! confirmed.

use super::{JobTarget, PublishError, PublishSummary};
use crate::external::store::{RefusedLine, Registration};
use futures::future::{Join, Ready};
use futures::stream::{FuturesUnordered, StreamExt};
use google_cloud_pubsub::client::Publisher;
use google_cloud_pubsub::model::Message;
use google_cloud_pubsub::publisher::PublishFuture;
use std::collections::BTreeSet;

/// Most publishes awaited at once.
const IN_FLIGHT: usize = 2000;

/// Failed publishes logged one by one (the final count has all of them).
const LOGGED_FAILURES: u64 = 5;

/// Records registered (and looked up for `--skip-done`) per database round trip.
const CHUNK: usize = 1000;

/// Refused rows gathered before they are written to the job (or this many kept bytes).
const REFUSED_CHUNK: usize = 1000;
const REFUSED_CHUNK_BYTES: usize = 8 << 20;

/// A message waiting for its chunk to be registered.
pub struct Queued {
    /// The record id.
    pub id: String,
    /// The message data.
    pub data: String,
    /// The columns kept with it, a JSON object.
    pub kept: Option<String>,
    /// Which shard of the input it was read from.
    pub shard: usize,
    /// Its row in the shard.
    pub row: u64,
}

impl Queued {
    /// The bytes it holds.
    fn bytes(&self) -> usize {
        self.id.len() + self.data.len() + self.kept.as_ref().map_or(0, String::len)
    }
}

/// A publish in flight, with the bytes its message holds, its shard and its row.
type InFlight = Join<PublishFuture, Ready<(usize, usize, u64)>>;

/// Where one shard's publishing stands.
#[derive(Debug, Default)]
struct ShardCount {
    /// Its name in the job.
    name: String,
    /// How its rows are named on stderr (`part-3.parquet: row`).
    label: String,
    /// Publishes not yet confirmed (or failed).
    in_flight: u64,
    /// Its records in the job (published, or left out as already done) up to the row it last
    /// saved as got through: what a re-run resumes with.
    records: u64,
    /// The rows past that point that became records since, by number: they move into
    /// `records` as the point passes them, so a re-run that reads them again counts them once.
    recent: BTreeSet<u64>,
    /// Publishes that failed: the shard is not finished, a re-run publishes it again.
    failed: u64,
    /// All its rows were read and handed on.
    read: bool,
    /// Marked finished in the job.
    finished: bool,
    /// With a job: the rows handed on and not yet settled (published, refused and its refusal
    /// written to the job, or already done); a failed publish stays here, so a re-run reads
    /// from before it.
    unsettled: BTreeSet<u64>,
    /// The last row handed on.
    handed: u64,
    /// The rows the job has recorded as got through.
    saved: u64,
}

impl ShardCount {
    /// Every row up to this one is settled.
    fn rows_done(&self) -> u64 {
        self.unsettled
            .first()
            .map_or(self.handed, |first| first - 1)
    }

    /// Row `row` became a record (its publish confirmed, or it was already done): settled.
    fn counted(&mut self, row: u64) {
        self.unsettled.remove(&row);
        self.recent.insert(row);
    }

    /// All its records so far, wherever the resume point is.
    fn all_records(&self) -> u64 {
        self.records + self.recent.len() as u64
    }

    /// Moves the point a re-run resumes from to [`Self::rows_done`], with the records up to
    /// it; `None` when it has not moved.
    fn advance(&mut self) -> Option<(u64, u64)> {
        let done = self.rows_done();
        if done <= self.saved {
            return None;
        }
        let later = self.recent.split_off(&(done + 1));
        self.records += self.recent.len() as u64;
        self.recent = later;
        self.saved = done;
        Some((done, self.records))
    }
}

/// The publishes in flight and the chunk of messages waiting to be registered and sent.
pub struct Outbox<'a> {
    publisher: &'a Publisher,
    target: Option<JobTarget<'a>>,
    /// The input's hash: a repeat is an id read twice from it.
    source: i64,
    pending: FuturesUnordered<InFlight>,
    chunk: Vec<Queued>,
    /// The chunk's message bytes (counted in `held` too).
    chunk_bytes: usize,
    /// The message bytes held now (chunk and in flight), their peak and the bound.
    held: usize,
    peak: usize,
    max: usize,
    /// Refused rows not yet written to the job (by shard), and the bytes they keep.
    refused: Vec<(usize, RefusedLine)>,
    refused_bytes: usize,
    shards: Vec<ShardCount>,
    /// Where refusals are printed above.
    progress: &'a indicatif::ProgressBar,
    /// What happened so far.
    pub summary: PublishSummary,
}

impl<'a> Outbox<'a> {
    /// An outbox for `shards` (each its name, and how its rows are named on stderr) of an
    /// input whose hash is `source`.
    pub fn new(
        publisher: &'a Publisher,
        target: Option<JobTarget<'a>>,
        source: i64,
        shards: impl Iterator<Item = (String, String)>,
        max: usize,
        progress: &'a indicatif::ProgressBar,
    ) -> Self {
        Self {
            publisher,
            target,
            source,
            pending: FuturesUnordered::new(),
            chunk: Vec::with_capacity(CHUNK),
            chunk_bytes: 0,
            held: 0,
            peak: 0,
            max,
            refused: Vec::new(),
            refused_bytes: 0,
            shards: shards
                .map(|(name, label)| ShardCount {
                    name,
                    label,
                    ..Default::default()
                })
                .collect(),
            progress,
            summary: PublishSummary::default(),
        }
    }

    /// Goes on from an earlier run that got through `rows` rows of `shard`, `records` of them
    /// records.
    pub fn resume(&mut self, shard: usize, rows: u64, records: u64) {
        let s = &mut self.shards[shard];
        (s.handed, s.saved, s.records) = (rows, rows, records);
    }

    /// Notes row `n` of `shard` as handed on, and unsettled until `settled` says otherwise.
    fn hand(&mut self, shard: usize, n: u64, settled: bool) {
        if self.target.is_none() {
            return;
        }
        let s = &mut self.shards[shard];
        s.handed = s.handed.max(n);
        if !settled {
            s.unsettled.insert(n);
        }
    }

    /// Notes row `n` of `shard` as settled with nothing to send (a blank line).
    pub fn pass(&mut self, shard: usize, n: u64) {
        self.hand(shard, n, true);
    }

    /// Prints why row `n` of `shard` is refused, counts it and, with a job, queues it (`line`
    /// builds it: without a job its hash is not computed); a full queue is written.
    pub async fn refuse(
        &mut self,
        shard: usize,
        n: u64,
        error: &str,
        line: impl FnOnce() -> RefusedLine,
    ) -> Result<(), PublishError> {
        let label = &self.shards[shard].label;
        self.progress
            .suspend(|| eprintln!("{label} {n}: {error}; skipped"));
        self.summary.skipped += 1;
        if self.target.is_none() {
            return Ok(());
        }
        self.hand(shard, n, false);
        let line = line();
        self.refused_bytes += line.raw.len();
        self.refused.push((shard, line));
        if self.refused.len() >= REFUSED_CHUNK || self.refused_bytes >= REFUSED_CHUNK_BYTES {
            self.write_refused().await?;
        }
        Ok(())
    }

    /// Writes the queued refused rows to the job, under their shards.
    async fn write_refused(&mut self) -> Result<(), PublishError> {
        let refused = std::mem::take(&mut self.refused);
        self.refused_bytes = 0;
        let Some(t) = self.target else { return Ok(()) };
        let mut start = 0;
        while start < refused.len() {
            let shard = refused[start].0;
            let end = start + refused[start..].iter().take_while(|r| r.0 == shard).count();
            let lines: Vec<RefusedLine> = refused[start..end].iter().map(|r| r.1.clone()).collect();
            t.store
                .refuse_lines(t.job, &self.shards[shard].name, &lines)
                .await?;
            // Recorded as refused: settled, so the resume point may pass them.
            for line in &lines {
                self.shards[shard].unsettled.remove(&(line.line as u64));
            }
            start = end;
        }
        Ok(())
    }

    /// Queues one message, once what is held leaves room for it; a chunk full by count, or
    /// holding half the bound, is sent.
    pub async fn add(&mut self, message: Queued) -> Result<(), PublishError> {
        let size = message.bytes();
        self.hand(message.shard, message.row, false);
        self.make_room(size).await?;
        self.held += size;
        self.peak = self.peak.max(self.held);
        self.chunk_bytes += size;
        self.chunk.push(message);
        if self.chunk.len() >= CHUNK || self.chunk_bytes >= self.max / 2 {
            self.send_chunk().await?;
        }
        Ok(())
    }

    /// Waits for publishes in flight (sending the chunk first when nothing else is in flight)
    /// until `size` more bytes fit under the bound. A message is at most
    /// [`crate::jobs::input::MAX_LINE_BYTES`] and the bound at least that, so room always comes.
    async fn make_room(&mut self, size: usize) -> Result<(), PublishError> {
        while self.held + size > self.max {
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
        let Some((r, (size, shard, row))) = self.pending.next().await else {
            return;
        };
        self.held = self.held.saturating_sub(size);
        let count = &mut self.shards[shard];
        count.in_flight -= 1;
        match r {
            Ok(_) => {
                self.summary.published += 1;
                // Without a job nothing is resumed: no row needs keeping (as `hand` keeps none).
                if self.target.is_some() {
                    count.counted(row);
                }
            }
            Err(e) => {
                self.summary.failed += 1;
                count.failed += 1;
                // The first few, then a count: a topic that does not exist fails every publish.
                match self.summary.failed {
                    ..=LOGGED_FAILURES => {
                        tracing::error!(error = %e, shard = %count.name, "publish failed")
                    }
                    n if n == LOGGED_FAILURES + 1 => {
                        tracing::error!("more publishes failed; the rest are counted, not logged")
                    }
                    _ => {}
                }
            }
        }
    }

    /// Registers the chunk's records with the job (refusing repeats, and with `skip_done`
    /// dropping those already done), then publishes its messages.
    async fn send_chunk(&mut self) -> Result<(), PublishError> {
        let mut chunk = std::mem::take(&mut self.chunk);
        self.chunk_bytes = 0;
        if let Some(t) = self.target {
            chunk = self.register(t, chunk).await?;
        }
        for message in chunk {
            let size = message.bytes();
            self.shards[message.shard].in_flight += 1;
            let publish = self
                .publisher
                .publish(Message::new().set_data(message.data));
            let tag = futures::future::ready((size, message.shard, message.row));
            self.pending.push(futures::future::join(publish, tag));
            if self.pending.len() >= IN_FLIGHT {
                self.settle_one().await;
            }
        }
        // Refusals queued so far are written with each chunk, so the rows they settle do not
        // hold the resume point back until the shard ends.
        if !self.refused.is_empty() {
            self.write_refused().await?;
        }
        self.save_progress().await
    }

    /// Records in the job how far each shard got, where that moved.
    async fn save_progress(&mut self) -> Result<(), PublishError> {
        let Some(t) = self.target else { return Ok(()) };
        for s in &mut self.shards {
            if let Some((done, records)) = s.advance() {
                t.store
                    .advance_input(t.job, &s.name, done as i64, records as i64)
                    .await?;
            }
        }
        Ok(())
    }

    /// Registers `chunk` with the job and returns what is left to publish: not a repeat of an
    /// earlier row, and (with `skip_done`) not done yet.
    async fn register(
        &mut self,
        t: JobTarget<'a>,
        chunk: Vec<Queued>,
    ) -> Result<Vec<Queued>, PublishError> {
        let records: Vec<Registration> = chunk
            .iter()
            .map(|m| Registration {
                id: &m.id,
                origin: origin(&self.shards[m.shard].name, m.row),
                columns: m.kept.as_deref(),
            })
            .collect();
        let repeats = t
            .store
            .register_records(t.job, self.source, &records)
            .await?;
        let done = if t.skip_done {
            let ids: Vec<&str> = chunk.iter().map(|m| m.id.as_str()).collect();
            t.store.done_ids(t.model, &ids).await?
        } else {
            Default::default()
        };
        let mut keep = Vec::with_capacity(chunk.len());
        for (i, m) in chunk.into_iter().enumerate() {
            if repeats.binary_search(&i).is_ok() {
                self.held = self.held.saturating_sub(m.bytes());
                let error = format!(
                    "id {:?} repeated: an earlier row of this input holds it",
                    m.id
                );
                let (shard, row) = (m.shard, m.row);
                let line = || RefusedLine::new(row as usize, &error, m.data.as_bytes());
                self.refuse(shard, row, &error, line).await?;
            } else if done.contains(&m.id) {
                self.held = self.held.saturating_sub(m.bytes());
                self.summary.already_done += 1;
                self.shards[m.shard].counted(m.row);
            } else {
                keep.push(m);
            }
        }
        Ok(keep)
    }

    /// Marks `shard` as read: its rows so far are sent and its refusals written, and it is
    /// marked finished in the job as soon as its publishes are all confirmed.
    pub async fn end_shard(&mut self, shard: usize) -> Result<(), PublishError> {
        self.send_chunk().await?;
        self.write_refused().await?;
        self.save_progress().await?;
        self.shards[shard].read = true;
        self.finish_shards().await
    }

    /// Marks finished, in the job, every shard read whose publishes all succeeded.
    async fn finish_shards(&mut self) -> Result<(), PublishError> {
        let Some(t) = self.target else { return Ok(()) };
        for s in &mut self.shards {
            if s.read && !s.finished && s.in_flight == 0 && s.failed == 0 {
                t.store
                    .finish_input(t.job, &s.name, s.all_records() as i64)
                    .await?;
                s.finished = true;
            }
        }
        Ok(())
    }

    /// Sends the last chunk, writes the last refused rows, waits for every publish and marks
    /// the shards finished.
    pub async fn finish(mut self) -> Result<PublishSummary, PublishError> {
        self.send_chunk().await?;
        self.write_refused().await?;
        self.publisher.flush().await;
        while !self.pending.is_empty() {
            self.settle_one().await;
        }
        self.save_progress().await?;
        self.finish_shards().await?;
        self.summary.held_bytes_peak = self.peak as u64;
        Ok(self.summary)
    }
}

/// Where a record was read, as a number: the first 8 bytes of the SHA-256 of its shard's name
/// and its row.
fn origin(shard: &str, row: u64) -> i64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(shard.as_bytes());
    h.update(row.to_le_bytes());
    hash64(h)
}

/// The input's hash, as [`origin`] makes one.
pub fn source(name: &str) -> i64 {
    use sha2::{Digest, Sha256};
    hash64(Sha256::new_with_prefix(name.as_bytes()))
}

fn hash64(h: sha2::Sha256) -> i64 {
    use sha2::Digest;
    let d = h.finalize();
    i64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}
