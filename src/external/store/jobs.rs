//! Jobs: the records a publish registered, and how far the workers are with them.
//!
//! `spotinfer publish --job J` writes every record id it publishes into `job_records` *before*
//! the message goes out, so the expected total is a count of distinct ids: a publish that crashed
//! and is run again cannot double it, and a record published twice counts once. Done, failed and
//! remaining are then joins against the result and failure tables, for the job's model.
//!
//! A line the publish refuses (not a valid record) is never published but still belongs to the
//! job: it goes into `job_refused_lines` with its line number, the reason and its bytes, so
//! `status` can count it and `export --failed` can list it beside the workers' failure rows.

use super::{Store, StoreError};
use futures::stream::{BoxStream, StreamExt};
use sha2::{Digest, Sha256};
use sqlx::Row;
use std::collections::HashSet;

/// Most ids one registration or lookup statement carries (well under both databases' limits).
pub(super) const IDS_PER_STATEMENT: usize = 1000;

/// Refused lines per INSERT: 8 binds each, well under both databases' limits, and at most
/// 6.4 MiB of kept bytes per statement.
const REFUSED_PER_STATEMENT: usize = 100;

/// How much of a refused line is kept: enough to see what is wrong with it, bounded so a file of
/// 10 MB garbage lines cannot fill the database. Its full size and SHA-256 are kept beside it.
pub const REFUSED_RAW_BYTES: usize = 64 * 1024;

/// One input line a publish refused, as stored in `job_refused_lines`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedLine {
    /// 1-based line number in the input: how the user finds it.
    pub line: i64,
    /// Why it was refused, as `publish` printed it (NULs written as `\u0000`).
    pub error: String,
    /// The line's first [`REFUSED_RAW_BYTES`] bytes, newline excluded, as read (any bytes).
    pub raw: Vec<u8>,
    /// The whole line's size in bytes: more than `raw.len()` when it was cut.
    pub raw_bytes: i64,
    /// Hex SHA-256 of the whole line, to match it against the input even when `raw` was cut.
    pub raw_sha256: String,
    /// The record id the row names, where the reader could tell it (a table row's id column,
    /// read before what refused it); else `export --failed` reads it from `raw` if it can.
    pub record_id: Option<String>,
}

impl RefusedLine {
    /// Line `line`, refused for `error`, whose bytes (all of them) are `data`.
    pub fn new(line: usize, error: &str, data: &[u8]) -> Self {
        Self::from_prefix(
            line,
            error,
            data,
            data.len(),
            hex::encode(Sha256::digest(data)),
        )
    }

    /// Line `line`, refused for `error`, of which only `prefix` was kept in memory: its full
    /// size and SHA-256 were measured while it was read (a line too large to be a message).
    pub fn from_prefix(
        line: usize,
        error: &str,
        prefix: &[u8],
        raw_bytes: usize,
        raw_sha256: String,
    ) -> Self {
        Self {
            line: i64::try_from(line).unwrap_or(i64::MAX),
            error: super::storable(error),
            raw: prefix[..prefix.len().min(REFUSED_RAW_BYTES)].to_vec(),
            raw_bytes: i64::try_from(raw_bytes).unwrap_or(i64::MAX),
            raw_sha256,
            record_id: None,
        }
    }

    /// The same line, naming its record `id`.
    pub fn with_record_id(self, id: Option<String>) -> Self {
        Self {
            record_id: id.map(|id| super::storable(&id)),
            ..self
        }
    }
}

/// A refused line of a job, as exported by `export --failed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportedRefusal {
    /// The job.
    pub job: String,
    /// The input it was read from (as `job_inputs` names it).
    pub input: String,
    /// The line.
    pub refused: RefusedLine,
    /// When it was recorded, microseconds since the epoch.
    pub refused_at_us: i64,
}

/// Where a job stands.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct JobStatus {
    /// The job's name.
    pub job: String,
    /// The model whose results count as done.
    pub model: String,
    /// Distinct records published to the job.
    pub published: i64,
    /// Published records with a result from the job's model.
    pub done: i64,
    /// Published records with a failure row and no result.
    pub failed: i64,
    /// Published records with neither.
    pub remaining: i64,
    /// Input lines the publishes refused (never published; `export --failed` lists them).
    pub refused: i64,
    /// A publish to this job is running, or was interrupted and must be re-run.
    pub publishing: bool,
    /// Every published record has a result or a failure row, no publish is unfinished, and at
    /// least one line was read (refused lines do not hold a job back: they cannot succeed).
    pub complete: bool,
    /// Results committed per second over the last minute.
    pub records_per_s: f64,
    /// Seconds until `remaining` reaches 0 at that rate; `None` when nothing is moving.
    pub eta_seconds: Option<f64>,
}

