//! The worker end to end against the real Pub/Sub emulator, real PostgreSQL and SQLite.

mod common;

use common::*;
use sha2::{Digest, Sha256};
use spotinfer::config::PubsubArgs;
use spotinfer::external::store::{ResultRow, Store};
use spotinfer::external::telemetry::Metrics;
use spotinfer::model::DeviceChoice;
use spotinfer::model::{cosine, ModelHandle, TextModel};
use spotinfer::pipeline::worker::{self, Report, WorkerConfig};
use spotinfer::shutdown::Shutdown;
use std::time::{Duration, Instant};

fn config_for(args: &PubsubArgs, idle: Option<Duration>) -> WorkerConfig {
    WorkerConfig {
        exit_when_idle: idle,
        ..worker_config(args.config())
    }
}

fn model() -> spotinfer::model::Served {
    served(ModelHandle::spawn(TextModel::load(&model_dir(), DeviceChoice::Cpu).unwrap()).unwrap())
}

async fn run_until_idle(args: &PubsubArgs, db: &str) -> Report {
    let store = Store::connect(db).await.unwrap();
    store.migrate().await.unwrap();
    let cfg = config_for(args, Some(Duration::from_secs(5)));
    worker::run(cfg, store, model(), Metrics::new(), Shutdown::new())
        .await
        .unwrap()
}

