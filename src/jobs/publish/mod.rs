//! `spotinfer publish`: an input in, one Pub/Sub message per valid record out.
//!
//! The input's shards ([`crate::jobs::input`]) are read one after another, each on a blocking
//! thread, and their rows made into messages ([`message`]; an OpenAI batch request line becomes the
//! record it asks for, [`openai_batch`]). A bad row is reported on stderr
//! with its shard and row (or line) number and skipped, never silently; with a job it is also
//! recorded in the job (row number, reason, its bytes), so a batch user accounts for every row
//! of the input. Publishes are pipelined ([`outbox`]: many in flight, batched by the client,
//! each awaited), so the final count is what Pub/Sub confirmed. With a job, every shard is
//! marked as being published before the first message goes out (the job cannot look complete
//! part-way) and finished once its publishes are confirmed: a re-run skips the finished ones.

pub mod message;
pub mod openai_batch;
pub mod outbox;

pub use message::message_data;

use crate::external::gcs::Gcs;
use crate::external::pubsub::QueueError;
use crate::external::store::{RefusedLine, Store, StoreError};
use crate::jobs::input::columns::{Columns, Kept};
use crate::jobs::input::read::{self, Batch, Row, RowKind};
use crate::jobs::input::{Format, Input, InputError, Shard, MAX_LINE_BYTES};
use crate::record::generation::Constraint;
use google_cloud_pubsub::client::Publisher;
use outbox::{Outbox, Queued};

/// Errors publishing an input.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The input cannot be read, or its columns do not fit the mapping.
    #[error(transparent)]
    Input(#[from] InputError),
    /// Pub/Sub refused.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The job's records could not be registered (nothing of theirs was published).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// This input keeps other columns than the job's earlier inputs did.
    #[error("job {job} keeps the columns {has}; this input keeps {wants}")]
    KeptColumns {
        /// The job.
        job: String,
        /// What the job keeps.
        has: String,
        /// What this input keeps.
        wants: String,
    },
}

/// What a publish run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PublishSummary {
    /// Messages Pub/Sub confirmed.
    pub published: u64,
    /// Rows skipped as invalid (with a job: recorded in it as refused).
    pub skipped: u64,
    /// Publishes that failed.
    pub failed: u64,
    /// Records not published because they already have a result (`--skip-done`).
    pub already_done: u64,
    /// Most message bytes held at once (read ahead and in flight): what `--max-publish-bytes`
    /// bounds, reported so the bound can be checked.
    pub held_bytes_peak: u64,
    /// Rows read (blank lines aside).
    pub rows: u64,
    /// Shards read this time.
    pub shards: u64,
    /// Shards an earlier run finished, skipped.
    pub shards_skipped: u64,
    /// Rows an earlier, interrupted run got through, not read again.
    pub rows_resumed: u64,
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

/// A publish: where messages go, how rows become records, and the job they feed.
pub struct Publish<'a> {
    /// The topic's publisher.
    pub publisher: &'a Publisher,
    /// Reads `gs://` shards.
    pub gcs: Option<&'a Gcs>,
    /// How a table's columns make records; `None`: JSON lines as they are (and a table's
    /// columns named as the message contract's keys).
    pub columns: Option<&'a Columns>,
    /// The job stamped on records that carry none.
    pub job: Option<&'a str>,
    /// The constraint stamped on generation records that carry none (`--response-format`).
    pub response_format: Option<&'a Constraint>,
    /// The job's bookkeeping.
    pub target: Option<JobTarget<'a>>,
    /// Publish every shard from its first row, even those an earlier run to the job finished
    /// or got part-way through.
    pub republish: bool,
    /// `--max-publish-bytes`.
    pub max_held_bytes: usize,
    /// Advances by the input's bytes read; its message counts rows.
    pub progress: &'a indicatif::ProgressBar,
}