/// The raw counts [`JobStatus`] is made of.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct JobCounts {
    /// Distinct records published.
    pub published: i64,
    /// With a result.
    pub done: i64,
    /// With a failure row and no result.
    pub failed: i64,
    /// Unfinished publishes.
    pub publishing: i64,
    /// Lines the publishes refused.
    pub refused: i64,
    /// Results committed in the last minute.
    pub recent: i64,
    /// Seconds from the oldest of those to now (at most 60).
    pub recent_span_s: f64,
}

impl JobStatus {
    /// The status of `job` from its counts.
    pub fn from_counts(job: &str, model: &str, c: JobCounts) -> Self {
        let remaining = (c.published - c.done - c.failed).max(0);
        let complete = (c.published > 0 || c.refused > 0) && remaining == 0 && c.publishing == 0;
        let records_per_s = if c.recent > 0 {
            c.recent as f64 / c.recent_span_s.clamp(1.0, 60.0)
        } else {
            0.0
        };
        let eta_seconds = if remaining == 0 {
            Some(0.0)
        } else if records_per_s > 0.0 {
            Some(remaining as f64 / records_per_s)
        } else {
            None
        };
        Self {
            job: job.to_string(),
            model: model.to_string(),
            published: c.published,
            done: c.done,
            failed: c.failed,
            remaining,
            refused: c.refused,
            publishing: c.publishing > 0,
            complete,
            records_per_s,
            eta_seconds,
        }
    }
}

const INSERT_JOB: &str =
    "INSERT INTO jobs (job, model) VALUES ($1, $2) ON CONFLICT (job) DO NOTHING";
const JOB_MODEL: &str = "SELECT model FROM jobs WHERE job = $1";
pub(super) const PUBLISHED: &str = "SELECT COUNT(*) FROM job_records WHERE job = $1";
pub(super) const DONE: &str = "SELECT COUNT(*) FROM job_records r JOIN embeddings e \
     ON e.record_id = r.record_id AND e.model = $2 WHERE r.job = $1";
pub(super) const FAILED: &str = "SELECT COUNT(*) FROM job_records r WHERE r.job = $1 \
     AND NOT EXISTS (SELECT 1 FROM embeddings e WHERE e.record_id = r.record_id AND e.model = $2) \
     AND EXISTS (SELECT 1 FROM failed_records f WHERE f.record_id = r.record_id AND f.job = $1)";
const PUBLISHING: &str = "SELECT COUNT(*) FROM job_inputs WHERE job = $1 AND finished_at IS NULL";
const REFUSED: &str = "SELECT COUNT(*) FROM job_refused_lines WHERE job = $1";
pub(super) const RECENT_PG: &str = "SELECT COUNT(*), \
     COALESCE(EXTRACT(EPOCH FROM now() - MIN(e.processed_at))::float8, 0) \
     FROM job_records r JOIN embeddings e ON e.record_id = r.record_id AND e.model = $2 \
     WHERE r.job = $1 AND e.processed_at > now() - interval '60 seconds'";
const RECENT_SQLITE: &str = "SELECT COUNT(*), \
     COALESCE((julianday('now') - julianday(MIN(e.processed_at))) * 86400.0, 0.0) \
     FROM job_records r JOIN embeddings e ON e.record_id = r.record_id AND e.model = $2 \
     WHERE r.job = $1 AND e.processed_at > strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-60 seconds')";
/// `{now}`: the database's current time ([`Store::now_sql`]).
const START_INPUT: &str = "INSERT INTO job_inputs (job, input) VALUES ($1, $2) \
     ON CONFLICT (job, input) DO UPDATE SET started_at = {now}, finished_at = NULL";
/// A publish that starts an input over (`--republish`, or a run not resuming).
const RESTART_INPUT: &str =
    "UPDATE job_inputs SET rows_done = 0, records = 0 WHERE job = $1 AND input = $2";
const ROWS_DONE: &str =
    "SELECT rows_done, records, version FROM job_inputs WHERE job = $1 AND input = $2";
const SET_VERSION: &str = "UPDATE job_inputs SET version = $3 WHERE job = $1 AND input = $2";
const FINISH_INPUT: &str =
    "UPDATE job_inputs SET finished_at = {now}, records = $3 WHERE job = $1 AND input = $2";
