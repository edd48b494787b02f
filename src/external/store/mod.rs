//! The result store: PostgreSQL in production, SQLite as the embedded default.
//!
//! Every write is one transaction holding a batch's results and its failure rows, so the sink can
//! ack exactly the messages whose outcome is durable. Results are UPSERTed by (record id, model)
//! with a guard on the publish time: a redelivered or republished record leaves exactly one row
//! per model, a second model's vectors sit beside the first's, and a redelivery of an older
//! publish never overwrites the result of a newer one.

/// Runs the same statement code on whichever pool the store holds (`$N` placeholders work on
/// both: sqlx binds SQLite's `$N` by number).
macro_rules! on_pool {
    ($store:expr, $pool:ident => $body:expr) => {
        match $store {
            Store::Postgres($pool) => $body,
            Store::Sqlite($pool) => $body,
        }
    };
}

mod jobs;
mod rows;
mod vector;

pub use jobs::{ExportedRefusal, JobCounts, JobStatus, RefusedLine, REFUSED_RAW_BYTES};
pub use rows::{ExportedFailure, ExportedResult};
pub use vector::VectorColumn;

use sqlx::postgres::Postgres;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::query_builder::Separated;
use sqlx::sqlite::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::{Database, Encode, QueryBuilder, Row, Type};
use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

/// Errors from the store. Any of them during a commit means "nothing was written".
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The URL names no supported database.
    #[error("DATABASE_URL must start with postgres:// or sqlite:, got {0}")]
    UnsupportedUrl(String),
    /// The database cannot be reached.
    #[error("cannot reach the database at {url}: {source}")]
    Connect {
        /// The URL, password removed.
        url: String,
        /// Why.
        #[source]
        source: sqlx::Error,
    },
    /// A migration failed.
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A statement failed.
    #[error("database error: {0}")]
    Sql(#[from] sqlx::Error),
    /// No publish registered this job.
    #[error("no job {0:?} in this database (a job is registered by `spotinfer publish --job`)")]
    UnknownJob(String),
    /// A publish to a job names another model than the one the job was registered for.
    #[error("job {job:?} is for model {has:?}, not {wants:?} (a job has one model; use a new job name for another)")]
    JobModel {
        /// The job.
        job: String,
        /// The model it was registered for.
        has: String,
        /// The model this publish names.
        wants: String,
    },
    /// pgvector was asked for where it cannot be had.
    #[error("pgvector: {0}")]
    NoPgvector(String),
}

impl StoreError {
    /// Whether the database refused the data itself rather than failed to take it: PostgreSQL's
    /// SQLSTATE classes 22 (data exception: a NUL in text, a value out of range) and 23 (integrity
    /// constraint: a CHECK, a NOT NULL, a trigger's refusal), and SQLite's constraint, mismatch
    /// and too-big codes. Retrying the same rows cannot help; committing them without the
    /// culprit can.
    pub fn is_data_error(&self) -> bool {
        let Self::Sql(sqlx::Error::Database(db)) = self else {
            return false;
        };
        let Some(code) = db.code() else { return false };
        if db
            .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
            .is_some()
        {
            return code.starts_with("22") || code.starts_with("23");
        }
        // SQLite reports the extended result code; the primary code is its low byte.
        const SQLITE_TOOBIG: i64 = 18;
        const SQLITE_CONSTRAINT: i64 = 19;
        const SQLITE_MISMATCH: i64 = 20;
        code.parse::<i64>().is_ok_and(|c| {
            matches!(
                c & 0xff,
                SQLITE_TOOBIG | SQLITE_CONSTRAINT | SQLITE_MISMATCH
            )
        })
    }
}

/// `text` with what a text column cannot hold (U+0000: PostgreSQL refuses it) written as the six
/// characters `\u0000` (JSON's spelling): a failure row or a refused line must be storable
/// whatever the payload held.
pub fn storable(text: &str) -> String {
    text.replace('\0', "\\u0000")
}

