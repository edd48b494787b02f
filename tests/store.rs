//! The store against real PostgreSQL and SQLite: a batch larger than one statement's bind
//! parameters allow (PostgreSQL 65,535; SQLite 32,766) still commits, in one transaction.

mod common;

use common::*;
use spotinfer::external::store::{FailureRow, ResultRow, Store};

/// More rows than one statement can carry in either database: 9,000 results (8 binds each) and
/// 6,000 failure rows (6 binds each).
fn oversized_batch() -> (Vec<ResultRow>, Vec<FailureRow>) {
    let results = (0..9_000)
        .map(|i| ResultRow {
            record_id: format!("r{i}"),
            embedding: vec![0.5; 4],
            model: "m".into(),
            job: Some("big".into()),
            input_sha256: "00".into(),
            message_id: format!("m{i}"),
            publish_time_us: i,
        })
        .collect();
    let failures = (0..6_000)
        .map(|i| FailureRow {
            message_id: format!("f{i}"),
            record_id: None,
            job: Some("big".into()),
            error: "bad".into(),
            payload: b"x".to_vec(),
            publish_time_us: i,
        })
        .collect();
    (results, failures)
}

async fn commits_a_batch_past_the_bind_limit(url: &str) {
    let store = Store::connect(url).await.unwrap();
    store.migrate().await.unwrap();
    let (results, failures) = oversized_batch();
    store.commit(&results, &failures).await.unwrap();
    let counts = store.status(Some("big")).await.unwrap();
    assert_eq!((counts.done, counts.failed), (9_000, 6_000));
}

#[tokio::test]
async fn sqlite_commits_a_batch_past_the_bind_limit() {
    let (_dir, url) = fresh_sqlite();
    commits_a_batch_past_the_bind_limit(&url).await;
}

#[tokio::test]
async fn postgres_commits_a_batch_past_the_bind_limit() {
    let url = fresh_pg_database().await;
    commits_a_batch_past_the_bind_limit(&url).await;
}
