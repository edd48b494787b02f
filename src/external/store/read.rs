//! Reads of the tables as a whole: the done and failed counts `status` prints, and every stored
//! embedding and failure row, for verification and tests. (A job's rows, streamed for `export`,
//! are in `rows`.)

use super::{le_bytes_to_f32s, Store, StoreError};
use sqlx::Row;
use std::collections::HashMap;

/// A stored embedding, as read back.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredEmbedding {
    /// The vector.
    pub embedding: Vec<f32>,
    /// The message whose result it is.
    pub message_id: String,
    /// That message's publish time.
    pub publish_time_us: i64,
    /// Hex SHA-256 of the input text.
    pub input_sha256: String,
    /// A task model's best label (none for an embedding).
    pub label: Option<String>,
    /// A task model's score (none for an embedding).
    pub score: Option<f64>,
}

/// Done and failed counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StatusCounts {
    /// Records with a stored embedding.
    pub done: i64,
    /// Messages recorded as failed.
    pub failed: i64,
}

impl Store {
    /// Done and failed counts, for one job or all.
    pub async fn status(&self, job: Option<&str>) -> Result<StatusCounts, StoreError> {
        let (done, failed): (i64, i64) = match self {
            Self::Postgres(p) => {
                let d = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM embeddings WHERE $1::text IS NULL OR job = $1",
                )
                .bind(job)
                .fetch_one(p)
                .await?;
                let f = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM failed_records WHERE $1::text IS NULL OR job = $1",
                )
                .bind(job)
                .fetch_one(p)
                .await?;
                (d, f)
            }
            Self::Sqlite(p) => {
                let d = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM embeddings WHERE ?1 IS NULL OR job = ?1",
                )
                .bind(job)
                .fetch_one(p)
                .await?;
                let f = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM failed_records WHERE ?1 IS NULL OR job = ?1",
                )
                .bind(job)
                .fetch_one(p)
                .await?;
                (d, f)
            }
        };
        Ok(StatusCounts { done, failed })
    }

    /// Reads every stored embedding, keyed by record id (for verification and tests).
    pub async fn embeddings(&self) -> Result<HashMap<String, StoredEmbedding>, StoreError> {
        const Q: &str = "SELECT record_id, embedding, message_id, publish_time_us, input_sha256, \
             label, score FROM embeddings";
        // `::real[]` reads a pgvector column as well as an array one; a task row has none.
        const Q_PG: &str = "SELECT record_id, embedding::real[] AS embedding, message_id, \
             publish_time_us, input_sha256, label, score FROM embeddings";
        let mut out = HashMap::new();
        match self {
            Self::Postgres(p) => {
                for row in sqlx::query(Q_PG).fetch_all(p).await? {
                    out.insert(
                        row.try_get("record_id")?,
                        StoredEmbedding {
                            embedding: row
                                .try_get::<Option<Vec<f32>>, _>("embedding")?
                                .unwrap_or_default(),
                            message_id: row.try_get("message_id")?,
                            publish_time_us: row.try_get("publish_time_us")?,
                            input_sha256: row.try_get("input_sha256")?,
                            label: row.try_get("label")?,
                            score: row.try_get("score")?,
                        },
                    );
                }
            }
            Self::Sqlite(p) => {
                for row in sqlx::query(Q).fetch_all(p).await? {
                    let blob: Vec<u8> = row.try_get("embedding")?;
                    out.insert(
                        row.try_get("record_id")?,
                        StoredEmbedding {
                            embedding: le_bytes_to_f32s(&blob),
                            message_id: row.try_get("message_id")?,
                            publish_time_us: row.try_get("publish_time_us")?,
                            input_sha256: row.try_get("input_sha256")?,
                            label: row.try_get("label")?,
                            score: row.try_get("score")?,
                        },
                    );
                }
            }
        }
        Ok(out)
    }

    /// Reads every failure row as (message_id, record_id, error).
    pub async fn failures(&self) -> Result<Vec<(String, Option<String>, String)>, StoreError> {
        const Q: &str =
            "SELECT message_id, record_id, error FROM failed_records ORDER BY message_id";
        let rows = match self {
            Self::Postgres(p) => sqlx::query_as(Q).fetch_all(p).await?,
            Self::Sqlite(p) => sqlx::query_as(Q).fetch_all(p).await?,
        };
        Ok(rows)
    }
}
