//! Early drain against small fake servers: a Compute Engine metadata server that announces a
//! preemption, and a Kubernetes API that taints the node. The worker must stop pulling, NACK what
//! it holds, stay up but not ready, and exit 0 at once on the SIGTERM that follows.

mod common;

use common::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A fake HTTP server: `respond(path, headers)` returns a body, or None to hold the request
/// open (a long poll with no change yet, re-checked every 50 ms).
async fn serve<F>(respond: F) -> String
where
    F: Fn(&str, &str) -> Option<String> + Send + Sync + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let respond = Arc::new(respond);
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                continue;
            };
            let respond = respond.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let n = sock.read(&mut buf).await.unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]).to_string();
                let path = req.split_whitespace().nth(1).unwrap_or("/").to_string();
                let body = loop {
                    if let Some(b) = respond(&path, &req) {
                        break b;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\netag: e1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    });
    addr
}

/// A Kubernetes API serving node `n1`, tainted for termination while `tainted` is set.
async fn node_api(tainted: Arc<AtomicBool>) -> String {
    serve(move |_, _| {
        let taint = if tainted.load(Ordering::SeqCst) {
            r#",{"key":"cloud.google.com/impending-node-termination","effect":"NoSchedule"}"#
        } else {
            ""
        };
        Some(format!(
            r#"{{"metadata":{{"name":"n1"}},"spec":{{"taints":[{{"key":"cloud.google.com/gke-spot","value":"true","effect":"NoSchedule"}}{taint}]}}}}"#
        ))
    })
    .await
}

