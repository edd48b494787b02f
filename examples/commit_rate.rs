//! One PostgreSQL's commit rate at the worker's statement shape: `--writers` tasks (workers'
//! sinks), each committing `--rows` result rows of `--dim` floats per transaction through the
//! worker's own `Store::commit` (one UNNEST UPSERT, new record ids), for `--seconds`. Prints
//! rows/s, commits/s and the WAL bytes written per row; docs/scaling.md builds on the figures.
//!
//!     cargo run --release --example commit_rate -- --database-url postgres://... \
//!         --rows 512 --writers 4 --seconds 20

use clap::Parser;
use spotinfer::external::store::{ResultRow, Store};
use sqlx::Row;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Commit synthetic results as fast as the database takes them.
#[derive(Parser)]
struct Args {
    /// A PostgreSQL database (its embeddings table is written to; use a scratch database).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Rows per transaction.
    #[arg(long, default_value_t = 512)]
    rows: usize,
    /// Concurrent committers.
    #[arg(long, default_value_t = 1)]
    writers: usize,
    /// Commit a different number of rows each time, 1 to --rows (as the sink's group commits
    /// do), instead of exactly --rows.
    #[arg(long)]
    vary: bool,
    /// Floats per vector.
    #[arg(long, default_value_t = 384)]
    dim: usize,
    /// How long to commit.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let store = Store::connect(&a.database_url).await?;
    store.migrate().await?;
    let pool = sqlx::PgPool::connect(&a.database_url).await?;
    let lsn = || async {
        let row = sqlx::query("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint AS b")
            .fetch_one(&pool)
            .await?;
        Ok::<f64, sqlx::Error>(row.try_get::<i64, _>("b")? as f64)
    };
    let rows = Arc::new(AtomicU64::new(0));
    let commits = Arc::new(AtomicU64::new(0));
    let wal_before = lsn().await?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(a.seconds);
    let mut tasks = Vec::new();
    for w in 0..a.writers {
        let (store, rows, commits) = (store.clone(), rows.clone(), commits.clone());
        let (max, dim, vary) = (a.rows, a.dim, a.vary);
        tasks.push(tokio::spawn(async move {
            let mut batch_no = 0u64;
            while Instant::now() < deadline {
                // Sizes spread over 1..=max by a multiplicative hash of the batch number.
                let n = if vary {
                    1 + (batch_no.wrapping_mul(2_654_435_761) % max as u64) as usize
                } else {
                    max
                };
                let batch: Vec<ResultRow> = (0..n)
                    .map(|i| ResultRow {
                        record_id: format!("w{w}-b{batch_no}-r{i}"),
                        embedding: (0..dim)
                            .map(|j| ((i * 31 + j) % 97) as f32 / 97.0)
                            .collect(),
                        prediction: Default::default(),
                        model: "bench".into(),
                        model_hash: "0123456789abcdef".into(),
                        job: Some("bench".into()),
                        input_sha256: format!("{:064x}", i),
                        message_id: format!("{w}-{batch_no}-{i}"),
                        publish_time_us: 1,
                    })
                    .collect();
                store.commit(&batch, &[], None).await?;
                rows.fetch_add(n as u64, Ordering::Relaxed);
                commits.fetch_add(1, Ordering::Relaxed);
                batch_no += 1;
            }
            Ok::<(), anyhow::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let seconds = started.elapsed().as_secs_f64();
    let wal = lsn().await? - wal_before;
    let (rows, commits) = (
        rows.load(Ordering::Relaxed),
        commits.load(Ordering::Relaxed),
    );
    println!(
        "{}",
        serde_json::json!({
            "rows_per_commit": a.rows,
            "vary": a.vary,
            "writers": a.writers,
            "dim": a.dim,
            "seconds": seconds,
            "rows_per_s": rows as f64 / seconds,
            "commits_per_s": commits as f64 / seconds,
            "wal_bytes_per_row": wal / rows.max(1) as f64,
        })
    );
    Ok(())
}
