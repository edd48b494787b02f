//! The test helpers that need neither the `spotinfer` binary nor its library: where the
//! harness's emulator and PostgreSQL are, unique names, fresh databases. `tests/common` re-exports
//! them; the load-test crate's tests include this file as it is.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, Ordering};

/// host:port of the emulator the harness started.
pub fn emulator() -> String {
    std::env::var("PUBSUB_EMULATOR_HOST")
        .expect("PUBSUB_EMULATOR_HOST is not set: run the suite with scripts/test.sh")
}

/// Admin URL of the test PostgreSQL.
pub fn pg_admin_url() -> String {
    std::env::var("SPOTINFER_TEST_PG_URL")
        .expect("SPOTINFER_TEST_PG_URL is not set: run the suite with scripts/test.sh")
}

/// A name unique to this process and call.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}-{}-{}-{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Creates a fresh PostgreSQL database and returns its URL.
pub async fn fresh_pg_database() -> String {
    fresh_pg_database_at(&pg_admin_url()).await
}

/// Creates a fresh database on the server `admin` (a URL whose role may create databases)
/// and returns its URL.
pub async fn fresh_pg_database_at(admin: &str) -> String {
    let admin = admin.to_string();
    let name = unique("t").replace('-', "_");
    let pool = sqlx::PgPool::connect(&admin)
        .await
        .expect("connect to test postgres");
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&pool)
        .await
        .expect("create database");
    pool.close().await;
    let base = admin.rsplit_once('/').map(|(b, _)| b).unwrap_or(&admin);
    format!("{base}/{name}")
}