/// A re-run of an input records its refusals afresh past where the last run got (all of them
/// when it starts over: the file may have been fixed since).
const FORGET_REFUSED: &str =
    "DELETE FROM job_refused_lines WHERE job = $1 AND input = $2 AND line > $3";
const REFUSED_COLUMNS: &str =
    "INSERT INTO job_refused_lines (job, input, line, error, raw, raw_bytes, raw_sha256, record_id) ";
/// `{now}`: as above. Two publishes of one input at once keep the later refusal of a line.
const REFUSED_TAIL: &str = " ON CONFLICT (job, input, line) DO UPDATE SET error = excluded.error, \
     raw = excluded.raw, raw_bytes = excluded.raw_bytes, raw_sha256 = excluded.raw_sha256, \
     record_id = excluded.record_id, refused_at = {now}";
const REFUSED_PG: &str = "SELECT job, input, line, error, raw, raw_bytes, raw_sha256, record_id, \
     (EXTRACT(EPOCH FROM refused_at) * 1000000)::BIGINT AS refused_at_us \
     FROM job_refused_lines WHERE job = $1 ORDER BY input, line";
const REFUSED_SQLITE: &str =
    "SELECT job, input, line, error, raw, raw_bytes, raw_sha256, record_id, \
     CAST(ROUND((julianday(refused_at) - 2440587.5) * 86400000000.0) AS INTEGER) AS refused_at_us \
     FROM job_refused_lines WHERE job = $1 ORDER BY input, line";

/// Reads a job's [`JobCounts`] inside the open transaction `$tx` (each count statement takes
/// the job as `$1` and, if it names `$2`, the model).
macro_rules! counts_in {
    ($tx:ident, $job:expr, $model:expr, $recent:expr) => {{
        let mut n = [0i64; 5];
        for (slot, sql) in n
            .iter_mut()
            .zip([PUBLISHING, PUBLISHED, DONE, FAILED, REFUSED])
        {
            let q = sqlx::query_scalar(sql).bind($job);
            *slot = if sql.contains("$2") {
                q.bind($model).fetch_one(&mut *$tx).await?
            } else {
                q.fetch_one(&mut *$tx).await?
            };
        }
        let (recent, recent_span_s): (i64, f64) = sqlx::query_as($recent)
            .bind($job)
            .bind($model)
            .fetch_one(&mut *$tx)
            .await?;
        JobCounts {
            publishing: n[0],
            published: n[1],
            done: n[2],
            failed: n[3],
            refused: n[4],
            recent,
            recent_span_s,
        }
    }};
}

impl Store {
    /// Registers `job` for `model`, or checks that an existing job targets the same model.
    pub async fn register_job(&self, job: &str, model: &str) -> Result<(), StoreError> {
        on_pool!(self, p => {
            sqlx::query(INSERT_JOB).bind(job).bind(model).execute(p).await?;
        });
        let has = self.job_model(job).await?;
        if has != model {
            return Err(StoreError::JobModel {
                job: job.to_string(),
                has,
                wants: model.to_string(),
            });
        }
        Ok(())
    }

    /// The model `job` targets; [`StoreError::UnknownJob`] when no publish registered it.
    pub async fn job_model(&self, job: &str) -> Result<String, StoreError> {
        let model: Option<String> =
            on_pool!(self, p => sqlx::query_scalar(JOB_MODEL).bind(job).fetch_optional(p).await?);
        model.ok_or_else(|| StoreError::UnknownJob(job.to_string()))
    }

