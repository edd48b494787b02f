//! Graceful shutdown, held to its promise against the real emulator and real PostgreSQL: a
//! commit in flight at SIGTERM is finished and acked (never redone elsewhere).

mod common;

use common::*;
use spotinfer::external::pubsub::SubscriptionPolicy;
use spotinfer::external::store::Store;
use std::time::Duration;

/// Adds a `writes` table that a trigger fills with one row per INSERT or UPDATE of a result, so
/// a test can count how many times each record was committed.
async fn count_writes(db: &str) {
    Store::connect(db).await.unwrap().migrate().await.unwrap();
    let pool = sqlx::PgPool::connect(db).await.unwrap();
    for sql in [
        "CREATE TABLE writes (record_id TEXT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())",
        "CREATE FUNCTION note_write() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN INSERT INTO writes (record_id) VALUES (NEW.record_id); RETURN NEW; END $$",
        "CREATE TRIGGER note_write AFTER INSERT OR UPDATE ON embeddings \
         FOR EACH ROW EXECUTE FUNCTION note_write()",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    pool.close().await;
}

/// (records written, records written more than once).
async fn writes(db: &str) -> (i64, i64) {
    let pool = sqlx::PgPool::connect(db).await.unwrap();
    let row: (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE n > 1) \
         FROM (SELECT record_id, count(*) AS n FROM writes GROUP BY record_id) w",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    pool.close().await;
    row
}

/// Finding 1 of the semantics review: PostgreSQL answers slowly (0.4 s per reply), so SIGTERM
/// lands while a commit is running. That commit must finish and be acked (confirmed, on an
/// exactly-once subscription); a second worker then finishes the rest. No record may be
/// committed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_in_flight_at_sigterm_is_acked_not_redone() {
    let name = unique("inflight");
    let args = pubsub_args(&name);
    let cfg = args.config();
    let policy = SubscriptionPolicy {
        exactly_once: true,
        ..Default::default()
    };
    cfg.setup_with(Duration::from_secs(10), &policy)
        .await
        .unwrap();
    let db = fresh_pg_database().await;
    count_writes(&db).await;
    let (proxy, slow_db) = proxied_pg(&db).await;
    let n = 160;
    publish_lines(&cfg, &record_lines(&name, n)).await;

    let worker_flags = ["--exactly-once", "--batch-size", "16"];
    let mut a = WorkerProcess::start(&args, &slow_db, &worker_flags);
    wait_until(Duration::from_secs(120), "worker A to commit", || async {
        a.metric("spotinfer_records_committed_total")
            .await
            .unwrap_or(0.0)
            >= 16.0
    })
    .await;
    // From now on every reply takes 0.4 s: a commit (BEGIN, UPSERT, COMMIT) takes over a second,
    // and the signal below lands in the middle of one.
    proxy.set_latency(Duration::from_millis(400));
    tokio::time::sleep(Duration::from_millis(600)).await;
    a.signal(libc::SIGTERM);
    let (status, exit_time) = a.wait(Duration::from_secs(15));
    let (written_by_a, _) = writes(&db).await;
    eprintln!("A exited {status} {exit_time:?} after SIGTERM, having written {written_by_a}");
    assert!(status.success(), "graceful exit must be 0: {status}");

    let mut b = WorkerProcess::start(
        &args,
        &db,
        &[
            "--exactly-once",
            "--batch-size",
            "16",
            "--exit-when-idle",
            "4s",
        ],
    );
    let (status_b, _) = b.wait(Duration::from_secs(240));
    assert!(status_b.success());
    let (written, twice) = writes(&db).await;
    assert_eq!(written, n as i64, "every record committed");
    assert_eq!(
        twice, 0,
        "records committed twice: a commit in flight at SIGTERM was NACKed and redone"
    );
    assert_subscription_empty(&cfg, Duration::from_secs(2)).await;
}

/// Finding 4: a panicked stage ends the worker with a non-zero exit (a flex-start Job must not
/// count it as success), after NACKing what it held: a second worker that gives up after 4 s
/// without a message still gets every record, so none waited out a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicked_stage_exits_non_zero_after_nacking() {
    let name = unique("panic");
    let (args, cfg) = fresh_pubsub(&name).await;
    let (_dir, db) = fresh_sqlite();
    let n = 64;
    publish_lines(&cfg, &record_lines(&name, n)).await;
    for stage in ["source", "batcher", "embed", "sink"] {
        let mut w = WorkerProcess::start_with_env(
            &args,
            &db,
            &["--batch-size", "16"],
            &[("SPOTINFER_TEST_PANIC", stage.to_string())],
        );
        let (status, took) = w.wait(Duration::from_secs(60));
        eprintln!("panic in {stage}: {status} after {took:?}");
        assert_eq!(
            status.code(),
            Some(1),
            "a panic in the {stage} stage must exit 1"
        );
    }
    let mut b = WorkerProcess::start(&args, &db, &["--exit-when-idle", "4s"]);
    let (status, _) = b.wait(Duration::from_secs(120));
    assert!(status.success());
    let store = Store::connect(&db).await.unwrap();
    assert_eq!(store.embeddings().await.unwrap().len(), n, "nothing lost");
    assert_subscription_empty(&cfg, Duration::from_secs(2)).await;
}

