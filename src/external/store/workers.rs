//! Job-mode heartbeats: each worker with `--exit-when-job-complete` writes, at every poll of its
//! job, a row saying it is alive and how many of the job's messages it holds. A batch that runs
//! long (an LLM's answers) commits nothing for minutes; without these rows an idle peer could
//! not tell that job from one nobody works on, and would exit 66 and fail the Job under it.

use super::{Store, StoreError};
use std::time::Duration;

/// `{now}`: the database's current time.
const BEAT: &str = "INSERT INTO job_workers (job, worker, holding, beat_at) VALUES ($1, $2, $3, {now}) \
     ON CONFLICT (job, worker) DO UPDATE SET holding = excluded.holding, beat_at = excluded.beat_at";
const WORKING_PG: &str = "SELECT COUNT(*) FROM job_workers WHERE job = $1 AND worker <> $2 \
     AND holding > 0 AND beat_at > now() - make_interval(secs => $3)";
const WORKING_SQLITE: &str = "SELECT COUNT(*) FROM job_workers WHERE job = $1 AND worker <> $2 \
     AND holding > 0 AND beat_at > strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || $3 || ' seconds')";
const GONE: &str = "DELETE FROM job_workers WHERE job = $1 AND worker = $2";

impl Store {
    /// Records that `worker` is alive and holds `holding` of `job`'s messages.
    pub async fn beat(&self, job: &str, worker: &str, holding: i64) -> Result<(), StoreError> {
        let sql = BEAT.replace("{now}", self.now_sql());
        on_pool!(self, p => {
            sqlx::query(&sql).bind(job).bind(worker).bind(holding).execute(p).await?;
        });
        Ok(())
    }

    /// How many workers other than `worker` said within `within` that they hold some of `job`'s
    /// messages.
    pub async fn working_peers(
        &self,
        job: &str,
        worker: &str,
        within: Duration,
    ) -> Result<i64, StoreError> {
        let sql = self.pick(WORKING_PG, WORKING_SQLITE);
        let secs = within.as_secs_f64();
        Ok(on_pool!(self, p => sqlx::query_scalar(sql)
            .bind(job)
            .bind(worker)
            .bind(secs)
            .fetch_one(p)
            .await?))
    }

    /// Removes `worker`'s heartbeat for `job` (it is exiting).
    pub async fn leave(&self, job: &str, worker: &str) -> Result<(), StoreError> {
        on_pool!(self, p => {
            sqlx::query(GONE).bind(job).bind(worker).execute(p).await?;
        });
        Ok(())
    }
}