/// One embedding to store.
#[derive(Debug, Clone, PartialEq)]
pub struct ResultRow {
    /// The record's id (primary key).
    pub record_id: String,
    /// The unit-length vector.
    pub embedding: Vec<f32>,
    /// Model name (with the record id, the primary key).
    pub model: String,
    /// Which weights made the vector (see `ModelInfo::hash`).
    pub model_hash: String,
    /// The record's job, if any.
    pub job: Option<String>,
    /// Hex SHA-256 of the input text.
    pub input_sha256: String,
    /// The Pub/Sub message that carried it.
    pub message_id: String,
    /// Publish time of that message, microseconds since the epoch.
    pub publish_time_us: i64,
}

/// One payload that can never succeed.
#[derive(Debug, Clone, PartialEq)]
pub struct FailureRow {
    /// The Pub/Sub message (primary key).
    pub message_id: String,
    /// The record id, when the payload had one.
    pub record_id: Option<String>,
    /// The job, when the payload had one.
    pub job: Option<String>,
    /// Why it failed.
    pub error: String,
    /// The raw message data, its first `MAX_FAILURE_PAYLOAD` bytes (see the pipeline's sink).
    pub payload: Vec<u8>,
    /// The whole payload's size in bytes.
    pub payload_bytes: i64,
    /// Hex SHA-256 of the whole payload.
    pub payload_sha256: String,
    /// Publish time, microseconds since the epoch.
    pub publish_time_us: i64,
}

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
}

/// Done and failed counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StatusCounts {
    /// Records with a stored embedding.
    pub done: i64,
    /// Messages recorded as failed.
    pub failed: i64,
}

/// A connection pool to one of the supported databases.
#[derive(Debug, Clone)]
pub enum Store {
    /// PostgreSQL.
    Postgres(PgPool),
    /// SQLite.
    Sqlite(SqlitePool),
}

const UPSERT_COLUMNS: &str = "INSERT INTO embeddings (record_id, embedding, model, model_hash, dim, job, input_sha256, message_id, publish_time_us) ";

fn upsert_tail(now: &str) -> String {
    format!(
        " ON CONFLICT (record_id, model) DO UPDATE SET embedding = excluded.embedding, model_hash = excluded.model_hash, \
         dim = excluded.dim, job = excluded.job, input_sha256 = excluded.input_sha256, \
         message_id = excluded.message_id, publish_time_us = excluded.publish_time_us, processed_at = {now} \
         WHERE embeddings.publish_time_us <= excluded.publish_time_us"
    )
}

const FAILURE_COLUMNS: &str =
    "INSERT INTO failed_records (message_id, record_id, job, error, payload, payload_bytes, \
     payload_sha256, publish_time_us) ";
const FAILURE_TAIL: &str = " ON CONFLICT (message_id) DO NOTHING";

/// Bind parameters per row of the result UPSERT and of the failure INSERT.
const RESULT_COLUMNS: usize = 9;
const FAILURE_COLUMNS_N: usize = 8;
/// Bind parameters one statement may carry: PostgreSQL's protocol limit, and SQLite's
/// `SQLITE_MAX_VARIABLE_NUMBER` as sqlx's bundled SQLite is built (32,766). A batch with more
/// rows is written as several statements in the same transaction.
const PG_MAX_BINDS: usize = 65_535;
/// Rows in one PostgreSQL result UPSERT (its columns are arrays, so any number fits; this bounds
/// one statement's size and keeps the flat vector array's offsets in an int).
const PG_ROWS_PER_UPSERT: usize = 10_000;
const SQLITE_MAX_BINDS: usize = 32_766;

/// Rows that fit one statement.
fn rows_per_statement(max_binds: usize, columns: usize) -> usize {
    (max_binds / columns).max(1)
}