fn poison() -> Vec<(Vec<u8>, &'static str)> {
    vec![
        (b"this is not json".to_vec(), "not JSON"),
        (b"[1, 2, 3]".to_vec(), "not an object"),
        (br#"{"text": "no id here"}"#.to_vec(), "\"id\" is missing"),
        (
            br#"{"id": "p-empty", "text": ""}"#.to_vec(),
            "\"text\" is empty",
        ),
        (
            br#"{"id": 42, "text": "numeric id"}"#.to_vec(),
            "\"id\" must be a string",
        ),
        (b"\xff\xfe\x00 invalid utf-8".to_vec(), "not valid UTF-8"),
        (
            format!(r#"{{"id": "p-huge", "text": "{}"}}"#, "x".repeat(5000)).into_bytes(),
            "the limit is 4096",
        ),
    ]
}

async fn commits_every_record_once(db: &str, name: &str) {
    let (args, cfg) = fresh_pubsub(name).await;
    let lines = record_lines(name, 80);
    publish_lines(&cfg, &lines).await;
    // Republish record 0 with a new text: the newer publish must win.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let newer_text = "a newer version of the first record";
    publish_lines(
        &cfg,
        &[
            serde_json::json!({"id": format!("{name}-00000"), "text": newer_text, "job": name})
                .to_string(),
        ],
    )
    .await;
    let bad = poison();
    publish_raw(&cfg, bad.iter().map(|(p, _)| p.clone()).collect()).await;

    let report = run_until_idle(&args, db).await;

    let store = Store::connect(db).await.unwrap();
    let status = store.status(None).await.unwrap();
    assert_eq!(status.done, 80, "one row per record id");
    assert_eq!(
        status.failed,
        bad.len() as i64,
        "one failure row per poison message"
    );
    assert_eq!(store.status(Some(name)).await.unwrap().done, 80);
    assert_eq!(report.counts.nacked, 0, "{report:?}");
    assert!(report.counts.acked >= 88, "every message acked: {report:?}");

    let failures = store.failures().await.unwrap();
    for (_, want) in &bad {
        assert!(
            failures.iter().any(|(_, _, e)| e.contains(want)),
            "no failure row mentions {want:?}: {failures:?}"
        );
    }
    assert!(failures
        .iter()
        .any(|(_, id, _)| id.as_deref() == Some("p-empty")));

    let rows = store.embeddings().await.unwrap();
    let first = &rows[&format!("{name}-00000")];
    assert_eq!(first.input_sha256, hex::encode(Sha256::digest(newer_text)));
    // Stored vectors are the model's vectors for those texts.
    let embedder = TextModel::load(&model_dir(), DeviceChoice::Cpu).unwrap();
    for line in lines.iter().skip(1).step_by(17) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let want = &embedder
            .embed(&[v["text"].as_str().unwrap()])
            .unwrap()
            .vectors[0];
        let got = &rows[v["id"].as_str().unwrap()].embedding;
        assert_eq!(got.len(), 384);
        assert!(cosine(got, want) > 0.9999);
    }
    assert_subscription_empty(&cfg, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_commits_every_record_once_and_records_poison() {
    let db = fresh_pg_database().await;
    commits_every_record_once(&db, &unique("pg-once")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_commits_every_record_once_and_records_poison() {
    let (_dir, db) = fresh_sqlite();
    commits_every_record_once(&db, &unique("sq-once")).await;
}

fn row(id: &str, t: i64, v: f32) -> ResultRow {
    ResultRow {
        record_id: id.into(),
        embedding: vec![v; 4],
        prediction: Default::default(),
        model: "m".into(),
        model_hash: "00000000000000aa".into(),
        job: None,
        input_sha256: format!("h{t}"),
        message_id: format!("m{t}"),
        publish_time_us: t,
    }
}

async fn older_publish_never_overwrites(db: &str) {
    let store = Store::connect(db).await.unwrap();
    store.migrate().await.unwrap();
    store
        .commit(&[row("r", 200, 2.0)], &[], None)
        .await
        .unwrap();
    // A redelivery of an older publish arrives late: ignored.
    store
        .commit(&[row("r", 100, 1.0)], &[], None)
        .await
        .unwrap();
    assert_eq!(store.embeddings().await.unwrap()["r"].publish_time_us, 200);
    // The same message again: idempotent.
    store
        .commit(&[row("r", 200, 2.0)], &[], None)
        .await
        .unwrap();
    // A newer publish replaces it, and duplicates inside one batch keep the newest.
    store
        .commit(
            &[row("r", 300, 3.0), row("r", 250, 2.5), row("s", 1, 1.0)],
            &[],
            None,
        )
        .await
        .unwrap();
    let rows = store.embeddings().await.unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows["r"].publish_time_us, 300);
    assert_eq!(rows["r"].embedding, vec![3.0; 4]);
}

#[tokio::test]
async fn postgres_older_publish_never_overwrites_newer() {
    older_publish_never_overwrites(&fresh_pg_database().await).await;
}

#[tokio::test]
async fn sqlite_older_publish_never_overwrites_newer() {
    let (_dir, db) = fresh_sqlite();
    older_publish_never_overwrites(&db).await;
}

#[tokio::test]
async fn setup_is_idempotent() {
    let name = unique("setup");
    let (_, cfg) = fresh_pubsub(&name).await;
    let again = cfg.setup(Duration::from_secs(10)).await.unwrap();
    assert!(!again.topic_created && !again.subscription_created);
}

async fn count_rows(db: &str) -> i64 {
    let store = Store::connect(db).await.unwrap();
    store.status(None).await.unwrap().done
}

/// SIGTERM mid-stream: exit 0 well inside Spot's 15 s, nothing lost, and the NACKed messages
/// reach a second worker at once instead of after a lease timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_stream_exits_fast_and_a_second_worker_takes_over() {
    let name = unique("sigterm");
    let (args, cfg) = fresh_pubsub(&name).await;
    let db = fresh_pg_database().await;
    // Enough work that A is still busy when B has loaded its model, even on a loaded machine
    // (A computes in f32, the slower precision, for the same reason).
    let n = 3000;
    publish_lines(&cfg, &record_lines(&name, n)).await;

    let mut a = WorkerProcess::start(
        &args,
        &db,
        &[
            "--max-outstanding",
            "1000",
            "--batch-size",
            "16",
            "--precision",
            "f32",
        ],
    );
    wait_until(Duration::from_secs(120), "worker A to commit", || async {
        a.metric("spotinfer_records_committed_total")
            .await
            .unwrap_or(0.0)
            >= 32.0
    })
    .await;
    // B waits out the ack deadline (10 s) before it calls itself idle: a message whose NACK
    // never reached the emulator (one a stream was delivering as A stopped, say) comes back only
    // when its lease expires. Once, with 4 s, B left before a batch came back: 2,984 of 3,000
    // rows; which of A's messages those were was not recorded.
    let mut b = WorkerProcess::start(
        &args,
        &db,
        &["--exit-when-idle", "15s", "--batch-size", "16"],
    );
    wait_until(Duration::from_secs(60), "worker B ready", || b.ready()).await;
    let b_before = b
        .metric("spotinfer_messages_received_total")
        .await
        .unwrap_or(0.0);

    let a_done = a
        .metric("spotinfer_records_committed_total")
        .await
        .unwrap_or(0.0);
    assert!(
        a_done < n as f64,
        "A finished all {n} records before B was ready: nothing left to hand over"
    );
    let sigterm_at = Instant::now();
    a.signal(libc::SIGTERM);
    let (status, exit_time) = a.wait(Duration::from_secs(15));
    let mut takeover = None;
    while takeover.is_none() && sigterm_at.elapsed() < Duration::from_secs(30) {
        if b.metric("spotinfer_messages_received_total")
            .await
            .unwrap_or(0.0)
            > b_before
        {
            takeover = Some(sigterm_at.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("SIGTERM: exit {status} in {exit_time:?}; B received redeliveries {takeover:?} after SIGTERM (B had {b_before} before)");
    assert!(status.success(), "graceful exit must be 0: {status}");
    assert!(
        exit_time < Duration::from_secs(5),
        "exit took {exit_time:?}"
    );
    let takeover = takeover.expect("B never received a message after SIGTERM");
    assert!(
        takeover < Duration::from_secs(3),
        "redelivery took {takeover:?}: NACK was not immediate"
    );

    let (status_b, _) = b.wait(Duration::from_secs(240));
    assert!(status_b.success());
    assert_eq!(count_rows(&db).await, n as i64, "every record exactly once");
    assert_subscription_empty(&cfg, Duration::from_secs(2)).await;
}

/// SIGKILL mid-stream: the dead worker's messages come back after the lease extension and are
/// committed once; nothing is duplicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_redelivers_without_duplicates() {
    let name = unique("sigkill");
    let (args, cfg) = fresh_pubsub(&name).await;
    let (_dir, db) = fresh_sqlite();
    let n = 200;
    let lines = record_lines(&name, n);
    publish_lines(&cfg, &lines).await;

    let mut a = WorkerProcess::start(&args, &db, &["--batch-size", "16"]);
    wait_until(Duration::from_secs(120), "worker A to commit", || async {
        a.metric("spotinfer_records_committed_total")
            .await
            .unwrap_or(0.0)
            >= 32.0
    })
    .await;
    a.signal(libc::SIGKILL);
    let (status, _) = a.wait(Duration::from_secs(5));
    assert!(!status.success());
    let killed_at = Instant::now();

    // Idle longer than the 10 s lease so the dead worker's messages come back in time.
    let mut b = WorkerProcess::start(
        &args,
        &db,
        &["--exit-when-idle", "15s", "--batch-size", "16"],
    );
    let (status_b, _) = b.wait(Duration::from_secs(240));
    assert!(status_b.success());
    eprintln!(
        "SIGKILL: all records committed {:?} after the kill",
        killed_at.elapsed()
    );
    let store = Store::connect(&db).await.unwrap();
    let rows = store.embeddings().await.unwrap();
    assert_eq!(rows.len(), n);
    for line in &lines {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(rows.contains_key(v["id"].as_str().unwrap()));
    }
    assert_subscription_empty(&cfg, Duration::from_secs(2)).await;
}

/// The database goes away mid-run: commits fail and are retried in place, the messages stay
/// leased (no NACK: each would cost a delivery attempt towards a dead-letter limit; before, every
/// failed commit NACKed its batch), the worker stays up and finishes every record once the
/// database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_outage_retries_commits_in_place_then_recovers() {
    let name = unique("dbdown");
    let (args, cfg) = fresh_pubsub(&name).await;
    let db = fresh_pg_database().await;
    let n = 150;
    publish_lines(&cfg, &record_lines(&name, n)).await;

    let (proxy, proxied) = proxied_pg(&db).await;

    let store = Store::connect(&proxied).await.unwrap();
    store.migrate().await.unwrap();
    let metrics = Metrics::new();
    let shutdown = Shutdown::new();
    let worker = tokio::spawn(worker::run(
        config_for(&args, None),
        store,
        model(),
        metrics.clone(),
        shutdown.clone(),
    ));
    wait_until(Duration::from_secs(120), "first commits", || async {
        metrics.counts().committed >= 32
    })
    .await;
    proxy.cut();
    let cut_at = Instant::now();
    wait_until(Duration::from_secs(30), "a failed commit", || async {
        metrics.counts().commit_errors >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(cut_at.elapsed())).await;
    let during = metrics.counts();
    proxy.restore();
    let restored_at = Instant::now();
    wait_until(
        Duration::from_secs(180),
        "all records after recovery",
        || async { count_rows(&db).await == n as i64 },
    )
    .await;
    eprintln!(
        "DB outage: {} failed commits, {} nacks during the outage; all {n} records {:?} after restore",
        during.commit_errors,
        during.nacked,
        restored_at.elapsed()
    );
    assert!(during.commit_errors > 0, "{during:?}");
    assert_eq!(
        during.nacked, 0,
        "failed commits are retried, not NACKed: {during:?}"
    );
    assert!(
        !worker.is_finished(),
        "the worker must stay up through the outage"
    );
    shutdown.cancel();
    let report = worker.await.unwrap().unwrap();
    assert!(report.counts.committed >= n as u64);
    assert_eq!(count_rows(&db).await, n as i64);
    assert_subscription_empty(&cfg, Duration::from_secs(2)).await;
}

/// Regression (found by the load test): a worker restarted during a database outage exited 1 at
/// startup. It now waits for the database and then works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_started_during_a_database_outage_waits_for_it() {
    let name = unique("dbstart");
    let (args, cfg) = fresh_pubsub(&name).await;
    let db = fresh_pg_database().await;
    let n = 20;
    publish_lines(&cfg, &record_lines(&name, n)).await;
    Store::connect(&db).await.unwrap().migrate().await.unwrap();
    let (proxy, proxied) = proxied_pg(&db).await;
    proxy.cut();
    let mut w = WorkerProcess::start(&args, &proxied, &["--exit-when-idle", "4s"]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        w.child.try_wait().unwrap().is_none(),
        "worker gave up while the database was down"
    );
    assert_eq!(count_rows(&db).await, 0);
    proxy.restore();
    let (status, _) = w.wait(Duration::from_secs(120));
    assert!(status.success(), "{status}");
    assert_eq!(count_rows(&db).await, n as i64);
}

/// Records pick the model's prompt by name (e5's "query"/"passage" on one subscription); a name
/// the model lacks is a failure row naming the model's prompts; rows carry the model's name and
/// weights hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_choose_their_prompt_and_rows_name_the_model() {
    let name = unique("prompts");
    let (args, cfg) = fresh_pubsub(&name).await;
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/bert-cls-f16");
    let text = "where do spot nodes go when they are preempted";
    let line = |id: &str, prompt: Option<&str>| {
        let mut v = serde_json::json!({"id": format!("{name}-{id}"), "text": text});
        if let Some(p) = prompt {
            v["prompt_name"] = p.into();
        }
        v.to_string()
    };
    publish_lines(
        &cfg,
        &[
            line("q", Some("query")),
            line("p", Some("passage")),
            line("none", None),
            line("bad", Some("questions")),
        ],
    )
    .await;
    let (_tmp, db) = fresh_sqlite();
    let store = Store::connect(&db).await.unwrap();
    store.migrate().await.unwrap();
    let embedder = TextModel::load(&dir, DeviceChoice::Cpu).unwrap();
    let info = embedder.info().clone();
    let want = |prompt: Option<&str>| {
        embedder
            .embed_inputs(&[spotinfer::model::Input {
                text,
                text_pair: None,
                prompt_name: prompt,
            }])
            .unwrap()
            .vectors
            .remove(0)
    };
    let (q, p, none) = (want(Some("query")), want(Some("passage")), want(None));
    assert!(cosine(&q, &p) < 0.9999, "the prompts change the vector");
    let cfg = config_for(&args, Some(Duration::from_secs(5)));
    let model =
        served(ModelHandle::spawn(TextModel::load(&dir, DeviceChoice::Cpu).unwrap()).unwrap());
    let report = worker::run(cfg, store.clone(), model, Metrics::new(), Shutdown::new())
        .await
        .unwrap();
    assert_eq!(report.counts.nacked, 0, "{report:?}");
    let rows = store.embeddings().await.unwrap();
    for (id, want) in [("q", &q), ("p", &p), ("none", &none)] {
        let got = &rows[&format!("{name}-{id}")].embedding;
        assert!(cosine(got, want) > 0.99999, "{id}");
    }
    let failures = store.failures().await.unwrap();
    let bad = failures
        .iter()
        .find(|(_, id, _)| id.as_deref() == Some(&format!("{name}-bad")))
        .expect("a failure row for the unknown prompt");
    assert!(
        bad.2.contains("no prompt named \"questions\"") && bad.2.contains("passage, query"),
        "{bad:?}"
    );
    let Store::Sqlite(pool) = &store else {
        unreachable!()
    };
    let tags: Vec<(String, String)> =
        sqlx::query_as("SELECT DISTINCT model, model_hash FROM embeddings")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(tags, [("bert-cls-f16".to_string(), info.hash.clone())]);
}
