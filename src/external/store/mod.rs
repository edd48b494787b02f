//! The result store: PostgreSQL in production, SQLite as the embedded default.
//!
//! Every write is one transaction holding a batch's results and its failure rows, so the sink can
//! ack exactly the messages whose outcome is durable. Results are UPSERTed by (record id, model)
//! with a guard on the publish time: a redelivered or republished record leaves exactly one row
//! per model, a second model's vectors sit beside the first's, and a redelivery of an older
//! publish never overwrites the result of a newer one.
//!
//! This file holds what every other part needs: the [`Store`] (a pool of either database), how
//! to connect and migrate, and the errors. The rest, one job a file:
//!
//! * `write`: the worker's commit of results and failure rows (statements, bind limits, which
//!   refusals are the data's);
//! * `read`: counts and whole-table reads for `status`, verification and tests;
//! * `rows`: a job's rows streamed for `export`; `jobs`: job registration and progress;
//! * `registry`: what a publish writes before its messages go out (record ids, where each was
//!   read, the columns kept with it) and which shards of an input are finished;
//! * `vector`: the pgvector column and its indexes;
//! * `checkpoints`: interrupted generations' tokens, saved at shutdown and read on redelivery;
//! * `redact`: the database URL with its passwords hidden, for logs and errors.

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

mod checkpoints;
mod jobs;
mod read;
mod redact;
mod registry;
mod rows;
mod vector;
mod workers;
mod write;

pub use checkpoints::Checkpoint;

/// Every PostgreSQL statement that reads one job (`$1`) of one model (`$2`) for `status`,
/// `export` and job mode's watch, by name. Their plans must stay linear in the job's size
/// whatever the planner's statistics (`migrations/postgres/0013`): tests/store.rs EXPLAINs each
/// on a bulk-loaded job whose statistics were never gathered.
pub const JOB_STATEMENTS_PG: [(&str, &str); 6] = [
    ("published", jobs::PUBLISHED),
    ("done", jobs::DONE),
    ("failed", jobs::FAILED),
    ("recent", jobs::RECENT_PG),
    ("results", rows::RESULTS_PG),
    ("failures", rows::FAILURES_PG),
];
pub use jobs::{ExportedRefusal, JobCounts, JobStatus, RefusedLine, REFUSED_RAW_BYTES};
pub use read::{StatusCounts, StoredEmbedding};
pub use redact::redact_url;
pub use registry::{FinishedInput, Registration};
pub use rows::{ExportedFailure, ExportedResult};
pub use vector::VectorColumn;
pub use write::{
    f32s_to_le_bytes, le_bytes_to_f32s, newest_per_record, storable, FailureRow, Prediction,
    ResultRow,
};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
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
    /// An input a publish got part-way through has other content now: resuming it by row
    /// number would skip rows of the new content.
    #[error(
        "{input} changed since a publish to job {job:?} got through its first {rows} rows (it was \
         {was}, it is {now}): give it a new name, or --republish to read it from its first row"
    )]
    InputChanged {
        /// The job.
        job: String,
        /// The input (a shard's full name).
        input: String,
        /// The rows the earlier publish got through.
        rows: i64,
        /// What its content was then.
        was: String,
        /// What it is now.
        now: String,
    },
    /// A stored value cannot be read back as it was written.
    #[error("a stored row cannot be read: {0}")]
    Unreadable(String),
    /// pgvector was asked for where it cannot be had.
    #[error("pgvector: {0}")]
    NoPgvector(String),
}

/// A connection pool to one of the supported databases.
#[derive(Debug, Clone)]
pub enum Store {
    /// PostgreSQL.
    Postgres(PgPool),
    /// SQLite.
    Sqlite(SqlitePool),
}

/// SQL for the current time, in the format each database's timestamp columns hold.
///
/// Two constants, not a trait over `sqlx::Database`: a `Dialect` trait (its `NOW` and how to
/// bind an embedding) once let one generic statement builder serve both databases, but the
/// PostgreSQL results are now written by their own UNNEST statement, so the trait served SQLite
/// alone and its PostgreSQL embedding binding was dead code. What is left to differ is this
/// SQL text, picked by [`Store::now_sql`] like any other per-database spelling ([`Store::pick`]).
const PG_NOW: &str = "now()";
const SQLITE_NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

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
            Self::Postgres(_) => PG_NOW,
            Self::Sqlite(_) => SQLITE_NOW,
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
