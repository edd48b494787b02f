//! What a publish writes of a job before its messages go out: each record's id, where it was
//! read and the columns kept with it; which shards of an input are finished (a re-run skips
//! them); and the kept columns' names and types, the same for every input of the job.

use super::jobs::IDS_PER_STATEMENT;
use super::{Store, StoreError};
use std::collections::{HashMap, HashSet};

/// An input (a shard) a publish to a job finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedInput {
    /// The rows the publish got through.
    pub rows: i64,
    /// What identified its content then (`None`: finished before versions were kept).
    pub version: Option<String>,
}

/// One record a publish registers.
#[derive(Debug, Clone, Copy)]
pub struct Registration<'a> {
    /// Its id.
    pub id: &'a str,
    /// Where in its input it was read (a hash of its shard and row): a second row of the same
    /// input holding the id is a repeat.
    pub origin: i64,
    /// Its kept columns, a JSON object.
    pub columns: Option<&'a str>,
}

impl Store {
    /// Adds `records`, read from the input `source` (a hash of its name), to `job`; returns the
    /// positions in `records` of repeats: ids that another row of the same input registered
    /// first (that one stays, with its columns). An id registered by another input is not a
    /// repeat: it is the same record published again, counted once.
    pub async fn register_records(
        &self,
        job: &str,
        source: i64,
        records: &[Registration<'_>],
    ) -> Result<Vec<usize>, StoreError> {
        let mut repeats = Vec::new();
        for (n, chunk) in records.chunks(IDS_PER_STATEMENT).enumerate() {
            let base = n * IDS_PER_STATEMENT;
            // Two rows of this chunk with one id: the later is a repeat (and one statement may
            // not upsert a row twice).
            let mut seen = HashSet::new();
            let mut first = Vec::with_capacity(chunk.len());
            for (i, r) in chunk.iter().enumerate() {
                match seen.insert(r.id) {
                    true => first.push((base + i, r)),
                    false => repeats.push(base + i),
                }
            }
            let stored = self.upsert_records(job, source, &first).await?;
            for (at, r) in first {
                if let Some((Some(s), Some(o))) = stored.get(r.id) {
                    if *s == source && *o != r.origin {
                        repeats.push(at);
                    }
                }
            }
        }
        repeats.sort_unstable();
        Ok(repeats)
    }

    /// Inserts `records`, leaving those already registered as they are, and returns what the
    /// job holds for each: its source and origin. One statement: the row a conflict finds comes
    /// back through RETURNING (the no-op update makes it), where a second SELECT would be
    /// planned on statistics that a bulk publish has made stale (a sequential scan, a second per
    /// chunk at a million records, measured on PostgreSQL 15).
    async fn upsert_records(
        &self,
        job: &str,
        source: i64,
        records: &[(usize, &Registration<'_>)],
    ) -> Result<HashMap<String, (Option<i64>, Option<i64>)>, StoreError> {
        if records.is_empty() {
            return Ok(HashMap::new());
        }
        let rows: Vec<(String, Option<i64>, Option<i64>)> = on_pool!(self, p => {
            let mut q = sqlx::QueryBuilder::new(
                "INSERT INTO job_records (job, record_id, source, origin, columns) ",
            );
            q.push_values(records, |mut b, (_, r)| {
                b.push_bind(job)
                    .push_bind(r.id)
                    .push_bind(source)
                    .push_bind(r.origin)
                    .push_bind(r.columns);
            });
            q.push(
                " ON CONFLICT (job, record_id) DO UPDATE SET origin = job_records.origin \
                 RETURNING record_id, source, origin",
            );
            q.build_query_as().fetch_all(p).await?
        });
        Ok(rows.into_iter().map(|(id, s, o)| (id, (s, o))).collect())
    }

    /// The inputs (shards) of `job` whose publish finished, by name.
    pub async fn finished_inputs(
        &self,
        job: &str,
    ) -> Result<HashMap<String, FinishedInput>, StoreError> {
        let sql = "SELECT input, rows_done, version FROM job_inputs \
                   WHERE job = $1 AND finished_at IS NOT NULL";
        let rows: Vec<(String, i64, Option<String>)> =
            on_pool!(self, p => sqlx::query_as(sql).bind(job).fetch_all(p).await?);
        Ok(rows
            .into_iter()
            .map(|(input, rows, version)| (input, FinishedInput { rows, version }))
            .collect())
    }

    /// The kept columns of `job` (a JSON array of names and export types), set by its first
    /// publish that kept any.
    pub async fn job_columns(&self, job: &str) -> Result<Option<String>, StoreError> {
        let sql = "SELECT columns FROM jobs WHERE job = $1";
        let columns: Option<Option<String>> =
            on_pool!(self, p => sqlx::query_scalar(sql).bind(job).fetch_optional(p).await?);
        Ok(columns.flatten())
    }

    /// Sets the kept columns of `job` unless they are set already; returns what the job holds.
    pub async fn set_job_columns(&self, job: &str, columns: &str) -> Result<String, StoreError> {
        let sql = "UPDATE jobs SET columns = $2 WHERE job = $1 AND columns IS NULL";
        on_pool!(self, p => {
            sqlx::query(sql).bind(job).bind(columns).execute(p).await?;
        });
        Ok(self.job_columns(job).await?.unwrap_or_default())
    }
}