async fn drains_early(extra_env: &[(&str, String)], flip: Arc<AtomicBool>, name: &str) {
    let (args, cfg) = fresh_pubsub(name).await;
    let (_dir, db) = fresh_sqlite();
    let n = 200;
    publish_lines(&cfg, &record_lines(name, n)).await;

    let mut a = WorkerProcess::start_with_env(&args, &db, &["--batch-size", "8"], extra_env);
    wait_until(Duration::from_secs(120), "worker A to commit", || async {
        a.metric("spotinfer_records_committed_total")
            .await
            .unwrap_or(0.0)
            >= 16.0
    })
    .await;
    assert!(a.ready().await);
    flip.store(true, Ordering::SeqCst);
    let flipped = Instant::now();
    wait_until(Duration::from_secs(10), "worker A to drain", || async {
        !a.ready().await
    })
    .await;
    let drain_seen = flipped.elapsed();
    // Drained: nothing in flight, and no more pulling.
    wait_until(
        Duration::from_secs(10),
        "in-flight messages to be nacked",
        || async { a.metric("spotinfer_in_flight_messages").await == Some(0.0) },
    )
    .await;
    let received = a.metric("spotinfer_messages_received_total").await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        a.metric("spotinfer_messages_received_total").await.unwrap(),
        received,
        "still pulling after the drain"
    );
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "the worker must stay up until SIGTERM"
    );
    eprintln!("early drain: not ready {drain_seen:?} after the notice");

    a.signal(libc::SIGTERM);
    let (status, exit) = a.wait(Duration::from_secs(5));
    assert!(status.success(), "{status}");
    assert!(exit < Duration::from_secs(2), "exit took {exit:?}");

    // Everything it held went back: a second worker finishes the job.
    let mut b = WorkerProcess::start(&args, &db, &["--exit-when-idle", "4s"]);
    assert!(b.wait(Duration::from_secs(240)).0.success());
    let store = spotinfer::external::store::Store::connect(&db)
        .await
        .unwrap();
    assert_eq!(store.status(None).await.unwrap().done, n as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_preemption_notice_drains_the_worker() {
    let flip = Arc::new(AtomicBool::new(false));
    let missing_flavor = Arc::new(AtomicUsize::new(0));
    let (f, mf) = (flip.clone(), missing_flavor.clone());
    let host = serve(move |path, req| {
        if !req.to_ascii_lowercase().contains("metadata-flavor: google") {
            mf.fetch_add(1, Ordering::SeqCst);
        }
        if path.starts_with("/computeMetadata/v1/instance/preempted") {
            // A long poll that already saw the value (last_etag) waits for a change: none.
            (f.load(Ordering::SeqCst) && !path.contains("last_etag")).then(|| "TRUE".to_string())
        } else {
            None // maintenance-event: no change, ever
        }
    })
    .await;
    drains_early(
        &[
            ("SPOTINFER_EARLY_DRAIN", "metadata".into()),
            ("GCE_METADATA_HOST", host),
        ],
        flip,
        &unique("drain-md"),
    )
    .await;
    assert_eq!(
        missing_flavor.load(Ordering::SeqCst),
        0,
        "requests without Metadata-Flavor: Google"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_termination_taint_drains_the_worker() {
    let flip = Arc::new(AtomicBool::new(false));
    let f = flip.clone();
    let host = serve(move |path, _| {
        assert_eq!(path, "/api/v1/nodes/spot-node-1");
        let taints = if f.load(Ordering::SeqCst) {
            r#"[{"key":"cloud.google.com/gke-spot","value":"true","effect":"NoSchedule"},{"key":"cloud.google.com/impending-node-termination","effect":"NoSchedule"}]"#
        } else {
            r#"[{"key":"cloud.google.com/gke-spot","value":"true","effect":"NoSchedule"}]"#
        };
        Some(format!(r#"{{"metadata":{{"name":"spot-node-1"}},"spec":{{"taints":{taints}}}}}"#))
    })
    .await;
    drains_early(
        &[
            ("SPOTINFER_EARLY_DRAIN", "taint".into()),
            ("SPOTINFER_KUBE_API", format!("http://{host}")),
            ("NODE_NAME", "spot-node-1".into()),
            ("SPOTINFER_DRAIN_POLL", "200ms".into()),
        ],
        flip,
        &unique("drain-taint"),
    )
    .await;
}

/// Finding 9: a notice that clears without a SIGTERM (the taint removed) resumes pulling: the
/// worker drains, becomes ready again and finishes the job by itself. Before, it stayed drained
/// until a SIGTERM that never came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notice_that_clears_resumes_pulling() {
    let tainted = Arc::new(AtomicBool::new(false));
    let host = node_api(tainted.clone()).await;
    let name = unique("drain-resume");
    let (args, cfg) = fresh_pubsub(&name).await;
    let (_dir, db) = fresh_sqlite();
    let n = 300;
    publish_lines(&cfg, &record_lines(&name, n)).await;
    let env = [
        ("SPOTINFER_EARLY_DRAIN", "taint".to_string()),
        ("SPOTINFER_KUBE_API", format!("http://{host}")),
        ("NODE_NAME", "n1".to_string()),
        ("SPOTINFER_DRAIN_POLL", "100ms".to_string()),
    ];
    let mut a = WorkerProcess::start_with_env(
        &args,
        &db,
        &["--batch-size", "8", "--exit-when-idle", "3s"],
        &env,
    );
    let committed = || async {
        a.metric("spotinfer_records_committed_total")
            .await
            .unwrap_or(0.0)
    };
    wait_until(Duration::from_secs(120), "a first commit", || async {
        committed().await >= 8.0
    })
    .await;
    tainted.store(true, Ordering::SeqCst);
    wait_until(Duration::from_secs(10), "the drain", || async {
        !a.ready().await
    })
    .await;
    // Readiness goes first; the drain then finishes the commit in flight and hands the rest
    // back. Once the rest is handed back, nothing more may commit.
    wait_until(Duration::from_secs(10), "the rest handed back", || async {
        a.metric("spotinfer_messages_released_on_shutdown_total")
            .await
            .unwrap_or(0.0)
            > 0.0
    })
    .await;
    let during = committed().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(committed().await, during, "still working while drained");
    assert!(
        during < n as f64,
        "the job must not be done before the drain"
    );

    tainted.store(false, Ordering::SeqCst);
    wait_until(Duration::from_secs(10), "ready again", || async {
        a.ready().await
    })
    .await;
    // It finishes the job and exits by itself once idle. Messages the server had pushed into the
    // closed stream after it was read out come back only when their lease (10 s) runs out: the
    // idle clock waits for that (before, under load, the worker exited 16 records short).
    let (status, _) = a.wait(Duration::from_secs(240));
    assert!(status.success(), "{status}");
    let store = spotinfer::external::store::Store::connect(&db)
        .await
        .unwrap();
    assert_eq!(store.status(None).await.unwrap().done, n as i64);
}

/// Finding 9: a live migration keeps the VM: `MIGRATE_ON_HOST_MAINTENANCE` must not drain the
/// worker (before, any value other than NONE did); `TERMINATE_ON_HOST_MAINTENANCE` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_migration_does_not_drain_but_terminating_maintenance_does() {
    let event = Arc::new(std::sync::Mutex::new(
        "MIGRATE_ON_HOST_MAINTENANCE".to_string(),
    ));
    let served = Arc::new(std::sync::Mutex::new(String::new()));
    let (e, s) = (event.clone(), served.clone());
    let host = serve(move |path, _| {
        if !path.starts_with("/computeMetadata/v1/instance/maintenance-event") {
            return None; // preempted: no change
        }
        // A long poll answers when the value differs from what this client last saw.
        let now = e.lock().unwrap().clone();
        let mut last = s.lock().unwrap();
        (*last != now).then(|| {
            *last = now.clone();
            now
        })
    })
    .await;
    let name = unique("drain-migrate");
    let (args, cfg) = fresh_pubsub(&name).await;
    let (_dir, db) = fresh_sqlite();
    publish_lines(&cfg, &record_lines(&name, 100)).await;
    let env = [
        ("SPOTINFER_EARLY_DRAIN", "metadata".to_string()),
        ("GCE_METADATA_HOST", host),
    ];
    let mut a = WorkerProcess::start_with_env(&args, &db, &["--batch-size", "8"], &env);
    wait_until(Duration::from_secs(120), "every record", || async {
        a.metric("spotinfer_records_committed_total")
            .await
            .unwrap_or(0.0)
            >= 100.0
    })
    .await;
    assert!(!served.lock().unwrap().is_empty(), "the event was read");
    assert!(
        a.ready().await,
        "a live migration must not drain the worker"
    );

    *event.lock().unwrap() = "TERMINATE_ON_HOST_MAINTENANCE".to_string();
    wait_until(Duration::from_secs(10), "the drain", || async {
        !a.ready().await
    })
    .await;
    a.signal(libc::SIGTERM);
    assert!(a.wait(Duration::from_secs(5)).0.success());
}

/// Issue 40: an early drain checkpoints the generations it stops, as a SIGTERM does. Before, the
/// decode loop's interrupt was set by the process's shutdown alone: a drain waited its grace out
/// and handed the records back without their tokens (and the loop decoded on for nobody). Here
/// the notice comes mid-answer, the checkpoints are saved while the worker waits drained, and
/// once the notice clears the worker resumes from them: every answer equals the uninterrupted
/// one, and no checkpoint is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_drain_checkpoints_the_generations_it_stops() {
    let gguf = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    let tainted = Arc::new(AtomicBool::new(false));
    let host = node_api(tainted.clone()).await;
    let name = unique("drain-generate");
    let (args, cfg) = fresh_pubsub(&name).await;
    let (_dir, db) = fresh_sqlite();
    let topics = ["the sea", "a mountain", "a city at night", "an old library"];
    let records: Vec<serde_json::Value> = topics
        .iter()
        .enumerate()
        .map(|(i, topic)| {
            serde_json::json!({"id": format!("g{i}"), "max_new_tokens": 400,
                "messages": [{"role": "user", "content": format!("Write a long, detailed story about {topic}.")}]})
        })
        .collect();
    let lines: Vec<String> = records.iter().map(|r| r.to_string()).collect();
    publish_lines(&cfg, &lines).await;
    let env = [
        ("SPOTINFER_EARLY_DRAIN", "taint".to_string()),
        ("SPOTINFER_KUBE_API", format!("http://{host}")),
        ("NODE_NAME", "n1".to_string()),
        ("SPOTINFER_DRAIN_POLL", "100ms".to_string()),
        ("SPOTINFER_MODEL", gguf.display().to_string()),
    ];
    let mut a = WorkerProcess::start_with_env(
        &args,
        &db,
        &["--batch-size", "4", "--exit-when-idle", "3s"],
        &env,
    );
    wait_until(
        Duration::from_secs(120),
        "the records to reach the model",
        || async {
            a.metric("spotinfer_messages_received_total")
                .await
                .unwrap_or(0.0)
                >= topics.len() as f64
        },
    )
    .await;
    // Some tokens written (a step of four takes tens of milliseconds, even beside the other
    // tests), none of the answers near its end (400 tokens: half a minute here).
    tokio::time::sleep(Duration::from_secs(3)).await;
    tainted.store(true, Ordering::SeqCst);
    wait_until(Duration::from_secs(10), "the rest handed back", || async {
        a.metric("spotinfer_messages_released_on_shutdown_total")
            .await
            .unwrap_or(0.0)
            > 0.0
    })
    .await;
    let store = spotinfer::external::store::Store::connect(&db)
        .await
        .unwrap();
    let saved = store.checkpoint_count().await.unwrap();
    assert!(saved > 0, "the drain saved no checkpoint");
    tainted.store(false, Ordering::SeqCst);
    let (status, _) = a.wait(Duration::from_secs(300));
    assert!(status.success(), "{status}");
    assert_eq!(store.status(None).await.unwrap().done, topics.len() as i64);
    assert_eq!(
        store.checkpoint_count().await.unwrap(),
        0,
        "checkpoints left"
    );
    // Every answer, resumed or not, is the uninterrupted one.
    let want = uninterrupted_completions(&gguf, &records);
    let spotinfer::external::store::Store::Sqlite(pool) = &store else {
        unreachable!()
    };
    for (r, w) in records.iter().zip(want) {
        let got: String = sqlx::query_scalar("SELECT text FROM embeddings WHERE record_id = ?1")
            .bind(r["id"].as_str().unwrap())
            .fetch_one(pool)
            .await
            .unwrap();
        assert_eq!(got, w.text, "{}", r["id"]);
    }
    eprintln!("early drain of a generation: {saved} checkpoints saved and resumed");
}
