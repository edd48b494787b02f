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
            f.load(Ordering::SeqCst).then(|| "TRUE".to_string())
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