/// Puts `text` at gs://inputs/doc.txt and the test model under gs://models/minilm in `data`.
fn gcs_objects(data: &std::path::Path, text: &str) {
    let put = |object: &str, bytes: &[u8]| {
        let path = data.join(object);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    };
    put("inputs/doc.txt", text.as_bytes());
    for f in MODEL_FILES {
        put(
            &format!("models/minilm/{f}"),
            &std::fs::read(model_dir().join(f)).unwrap(),
        );
    }
}

/// SIGTERMs `w` after `after` and asserts a 0 exit within `budget` (its --shutdown-timeout).
async fn sigterm_exits_0_within(
    w: &mut WorkerProcess,
    after: Duration,
    budget: Duration,
    what: &str,
) {
    tokio::time::sleep(after).await;
    w.signal(libc::SIGTERM);
    let (status, took) = w.wait(Duration::from_secs(30));
    eprintln!("SIGTERM during {what}: {status} after {took:?}");
    assert!(status.success(), "{what}: {status}");
    assert!(
        took < budget,
        "{what}: exit took {took:?}, budget {budget:?}"
    );
}

/// Finding 5: start-up gives way to SIGTERM. The worker waits for an unreachable database, then
/// downloads its model from Cloud Storage through a link that delays every chunk by a second,
/// then loads a local one: a SIGTERM in any of these steps ends it with 0 within
/// --shutdown-timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_start_up_exits_0_within_the_budget() {
    let name = unique("startup");
    let (args, _cfg) = fresh_pubsub(&name).await;
    let budget = Duration::from_secs(2);
    let flags = ["--shutdown-timeout", "2s"];

    let db = fresh_pg_database().await;
    let (pg_proxy, unreachable_db) = proxied_pg(&db).await;
    pg_proxy.cut();
    let mut w = WorkerProcess::start(&args, &unreachable_db, &flags);
    sigterm_exits_0_within(
        &mut w,
        Duration::from_millis(1500),
        budget,
        "the database wait",
    )
    .await;

    let data = tempfile::tempdir().unwrap();
    gcs_objects(data.path(), "unused");
    let gcs = FakeGcs::start(data.path());
    let slow = spotinfer_chaos::Proxy::start(gcs.host.clone())
        .await
        .unwrap();
    slow.set_latency(Duration::from_secs(1));
    let cache = tempfile::tempdir().unwrap();
    let mut w = WorkerProcess::start_with_env(
        &args,
        &db,
        &flags,
        &[
            ("SPOTINFER_MODEL", "gs://models/minilm".to_string()),
            ("STORAGE_EMULATOR_HOST", slow.addr().to_string()),
            ("SPOTINFER_CACHE_DIR", cache.path().display().to_string()),
        ],
    );
    sigterm_exits_0_within(&mut w, Duration::from_secs(3), budget, "the model download").await;

    // The load of a local model (about 3 s in a debug build: weights, bf16 check, tokenizer):
    // before, the process waited for the abandoned load to finish before it could exit.
    let mut w = WorkerProcess::start(&args, &db, &flags);
    sigterm_exits_0_within(&mut w, Duration::from_millis(500), budget, "the model load").await;
}

/// Finding 5: a `uri` record whose object answers slowly (20 s per chunk) holds the source; a
/// SIGTERM abandons the read, exits 0 within --shutdown-timeout and NACKs the message, which a
/// second worker then commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_slow_object_read_exits_0_within_the_budget() {
    let name = unique("slowread");
    let (args, cfg) = fresh_pubsub(&name).await;
    let (_dir, db) = fresh_sqlite();
    let data = tempfile::tempdir().unwrap();
    gcs_objects(data.path(), "a document stored in a bucket");
    let gcs = FakeGcs::start(data.path());
    let slow = spotinfer_chaos::Proxy::start(gcs.host.clone())
        .await
        .unwrap();
    let storage = [("STORAGE_EMULATOR_HOST", slow.addr().to_string())];
    publish_lines(
        &cfg,
        &[serde_json::json!({"id": "doc", "uri": "gs://inputs/doc.txt"}).to_string()],
    )
    .await;

    slow.set_latency(Duration::from_secs(20));
    let mut w = WorkerProcess::start_with_env(&args, &db, &["--shutdown-timeout", "3s"], &storage);
    wait_until(
        Duration::from_secs(60),
        "the worker to receive the record",
        || async {
            w.metric("spotinfer_messages_received_total")
                .await
                .unwrap_or(0.0)
                >= 1.0
        },
    )
    .await;
    sigterm_exits_0_within(
        &mut w,
        Duration::from_millis(500),
        Duration::from_secs(3),
        "an object read",
    )
    .await;

    slow.set_latency(Duration::ZERO);
    let mut b = WorkerProcess::start_with_env(&args, &db, &["--exit-when-idle", "3s"], &storage);
    let (status, _) = b.wait(Duration::from_secs(60));
    assert!(status.success());
    let rows = Store::connect(&db)
        .await
        .unwrap()
        .embeddings()
        .await
        .unwrap();
    assert!(
        rows.contains_key("doc"),
        "the NACKed record was committed by the next worker"
    );
}