    /// Marks a publish of `input` to `job` as running (until [`Store::finish_input`]) and
    /// returns the rows an earlier run of it got through ([`Store::advance_input`]), from which
    /// this run goes on (`resume`), and its records so far; or zeros when it starts over. The
    /// lines an earlier run refused past that point are forgotten: this run records its own.
    /// `version` identifies the input's content now (an object's generation, a file's size and
    /// modification time): an earlier run's point is resumed only on the same content, else
    /// [`StoreError::InputChanged`] (a run that starts over takes any content).
    pub async fn start_input(
        &self,
        job: &str,
        input: &str,
        version: &str,
        resume: bool,
    ) -> Result<(i64, i64), StoreError> {
        let sql = START_INPUT.replace("{now}", self.now_sql());
        let changed = |rows: i64, was: String| StoreError::InputChanged {
            job: job.into(),
            input: input.into(),
            rows,
            was,
            now: version.into(),
        };
        let done = on_pool!(self, p => {
            let mut tx = p.begin().await?;
            sqlx::query(&sql).bind(job).bind(input).execute(&mut *tx).await?;
            if !resume {
                sqlx::query(RESTART_INPUT).bind(job).bind(input).execute(&mut *tx).await?;
            }
            let (rows, records, was): (i64, i64, Option<String>) =
                sqlx::query_as(ROWS_DONE).bind(job).bind(input).fetch_one(&mut *tx).await?;
            if let Some(was) = was.filter(|was| rows > 0 && was != version) {
                return Err(changed(rows, was));
            }
            sqlx::query(SET_VERSION).bind(job).bind(input).bind(version).execute(&mut *tx).await?;
            sqlx::query(FORGET_REFUSED).bind(job).bind(input).bind(rows).execute(&mut *tx).await?;
            tx.commit().await?;
            (rows, records)
        });
        Ok(done)
    }

    /// Records that a publish of `input` to `job` got through its first `rows_done` rows, with
    /// `records` of its records published or already done so far.
    pub async fn advance_input(
        &self,
        job: &str,
        input: &str,
        rows_done: i64,
        records: i64,
    ) -> Result<(), StoreError> {
        let sql = "UPDATE job_inputs SET rows_done = $3, records = $4 \
                   WHERE job = $1 AND input = $2 AND rows_done < $3";
        on_pool!(self, p => {
            sqlx::query(sql).bind(job).bind(input).bind(rows_done).bind(records).execute(p).await?;
        });
        Ok(())
    }

    /// Records `lines` of `input` as refused by a publish to `job` (a line already recorded
    /// for this input is replaced, so a re-run does not count it twice).
    pub async fn refuse_lines(
        &self,
        job: &str,
        input: &str,
        lines: &[RefusedLine],
    ) -> Result<(), StoreError> {
        let tail = REFUSED_TAIL.replace("{now}", self.now_sql());
        let job = super::storable(job);
        let input = super::storable(input);
        for chunk in lines.chunks(REFUSED_PER_STATEMENT) {
            on_pool!(self, p => {
                let mut q = sqlx::QueryBuilder::new(REFUSED_COLUMNS);
                q.push_values(chunk, |mut b, r| {
                    b.push_bind(job.as_str())
                        .push_bind(input.as_str())
                        .push_bind(r.line)
                        .push_bind(super::storable(&r.error))
                        .push_bind(r.raw.as_slice())
                        .push_bind(r.raw_bytes)
                        .push_bind(r.raw_sha256.as_str())
                        .push_bind(r.record_id.as_deref());
                });
                q.push(tail.as_str());
                q.build().execute(p).await?;
            });
        }
        Ok(())
    }

    /// The lines publishes to `job` refused, by input and line number.
    pub fn job_refused_lines<'a>(
        &'a self,
        job: &'a str,
    ) -> BoxStream<'a, Result<ExportedRefusal, StoreError>> {
        let sql = self.pick(REFUSED_PG, REFUSED_SQLITE);
        on_pool!(self, p => sqlx::query(sql)
            .bind(job)
            .fetch(p)
            .map(|row| refusal_row(&row?))
            .boxed())
    }

    /// Marks a publish of `input` to `job` as finished, with the records it published.
    pub async fn finish_input(
        &self,
        job: &str,
        input: &str,
        records: i64,
    ) -> Result<(), StoreError> {
        let sql = FINISH_INPUT.replace("{now}", self.now_sql());
        on_pool!(self, p => {
            sqlx::query(&sql).bind(job).bind(input).bind(records).execute(p).await?;
        });
        Ok(())
    }

    /// Which of `ids` already have a result from `model`.
    pub async fn done_ids(&self, model: &str, ids: &[&str]) -> Result<HashSet<String>, StoreError> {
        let mut done = HashSet::new();
        for chunk in ids.chunks(IDS_PER_STATEMENT) {
            let found: Vec<String> = on_pool!(self, p => {
                let mut q = sqlx::QueryBuilder::new("SELECT record_id FROM embeddings WHERE model = ");
                q.push_bind(model).push(" AND record_id IN (");
                let mut list = q.separated(", ");
                for id in chunk {
                    list.push_bind(*id);
                }
                q.push(")");
                q.build_query_scalar().fetch_all(p).await?
            });
            done.extend(found);
        }
        Ok(done)
    }

    /// Where `job` stands; [`StoreError::UnknownJob`] when no publish registered it.
    pub async fn job_status(&self, job: &str) -> Result<JobStatus, StoreError> {
        let model = self.job_model(job).await?;
        // One snapshot for every count: a job is complete only if, at one moment, no publish
        // to it was unfinished and every record it had was settled.
        let counts = match self {
            Store::Postgres(p) => {
                let mut tx = p.begin().await?;
                sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                    .execute(&mut *tx)
                    .await?;
                let counts = counts_in!(tx, job, &model, RECENT_PG);
                tx.commit().await?;
                counts
            }
            Store::Sqlite(p) => {
                // In WAL mode a read transaction sees one snapshot from its first read on.
                let mut tx = p.begin().await?;
                let counts = counts_in!(tx, job, &model, RECENT_SQLITE);
                tx.commit().await?;
                counts
            }
        };
        Ok(JobStatus::from_counts(job, &model, counts))
    }
}