impl Store {
    /// Connects (and for SQLite creates the file), failing fast with a clear error when the
    /// database is unreachable.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::open(url, true).await
    }

    /// [`Store::connect`] without sqlx's slow-statement warnings: for commands that stream a
    /// whole job (`export`), whose one long statement is expected, not a symptom.
    pub async fn connect_for_streaming(url: &str) -> Result<Self, StoreError> {
        Self::open(url, false).await
    }

    async fn open(url: &str, warn_slow: bool) -> Result<Self, StoreError> {
        use sqlx::ConnectOptions;
        let connect_err = |source| StoreError::Connect {
            url: redact_url(url),
            source,
        };
        let slow = if warn_slow {
            log::LevelFilter::Warn
        } else {
            log::LevelFilter::Off
        };
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let opts = PgConnectOptions::from_str(url)
                .map_err(connect_err)?
                .log_slow_statements(slow, Duration::from_secs(1));
            let pool = PgPoolOptions::new()
                .max_connections(4)
                .acquire_timeout(Duration::from_secs(5))
                .connect_with(opts)
                .await
                .map_err(connect_err)?;
            Ok(Self::Postgres(pool))
        } else if url.starts_with("sqlite:") {
            let opts = SqliteConnectOptions::from_str(url)
                .map_err(connect_err)?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(30))
                .log_slow_statements(slow, Duration::from_secs(1));
            let pool = SqlitePoolOptions::new()
                .max_connections(4)
                .connect_with(opts)
                .await
                .map_err(connect_err)?;
            Ok(Self::Sqlite(pool))
        } else {
            Err(StoreError::UnsupportedUrl(redact_url(url)))
        }
    }

    /// SQL for the current time, in the format this database's timestamp columns hold.
    fn now_sql(&self) -> &'static str {
        match self {
            Self::Postgres(_) => <Postgres as Dialect>::NOW,
            Self::Sqlite(_) => <Sqlite as Dialect>::NOW,
        }
    }

    /// The statement written for this database out of a PostgreSQL and a SQLite spelling.
    fn pick<'s>(&self, postgres: &'s str, sqlite: &'s str) -> &'s str {
        match self {
            Self::Postgres(_) => postgres,
            Self::Sqlite(_) => sqlite,
        }
    }

    /// Runs the migrations under `migrations/postgres` or `migrations/sqlite`.
    ///
    /// PostgreSQL serialises concurrent runs with an advisory lock. sqlx takes no lock on
    /// SQLite, so two processes opening a new file at once (a publish and a status, two
    /// workers) can both try to record the same version, and one fails on its primary key; its
    /// migration rolled back, and a second run finds the version applied.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        match self {
            Self::Postgres(p) => sqlx::migrate!("./migrations/postgres").run(p).await?,
            Self::Sqlite(p) => {
                let mut tries = 0;
                loop {
                    match sqlx::migrate!("./migrations/sqlite").run(p).await {
                        Ok(()) => break,
                        Err(e) if tries >= 3 => return Err(e.into()),
                        Err(e) => {
                            tries += 1;
                            tracing::debug!(error = %e, tries, "SQLite migration raced another process; again");
                            tokio::time::sleep(Duration::from_millis(50 * tries)).await;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes a batch's results and failures in one transaction.
    ///
    /// Results with the same record id are reduced to the newest publish first (one statement
    /// cannot update a row twice), and rows are written in record-id order so two workers
    /// committing overlapping batches lock rows in the same order and cannot deadlock.
    pub async fn commit(
        &self,
        results: &[ResultRow],
        failures: &[FailureRow],
    ) -> Result<(), StoreError> {
        let results = newest_per_record(results);
        // The statements are shared (`results_statement`, `failures_statement`); only the
        // connection type differs between the two arms.
        match self {
            Self::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                for chunk in results.chunks(PG_ROWS_PER_UPSERT) {
                    pg_results_statement(chunk).execute(&mut *tx).await?;
                }
                for chunk in failures.chunks(rows_per_statement(PG_MAX_BINDS, FAILURE_COLUMNS_N)) {
                    let mut q = failures_statement::<Postgres>(chunk);
                    q.build().execute(&mut *tx).await?;
                }
                tx.commit().await?;
            }
            Self::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                for chunk in results.chunks(rows_per_statement(SQLITE_MAX_BINDS, RESULT_COLUMNS)) {
                    let mut q = results_statement::<Sqlite>(chunk);
                    q.build().execute(&mut *tx).await?;
                }
                for chunk in
                    failures.chunks(rows_per_statement(SQLITE_MAX_BINDS, FAILURE_COLUMNS_N))
                {
                    let mut q = failures_statement::<Sqlite>(chunk);
                    q.build().execute(&mut *tx).await?;
                }
                tx.commit().await?;
            }
        }
        Ok(())
    }

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
        const Q: &str =
            "SELECT record_id, embedding, message_id, publish_time_us, input_sha256 FROM embeddings";
        // `::real[]` reads a pgvector column as well as an array one.
        const Q_PG: &str = "SELECT record_id, embedding::real[] AS embedding, message_id, \
             publish_time_us, input_sha256 FROM embeddings";
        let mut out = HashMap::new();
        match self {
            Self::Postgres(p) => {
                for row in sqlx::query(Q_PG).fetch_all(p).await? {
                    out.insert(
                        row.try_get("record_id")?,
                        StoredEmbedding {
                            embedding: row.try_get("embedding")?,
                            message_id: row.try_get("message_id")?,
                            publish_time_us: row.try_get("publish_time_us")?,
                            input_sha256: row.try_get("input_sha256")?,
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

/// What differs between the two databases' writes; the statements are otherwise shared.
///
/// Not `sqlx::Any`: it cannot bind PostgreSQL arrays, and the embedding is a `REAL[]` there
/// (readable with SQL) but a little-endian BLOB in SQLite, which has no arrays.
trait Dialect: Database {
    /// SQL for the current time, in the column's format.
    const NOW: &'static str;
    /// Binds an embedding as this database stores it.
    fn bind_embedding(b: &mut Separated<'_, '_, Self, &'static str>, v: &[f32]);
}

impl Dialect for Postgres {
    const NOW: &'static str = "now()";
    fn bind_embedding(b: &mut Separated<'_, '_, Self, &'static str>, v: &[f32]) {
        b.push_bind(v.to_vec());
    }
}

impl Dialect for Sqlite {
    const NOW: &'static str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";
    fn bind_embedding(b: &mut Separated<'_, '_, Self, &'static str>, v: &[f32]) {
        b.push_bind(f32s_to_le_bytes(v));
    }
}

/// The result UPSERT on PostgreSQL: one statement of the same text for any number of rows, its
/// columns bound as arrays and unnested, the vectors as one flat array sliced per row. A
/// multi-row VALUES list would be a new statement (parsed and planned, and cached) for every
/// row count, and the sink's group commits come in every size.
const PG_UPSERT_UNNEST: &str = "INSERT INTO embeddings (record_id, embedding, model, model_hash, \
     dim, job, input_sha256, message_id, publish_time_us) \
     SELECT r.record_id, ($2::real[])[r.first : r.first + r.dim - 1], r.model, r.model_hash, \
     r.dim, r.job, r.input_sha256, r.message_id, r.publish_time_us \
     FROM UNNEST($1::text[], $3::int[], $4::int[], $5::text[], $6::text[], $7::text[], \
     $8::text[], $9::text[], $10::bigint[]) \
     AS r(record_id, first, dim, model, model_hash, job, input_sha256, message_id, publish_time_us)";

fn pg_results_statement<'q>(
    rows: &[&ResultRow],
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    let mut flat = Vec::with_capacity(rows.iter().map(|r| r.embedding.len()).sum());
    let mut firsts = Vec::with_capacity(rows.len());
    for r in rows {
        firsts.push(i32::try_from(flat.len() + 1).unwrap_or(i32::MAX));
        flat.extend_from_slice(&r.embedding);
    }
    let col = |f: fn(&ResultRow) -> String| rows.iter().map(|r| f(r)).collect::<Vec<String>>();
    sqlx::query(PG_UPSERT_STATEMENT.as_str())
        .bind(col(|r| r.record_id.clone()))
        .bind(flat)
        .bind(firsts)
        .bind(
            rows.iter()
                .map(|r| r.embedding.len() as i32)
                .collect::<Vec<i32>>(),
        )
        .bind(col(|r| r.model.clone()))
        .bind(col(|r| r.model_hash.clone()))
        .bind(
            rows.iter()
                .map(|r| r.job.clone())
                .collect::<Vec<Option<String>>>(),
        )
        .bind(col(|r| r.input_sha256.clone()))
        .bind(col(|r| r.message_id.clone()))
        .bind(rows.iter().map(|r| r.publish_time_us).collect::<Vec<i64>>())
}

/// [`PG_UPSERT_UNNEST`] with the UPSERT's conflict clause.
static PG_UPSERT_STATEMENT: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("{PG_UPSERT_UNNEST}{}", upsert_tail(Postgres::NOW)));

/// The result UPSERT, one multi-row statement (SQLite).
fn results_statement<'a, DB>(results: &'a [&ResultRow]) -> QueryBuilder<'a, DB>
where
    DB: Dialect,
    DB::Arguments<'a>: Default,
    String: Encode<'a, DB> + Type<DB>,
    Option<String>: Encode<'a, DB> + Type<DB>,
    i32: Encode<'a, DB> + Type<DB>,
    i64: Encode<'a, DB> + Type<DB>,
{
    let mut q = QueryBuilder::<DB>::new(UPSERT_COLUMNS);
    q.push_values(results, |mut b, r| {
        b.push_bind(r.record_id.clone());
        DB::bind_embedding(&mut b, &r.embedding);
        b.push_bind(r.model.clone())
            .push_bind(r.model_hash.clone())
            .push_bind(r.embedding.len() as i32)
            .push_bind(r.job.clone())
            .push_bind(r.input_sha256.clone())
            .push_bind(r.message_id.clone())
            .push_bind(r.publish_time_us);
    });
    q.push(upsert_tail(DB::NOW));
    q
}

/// The failure INSERT (a redelivered bad payload keeps its first row), one statement.
fn failures_statement<'a, DB>(failures: &'a [FailureRow]) -> QueryBuilder<'a, DB>
where
    DB: Database,
    DB::Arguments<'a>: Default,
    String: Encode<'a, DB> + Type<DB>,
    Option<String>: Encode<'a, DB> + Type<DB>,
    Vec<u8>: Encode<'a, DB> + Type<DB>,
    i64: Encode<'a, DB> + Type<DB>,
{
    let mut q = QueryBuilder::<DB>::new(FAILURE_COLUMNS);
    q.push_values(failures, |mut b, f| {
        b.push_bind(f.message_id.clone())
            .push_bind(f.record_id.clone())
            .push_bind(f.job.clone())
            .push_bind(f.error.clone())
            .push_bind(f.payload.clone())
            .push_bind(f.payload_bytes)
            .push_bind(f.payload_sha256.clone())
            .push_bind(f.publish_time_us);
    });
    q.push(FAILURE_TAIL);
    q
}

/// How this process spaces its attempts at a failing database: exponential from `first` to 5 s,
/// with jitter so a fleet of workers does not hammer a recovering server in step, and no limit
/// on attempts (the callers stop on shutdown).
pub fn retry_schedule(first: std::time::Duration) -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(first)
        .with_max_delay(std::time::Duration::from_secs(5))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

/// Keeps, for each (record id, model), the row with the newest publish time; sorted by both.
pub fn newest_per_record(rows: &[ResultRow]) -> Vec<&ResultRow> {
    let mut best: HashMap<(&str, &str), &ResultRow> = HashMap::new();
    for r in rows {
        best.entry((&r.record_id, &r.model))
            .and_modify(|cur| {
                if r.publish_time_us >= cur.publish_time_us {
                    *cur = r;
                }
            })
            .or_insert(r);
    }
    let mut out: Vec<&ResultRow> = best.into_values().collect();
    out.sort_by(|a, b| (&a.record_id, &a.model).cmp(&(&b.record_id, &b.model)));
    out
}

/// Encodes a vector as little-endian f32 bytes (the SQLite BLOB format).
pub fn f32s_to_le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Decodes little-endian f32 bytes (trailing partial values are ignored).
pub fn le_bytes_to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The URL with any password replaced by `***`, safe for logs.
pub fn redact_url(url: &str) -> String {
    redact_query_password(&redact_userinfo(url))
}

/// `scheme://user:***@host…`: the password of the userinfo hidden.
fn redact_userinfo(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    // The userinfo ends at the last `@` before the query, as URL parsers read it: a password
    // may hold `@` itself, and cutting at the first one would print the rest of it. Should a
    // path hold an `@`, more is hidden than needed, never less.
    let before_query = rest.find(['?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..before_query].rfind('@') else {
        return url.to_string();
    };
    let userinfo = &rest[..at];
    match userinfo.find(':') {
        Some(colon) => format!(
            "{}{}:***{}",
            &url[..scheme_end + 3],
            &userinfo[..colon],
            &rest[at..]
        ),
        None => url.to_string(),
    }
}

/// `…?password=***&…`: every query parameter whose name ends in `password` (`password`,
/// `sslpassword`, any case) hidden.
fn redact_query_password(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_string();
    };
    let params: Vec<String> = query
        .split('&')
        .map(|p| match p.split_once('=') {
            Some((k, _)) if k.to_ascii_lowercase().ends_with("password") => format!("{k}=***"),
            _ => p.to_string(),
        })
        .collect();
    format!("{base}?{}", params.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, t: i64) -> ResultRow {
        ResultRow {
            record_id: id.into(),
            embedding: vec![t as f32],
            model: "m".into(),
            model_hash: "0123456789abcdef".into(),
            job: None,
            input_sha256: String::new(),
            message_id: format!("{id}-{t}"),
            publish_time_us: t,
        }
    }

    #[test]
    fn newest_publish_wins_within_a_batch() {
        let rows = vec![row("b", 1), row("a", 5), row("b", 3), row("a", 2)];
        let out = newest_per_record(&rows);
        let got: Vec<(&str, i64)> = out
            .iter()
            .map(|r| (r.record_id.as_str(), r.publish_time_us))
            .collect();
        assert_eq!(got, vec![("a", 5), ("b", 3)]);
    }

    #[test]
    fn blob_round_trip() {
        let v = vec![0.5f32, -1.25, 3.0e-7];
        assert_eq!(le_bytes_to_f32s(&f32s_to_le_bytes(&v)), v);
    }

    #[test]
    fn passwords_never_reach_logs() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(redact_url("sqlite://x.db"), "sqlite://x.db");
    }

    #[test]
    fn a_password_holding_at_signs_is_hidden_whole() {
        let r = redact_url("postgres://u:p@ss@w0rd@h:5432/db");
        assert_eq!(r, "postgres://u:***@h:5432/db");
        assert!(!r.contains("ss") && !r.contains("w0rd"), "{r}");
    }

    #[test]
    fn passwords_in_the_query_are_redacted_too() {
        assert_eq!(
            redact_url("postgres://u@h/db?sslmode=require&password=secret&sslpassword=other"),
            "postgres://u@h/db?sslmode=require&password=***&sslpassword=***"
        );
        assert_eq!(
            redact_url("postgres://u:a@h/db?PASSWORD=b"),
            "postgres://u:***@h/db?PASSWORD=***"
        );
    }
}