impl Publish<'_> {
    /// Publishes every valid row of `input`'s shards (those an earlier run to the same job
    /// did not finish).
    pub async fn run(&self, input: &Input) -> Result<PublishSummary, PublishError> {
        let finished = match self.target {
            Some(t) if !self.republish => t.store.finished_inputs(t.job).await?,
            _ => Default::default(),
        };
        let names = input
            .shards
            .iter()
            .map(|s| (s.name.clone(), label(input, s)));
        let mut out = Outbox::new(
            self.publisher,
            self.target,
            outbox::source(&input.name),
            names,
            self.max_held_bytes,
            self.progress,
        );
        // A finished shard is skipped, unless its content changed since: then it is refused
        // as a part-way one is (`Store::start_input`), rather than left unread.
        for shard in &input.shards {
            let Some(done) = finished.get(&shard.name) else {
                continue;
            };
            if let Some(was) = done.version.as_ref().filter(|was| **was != shard.version) {
                return Err(StoreError::InputChanged {
                    job: self.target.map_or_else(String::new, |t| t.job.to_string()),
                    input: shard.name.clone(),
                    rows: done.rows,
                    was: was.clone(),
                    now: shard.version.clone(),
                }
                .into());
            }
        }
        let todo: Vec<usize> = (0..input.shards.len())
            .filter(|&i| !finished.contains_key(&input.shards[i].name))
            .collect();
        out.summary.shards_skipped = (input.shards.len() - todo.len()) as u64;
        self.progress.inc(
            input
                .shards
                .iter()
                .filter(|s| finished.contains_key(&s.name))
                .map(|s| s.size)
                .sum(),
        );
        // Every shard is marked as being published before the first message goes out.
        let mut skip = vec![0u64; input.shards.len()];
        if let Some(t) = self.target {
            for &i in &todo {
                let shard = &input.shards[i];
                let resume = !self.republish;
                let (rows, records) = t
                    .store
                    .start_input(t.job, &shard.name, &shard.version, resume)
                    .await?;
                skip[i] = rows as u64;
                out.resume(i, rows as u64, records as u64);
            }
        }
        for &i in &todo {
            self.shard(input, i, skip[i], &mut out).await?;
            out.summary.shards += 1;
            out.summary.rows_resumed += skip[i];
        }
        out.finish().await
    }

    /// Reads shard `i` on a blocking thread, past its first `skip` rows (an earlier run got
    /// through them), and hands its rows to `out`.
    async fn shard(
        &self,
        input: &Input,
        i: usize,
        skip: u64,
        out: &mut Outbox<'_>,
    ) -> Result<(), PublishError> {
        let shard = input.shards[i].clone();
        let bytes = crate::jobs::input::open(&shard, self.gcs).await?;
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Batch>(4);
        let columns = self.columns.cloned();
        let reading = shard.clone();
        let reader = tokio::task::spawn_blocking(move || {
            read::rows(&reading, bytes, columns.as_ref(), skip, &tx)
        });
        while let Some(batch) = rx.recv().await {
            if let Some(kept) = &batch.kept {
                self.check_kept(kept).await?;
            }
            for row in batch.rows {
                self.row(row, i, out).await?;
            }
            self.progress.inc(batch.bytes);
            let s = &out.summary;
            self.progress.set_message(format!(
                "{} rows read, {} published, {} refused",
                s.rows, s.published, s.skipped
            ));
        }
        reader.await.map_err(|e| InputError::Unreadable {
            shard: shard.name.clone(),
            reason: e.to_string(),
        })??;
        out.end_shard(i).await
    }

    /// Checks this input's kept columns against the job's (the first input that keeps any sets
    /// them).
    async fn check_kept(&self, kept: &[Kept]) -> Result<(), PublishError> {
        let Some(t) = self.target.filter(|_| !kept.is_empty()) else {
            return Ok(());
        };
        let wants = serde_json::to_string(kept).unwrap_or_default();
        let has = t.store.set_job_columns(t.job, &wants).await?;
        if has != wants {
            return Err(PublishError::KeptColumns {
                job: t.job.to_string(),
                has,
                wants,
            });
        }
        Ok(())
    }

    /// One row: queued as a message, or refused (printed, and recorded in the job).
    async fn row(&self, row: Row, shard: usize, out: &mut Outbox<'_>) -> Result<(), PublishError> {
        let n = row.number;
        out.summary.rows += 1;
        let (line, kept) = match row.kind {
            RowKind::TooLong { start, len, sha256 } => {
                let error = format!(
                    "longer than {MAX_LINE_BYTES} bytes (Pub/Sub's message limit): {len} bytes"
                );
                let line = || RefusedLine::from_prefix(n as usize, &error, &start, len, sha256);
                return out.refuse(shard, n, &error, line).await;
            }
            RowKind::Refused { error, raw, id } => {
                let line = || RefusedLine::new(n as usize, &error, &raw).with_record_id(id);
                return out.refuse(shard, n, &error, line).await;
            }
            RowKind::Line(line) => (line, None),
            RowKind::Mapped { record, kept } => (record.into_bytes(), kept),
        };
        match message_data(&line, self.job, self.response_format) {
            Ok(Some((id, data))) => {
                let queued = Queued {
                    id,
                    data,
                    kept,
                    shard,
                    row: n,
                };
                out.add(queued).await
            }
            Ok(None) => {
                out.summary.rows -= 1; // a blank line is no row
                out.pass(shard, n);
                Ok(())
            }
            Err(error) => {
                let refused = || RefusedLine::new(n as usize, &error, &line);
                out.refuse(shard, n, &error, refused).await
            }
        }
    }
}

/// How a shard's refused rows are named on stderr: `line` of JSON lines, `row` of a table,
/// after the shard's name when the input has several (`part-3.parquet: row`).
fn label(input: &Input, shard: &Shard) -> String {
    let unit = if shard.format == Format::Jsonl {
        "line"
    } else {
        "row"
    };
    match input.shards.len() {
        1 => unit.to_string(),
        _ => format!("{}: {unit}", shard.rel),
    }
}