/// An [`ExportedRefusal`] from a row of [`REFUSED_PG`] or [`REFUSED_SQLITE`].
fn refusal_row<R: Row>(row: &R) -> Result<ExportedRefusal, StoreError>
where
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> &'r str: sqlx::ColumnIndex<R>,
{
    Ok(ExportedRefusal {
        job: row.try_get("job")?,
        input: row.try_get("input")?,
        refused: RefusedLine {
            line: row.try_get("line")?,
            error: row.try_get("error")?,
            raw: row.try_get("raw")?,
            raw_bytes: row.try_get("raw_bytes")?,
            raw_sha256: row.try_get("raw_sha256")?,
            record_id: row.try_get("record_id")?,
        },
        refused_at_us: row.try_get("refused_at_us")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(published: i64, done: i64, failed: i64) -> JobCounts {
        JobCounts {
            published,
            done,
            failed,
            ..JobCounts::default()
        }
    }

    #[test]
    fn complete_needs_every_record_settled_and_no_publish_running() {
        assert!(JobStatus::from_counts("j", "m", counts(10, 7, 3)).complete);
        assert!(!JobStatus::from_counts("j", "m", counts(10, 7, 2)).complete);
        assert!(!JobStatus::from_counts("j", "m", counts(0, 0, 0)).complete);
        let running = JobCounts {
            publishing: 1,
            ..counts(10, 10, 0)
        };
        assert!(!JobStatus::from_counts("j", "m", running).complete);
    }

    #[test]
    fn refused_lines_are_counted_but_do_not_hold_a_job_back() {
        let some = JobCounts {
            refused: 5,
            ..counts(10, 7, 3)
        };
        let s = JobStatus::from_counts("j", "m", some);
        assert_eq!((s.refused, s.complete), (5, true));
        let only_refused = JobCounts {
            refused: 2,
            ..counts(0, 0, 0)
        };
        assert!(JobStatus::from_counts("j", "m", only_refused).complete);
        let pending = JobCounts {
            refused: 2,
            ..counts(10, 7, 2)
        };
        assert!(!JobStatus::from_counts("j", "m", pending).complete);
    }

    #[test]
    fn a_refused_line_keeps_a_bounded_prefix_its_size_and_hash_and_no_nul_in_text() {
        let data = vec![b'x'; REFUSED_RAW_BYTES + 10];
        let r = RefusedLine::new(7, "bad \0 id", &data);
        assert_eq!(r.line, 7);
        assert_eq!(r.raw.len(), REFUSED_RAW_BYTES);
        assert_eq!(r.raw_bytes, (REFUSED_RAW_BYTES + 10) as i64);
        assert_eq!(r.raw_sha256, hex::encode(Sha256::digest(&data)));
        assert_eq!(r.error, "bad \\u0000 id");
        let short = RefusedLine::new(1, "e", b"a\0\xff");
        assert_eq!(short.raw, b"a\0\xff", "the bytes are kept as read");
    }

    #[test]
    fn the_eta_is_remaining_over_the_last_minutes_rate() {
        let c = JobCounts {
            recent: 600,
            recent_span_s: 30.0,
            ..counts(1000, 400, 0)
        };
        let s = JobStatus::from_counts("j", "m", c);
        assert_eq!(s.remaining, 600);
        assert_eq!(s.records_per_s, 20.0);
        assert_eq!(s.eta_seconds, Some(30.0));
        let stalled = JobStatus::from_counts("j", "m", counts(1000, 400, 0));
        assert_eq!(stalled.eta_seconds, None);
        assert_eq!(stalled.records_per_s, 0.0);
    }
}
