//! A job's rows read back as a stream, for `spotinfer export`: one row at a time from the
//! database cursor, so memory does not grow with the job.

use super::{le_bytes_to_f32s, FailureRow, Prediction, Store, StoreError};
use futures::stream::{BoxStream, StreamExt};
use sqlx::Row;

/// One result of a job, as exported.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportedResult {
    /// The record id.
    pub id: String,
    /// The vector (empty for a task that computes none).
    pub embedding: Vec<f32>,
    /// The task's columns (label, scores, entities).
    pub prediction: Prediction,
    /// The model's name.
    pub model: String,
    /// Which weights made the vector.
    pub model_hash: String,
    /// The job exported.
    pub job: String,
    /// Hex SHA-256 of the input text.
    pub input_sha256: String,
    /// The Pub/Sub message that carried it.
    pub message_id: String,
    /// That message's publish time, microseconds since the epoch.
    pub publish_time_us: i64,
    /// When the row was committed, microseconds since the epoch.
    pub processed_at_us: i64,
    /// The columns its publish kept with it (`--keep-columns`), a JSON object.
    pub columns: Option<String>,
}

/// One failure row of a job whose record has no result, with when it was recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportedFailure {
    /// The row as the worker wrote it.
    pub failure: FailureRow,
    /// When it was recorded, microseconds since the epoch.
    pub failed_at_us: i64,
}

pub(super) const RESULTS_PG: &str =
    "SELECT e.record_id, e.embedding::real[] AS embedding, e.model, \
     e.model_hash, r.job, e.input_sha256, e.message_id, e.publish_time_us, \
     e.task, e.label, e.score, e.scores::text AS scores, e.entities::text AS entities, \
     e.text, e.finish_reason, e.prompt_tokens::BIGINT AS prompt_tokens, \
     e.completion_tokens::BIGINT AS completion_tokens, e.exact, e.json::text AS json, r.columns, \
     (EXTRACT(EPOCH FROM e.processed_at) * 1000000)::BIGINT AS processed_at_us \
     FROM job_records r JOIN embeddings e ON e.record_id = r.record_id AND e.model = $2 \
     WHERE r.job = $1 ORDER BY r.record_id";
const RESULTS_SQLITE: &str = "SELECT e.record_id, e.embedding, e.model, e.model_hash, r.job, \
     e.input_sha256, e.message_id, e.publish_time_us, e.task, e.label, e.score, e.scores, \
     e.entities, e.text, e.finish_reason, e.prompt_tokens, e.completion_tokens, e.exact, e.json, r.columns, \
     CAST(ROUND((julianday(e.processed_at) - 2440587.5) * 86400000000.0) AS INTEGER) AS processed_at_us \
     FROM job_records r JOIN embeddings e ON e.record_id = r.record_id AND e.model = $2 \
     WHERE r.job = $1 ORDER BY r.record_id";
pub(super) const FAILURES_PG: &str = "SELECT f.message_id, f.record_id, f.job, f.error, f.payload, \
     f.payload_bytes, f.payload_sha256, f.publish_time_us, (EXTRACT(EPOCH FROM f.failed_at) * 1000000)::BIGINT AS failed_at_us \
     FROM failed_records f WHERE f.job = $1 AND NOT EXISTS \
     (SELECT 1 FROM embeddings e WHERE e.record_id = f.record_id AND e.model = $2) \
     ORDER BY f.message_id";
const FAILURES_SQLITE: &str = "SELECT f.message_id, f.record_id, f.job, f.error, f.payload, \
     f.payload_bytes, f.payload_sha256, f.publish_time_us, \
     CAST(ROUND((julianday(f.failed_at) - 2440587.5) * 86400000000.0) AS INTEGER) AS failed_at_us \
     FROM failed_records f WHERE f.job = $1 AND NOT EXISTS \
     (SELECT 1 FROM embeddings e WHERE e.record_id = f.record_id AND e.model = $2) \
     ORDER BY f.message_id";

/// PostgreSQL tables whose statistics the export's join plan depends on.
const JOINED_TABLES: [&str; 3] = ["embeddings", "job_records", "failed_records"];

