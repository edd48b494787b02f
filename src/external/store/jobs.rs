//! Jobs: the records a publish registered, and how far the workers are with them.
//!
//! `spotinfer publish --job J` writes every record id it publishes into `job_records` *before*
//! the message goes out, so the expected total is a count of distinct ids: a publish that crashed
//! and is run again cannot double it, and a record published twice counts once. Done, failed and
//! remaining are then joins against the result and failure tables, for the job's model.

use super::{Store, StoreError};
use std::collections::HashSet;

/// Most ids one registration or lookup statement carries (well under both databases' limits).
const IDS_PER_STATEMENT: usize = 1000;

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
    /// A publish to this job is running, or was interrupted and must be re-run.
    pub publishing: bool,
    /// Every published record has a result or a failure row, and no publish is unfinished.
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
    /// Results committed in the last minute.
    pub recent: i64,
    /// Seconds from the oldest of those to now (at most 60).
    pub recent_span_s: f64,
}

impl JobStatus {
    /// The status of `job` from its counts.
    pub fn from_counts(job: &str, model: &str, c: JobCounts) -> Self {
        let remaining = (c.published - c.done - c.failed).max(0);
        let complete = c.published > 0 && remaining == 0 && c.publishing == 0;
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
const PUBLISHED: &str = "SELECT COUNT(*) FROM job_records WHERE job = $1";
const DONE: &str = "SELECT COUNT(*) FROM job_records r JOIN embeddings e \
     ON e.record_id = r.record_id AND e.model = $2 WHERE r.job = $1";
const FAILED: &str = "SELECT COUNT(*) FROM job_records r WHERE r.job = $1 \
     AND NOT EXISTS (SELECT 1 FROM embeddings e WHERE e.record_id = r.record_id AND e.model = $2) \
     AND EXISTS (SELECT 1 FROM failed_records f WHERE f.record_id = r.record_id AND f.job = $1)";
const PUBLISHING: &str = "SELECT COUNT(*) FROM job_inputs WHERE job = $1 AND finished_at IS NULL";
const RECENT_PG: &str = "SELECT COUNT(*), \
     COALESCE(EXTRACT(EPOCH FROM now() - MIN(e.processed_at))::float8, 0) \
     FROM job_records r JOIN embeddings e ON e.record_id = r.record_id AND e.model = $2 \
     WHERE r.job = $1 AND e.processed_at > now() - interval '60 seconds'";
const RECENT_SQLITE: &str = "SELECT COUNT(*), \
     COALESCE((julianday('now') - julianday(MIN(e.processed_at))) * 86400.0, 0.0) \
     FROM job_records r JOIN embeddings e ON e.record_id = r.record_id AND e.model = $2 \
     WHERE r.job = $1 AND e.processed_at > strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-60 seconds')";
/// `{now}`: the dialect's current time ([`Store::now_sql`]).
const START_INPUT: &str = "INSERT INTO job_inputs (job, input) VALUES ($1, $2) \
     ON CONFLICT (job, input) DO UPDATE SET started_at = {now}, finished_at = NULL, records = 0";
const FINISH_INPUT: &str =
    "UPDATE job_inputs SET finished_at = {now}, records = $3 WHERE job = $1 AND input = $2";

/// Reads a job's [`JobCounts`] inside the open transaction `$tx` (each count statement takes
/// the job as `$1` and, if it names `$2`, the model).
macro_rules! counts_in {
    ($tx:ident, $job:expr, $model:expr, $recent:expr) => {{
        let mut n = [0i64; 4];
        for (slot, sql) in n.iter_mut().zip([PUBLISHING, PUBLISHED, DONE, FAILED]) {
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

    /// Marks a publish of `input` to `job` as running (until [`Store::finish_input`]).
    pub async fn start_input(&self, job: &str, input: &str) -> Result<(), StoreError> {
        let sql = START_INPUT.replace("{now}", self.now_sql());
        on_pool!(self, p => {
            sqlx::query(&sql).bind(job).bind(input).execute(p).await?;
        });
        Ok(())
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

    /// Adds `ids` to `job` (ids already there are left as they are).
    pub async fn register_records(&self, job: &str, ids: &[&str]) -> Result<(), StoreError> {
        for chunk in ids.chunks(IDS_PER_STATEMENT) {
            on_pool!(self, p => {
                let mut q = sqlx::QueryBuilder::new("INSERT INTO job_records (job, record_id) ");
                q.push_values(chunk, |mut b, id| {
                    b.push_bind(job).push_bind(*id);
                });
                q.push(" ON CONFLICT (job, record_id) DO NOTHING");
                q.build().execute(p).await?;
            });
        }
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