impl Store {
    /// Refreshes PostgreSQL's planner statistics of the tables an export joins when they are
    /// stale (more than a fifth of their rows changed since the last ANALYZE). Right after a bulk
    /// load, before autovacuum has looked, the planner can take a large table for an empty one
    /// and pick a nested loop of sequential scans: minutes instead of seconds. A failure here
    /// (say, a role that does not own the tables) only costs that risk, so it is logged.
    pub async fn refresh_stale_statistics(&self) {
        let Store::Postgres(p) = self else { return };
        for table in JOINED_TABLES {
            let stale: Result<bool, sqlx::Error> = sqlx::query_scalar(
                "SELECT n_mod_since_analyze > 0.2 * (n_live_tup + 1000) \
                 FROM pg_stat_user_tables WHERE relname = $1",
            )
            .bind(table)
            .fetch_optional(p)
            .await
            .map(|s| s.unwrap_or(false));
            let result = match stale {
                Ok(true) => sqlx::query(&format!("ANALYZE {table}"))
                    .execute(p)
                    .await
                    .map(|_| ()),
                other => other.map(|_| ()),
            };
            if let Err(e) = result {
                tracing::warn!(table, error = %e, "cannot refresh the planner's statistics");
            }
        }
    }

    /// The results of `job` from `model`, in record-id order.
    pub fn job_results<'a>(
        &'a self,
        job: &'a str,
        model: &'a str,
    ) -> BoxStream<'a, Result<ExportedResult, StoreError>> {
        match self {
            Store::Postgres(p) => sqlx::query(RESULTS_PG)
                .bind(job)
                .bind(model)
                .fetch(p)
                .map(|row| {
                    let row = row?;
                    let embedding: Option<Vec<f32>> = row.try_get("embedding")?;
                    result_row(&row, embedding.unwrap_or_default())
                })
                .boxed(),
            Store::Sqlite(p) => sqlx::query(RESULTS_SQLITE)
                .bind(job)
                .bind(model)
                .fetch(p)
                .map(|row| {
                    let row = row?;
                    let blob: Vec<u8> = row.try_get("embedding")?;
                    result_row(&row, le_bytes_to_f32s(&blob))
                })
                .boxed(),
        }
    }

    /// The task of `job`'s results from `model` (`embed` when it has none yet).
    pub async fn job_task(&self, job: &str, model: &str) -> Result<String, StoreError> {
        let sql = "SELECT task FROM embeddings WHERE job = $1 AND model = $2 LIMIT 1";
        let task: Option<String> = on_pool!(self, p => sqlx::query_scalar(sql)
            .bind(job)
            .bind(model)
            .fetch_optional(p)
            .await?);
        Ok(task.unwrap_or_else(|| "embed".into()))
    }

    /// The failure rows of `job` whose record has no result from `model`, by message id.
    pub fn job_failures<'a>(
        &'a self,
        job: &'a str,
        model: &'a str,
    ) -> BoxStream<'a, Result<ExportedFailure, StoreError>> {
        let sql = self.pick(FAILURES_PG, FAILURES_SQLITE);
        on_pool!(self, p => sqlx::query(sql)
            .bind(job)
            .bind(model)
            .fetch(p)
            .map(|row| failure_row(&row?))
            .boxed())
    }
}

/// The columns both databases return alike.
fn result_row<R: Row>(row: &R, embedding: Vec<f32>) -> Result<ExportedResult, StoreError>
where
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<f64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> &'r str: sqlx::ColumnIndex<R>,
{
    let id: String = row.try_get("record_id")?;
    let mut prediction = Prediction {
        task: row.try_get("task")?,
        label: row.try_get("label")?,
        score: row.try_get("score")?,
        scores: row.try_get("scores")?,
        entities: row.try_get("entities")?,
        text: row.try_get("text")?,
        finish_reason: row.try_get("finish_reason")?,
        prompt_tokens: row.try_get("prompt_tokens")?,
        completion_tokens: row.try_get("completion_tokens")?,
        json: row.try_get("json")?,
        exact: row.try_get("exact")?,
    };
    prediction
        .restore_exact()
        .map_err(|e| StoreError::Unreadable(format!("record {id}: its exact values: {e}")))?;
    Ok(ExportedResult {
        id,
        embedding,
        prediction,
        model: row.try_get("model")?,
        model_hash: row.try_get("model_hash")?,
        job: row.try_get("job")?,
        input_sha256: row.try_get("input_sha256")?,
        message_id: row.try_get("message_id")?,
        publish_time_us: row.try_get("publish_time_us")?,
        processed_at_us: row.try_get("processed_at_us")?,
        columns: row.try_get("columns")?,
    })
}

fn failure_row<R: Row>(row: &R) -> Result<ExportedFailure, StoreError>
where
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> &'r str: sqlx::ColumnIndex<R>,
{
    Ok(ExportedFailure {
        failure: FailureRow {
            message_id: row.try_get("message_id")?,
            record_id: row.try_get("record_id")?,
            job: row.try_get("job")?,
            error: row.try_get("error")?,
            payload: row.try_get("payload")?,
            payload_bytes: row.try_get("payload_bytes")?,
            payload_sha256: row.try_get("payload_sha256")?,
            publish_time_us: row.try_get("publish_time_us")?,
        },
        failed_at_us: row.try_get("failed_at_us")?,
    })
}
