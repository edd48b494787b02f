//! Exactly-once subscriptions and dead-letter policies, against the real emulator.

mod common;

use common::*;
use spotinfer::config::{DeviceChoice, SubscriptionPolicyArgs};
use spotinfer::external::pubsub::PubsubConfig;
use spotinfer::external::store::Store;
use spotinfer::external::telemetry::Metrics;
use spotinfer::model::{Embedder, ModelHandle};
use spotinfer::pipeline::batcher::BatchConfig;
use spotinfer::pipeline::window::Window;
use spotinfer::pipeline::worker::{self, WorkerConfig, WorkerError};
use spotinfer::shutdown::Shutdown;
use std::time::{Duration, Instant};

fn config(cfg: PubsubConfig, exactly_once: bool) -> WorkerConfig {
    WorkerConfig {
        batch: BatchConfig {
            max_records: 16,
            max_wait: Duration::from_millis(20),
            window: 64,
        },
        exit_when_idle: Some(Duration::from_secs(4)),
        exactly_once,
        ..worker_config(cfg)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_subscription_with_confirmed_acks() {
    let name = unique("eo");
    let args = pubsub_args(&name);
    let cfg = PubsubConfig::from_args(&args);
    let policy = SubscriptionPolicyArgs {
        exactly_once: true,
        max_delivery_attempts: 10,
        max_retry_backoff: Duration::from_secs(60),
        ..Default::default()
    };
    cfg.setup_with(Duration::from_secs(10), &policy)
        .await
        .unwrap();
    assert!(cfg.exactly_once_enabled().await.unwrap());
    let n = 40;
    publish_lines(&cfg, &record_lines(&name, n)).await;

    let (_dir, db) = fresh_sqlite();
    let store = Store::connect(&db).await.unwrap();
    store.migrate().await.unwrap();
    let model =
        ModelHandle::spawn(Embedder::load(&model_dir(), DeviceChoice::Cpu).unwrap()).unwrap();
    let report = worker::run(
        config(cfg.clone(), true),
        store.clone(),
        model,
        Metrics::new(),
        Shutdown::new(),
    )
    .await
    .unwrap();
    assert_eq!(store.status(None).await.unwrap().done, n as i64);
    assert!(
        report.counts.acked >= n as u64,
        "confirmed acks: {report:?}"
    );
    assert_eq!(report.counts.nacked, 0, "{report:?}");
    assert_subscription_empty(&cfg, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_flag_refuses_an_at_least_once_subscription() {
    let name = unique("eo-no");
    let (_, cfg) = fresh_pubsub(&name).await;
    let (_dir, db) = fresh_sqlite();
    let store = Store::connect(&db).await.unwrap();
    store.migrate().await.unwrap();
    let model =
        ModelHandle::spawn(Embedder::load(&model_dir(), DeviceChoice::Cpu).unwrap()).unwrap();
    let err = worker::run(
        config(cfg, true),
        store,
        model,
        Metrics::new(),
        Shutdown::new(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, WorkerError::NotExactlyOnce(_)), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_policy_moves_a_message_nacked_too_often() {
    let name = unique("dlq");
    let args = pubsub_args(&name);
    let cfg = PubsubConfig::from_args(&args);
    let policy = SubscriptionPolicyArgs {
        dead_letter_topic: Some(format!("dlq-{name}")),
        max_delivery_attempts: 5,
        max_retry_backoff: Duration::from_secs(60),
        ..Default::default()
    };
    cfg.setup_with(Duration::from_secs(10), &policy)
        .await
        .unwrap();
    publish_raw(&cfg, vec![b"always fails".to_vec()]).await;

    // NACK every delivery until the message stops coming back.
    let sub = cfg.subscriber(1).await.unwrap();
    let mut stream = sub.subscribe(&cfg.subscription).build();
    let mut attempts = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        match tokio::time::timeout(Duration::from_secs(3), stream.next()).await {
            Ok(Some(Ok((_, h)))) => {
                attempts.push(h.delivery_attempt());
                h.nack();
            }
            _ => break,
        }
    }
    stream.shutdown_token().shutdown().await;
    assert_eq!(
        attempts.len(),
        5,
        "deliveries before dead-lettering: {attempts:?}"
    );
    assert_eq!(attempts.last().copied().flatten(), Some(5));

    let dlq = PubsubConfig::from_args(&spotinfer::config::PubsubArgs {
        subscription: format!("dlq-{name}-sub"),
        ..args
    });
    let sub = dlq.subscriber(1).await.unwrap();
    let mut stream = sub.subscribe(&dlq.subscription).build();
    let (m, h) = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("dead-lettered message")
        .unwrap()
        .unwrap();
    h.ack();
    assert_eq!(&m.data[..], b"always fails");
    stream.shutdown_token().shutdown().await;
}

/// Finding 2: what a stopping worker hands back (NACKs unprocessed; each one a delivery attempt
/// towards the dead-letter limit) is counted apart from failure NACKs, and the next worker takes
/// handed-back messages before first deliveries. Commits are slowed (PostgreSQL replies 0.3 s
/// late) so the worker holds many messages at the SIGTERM. (The emulator ignores streaming-pull
/// flow control, so here the worker holds whatever the emulator pushed; on Pub/Sub the window,
/// [`Window`], bounds it. `window.rs` tests the sizing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_worker_hands_back_what_it_holds_counted_apart_from_failures() {
    let name = unique("handback");
    let args = pubsub_args(&name);
    let cfg = PubsubConfig::from_args(&args);
    let policy = SubscriptionPolicyArgs {
        dead_letter_topic: Some(format!("dlq-{name}")),
        max_delivery_attempts: 5,
        max_retry_backoff: Duration::from_secs(60),
        ..Default::default()
    };
    cfg.setup_with(Duration::from_secs(10), &policy)
        .await
        .unwrap();
    let n = 600;
    publish_lines(&cfg, &record_lines(&name, n)).await;
    let db = fresh_pg_database().await;
    let (proxy, slow_db) = proxied_pg(&db).await;
    let store = Store::connect(&slow_db).await.unwrap();
    store.migrate().await.unwrap();
    proxy.set_latency(Duration::from_millis(300));
    let model =
        ModelHandle::spawn(Embedder::load(&model_dir(), DeviceChoice::Cpu).unwrap()).unwrap();
    let worker_cfg = |idle| WorkerConfig {
        window: Window::fixed(64, 1),
        batch: BatchConfig {
            max_records: 16,
            max_wait: Duration::from_millis(20),
            window: 64,
        },
        exit_when_idle: idle,
        ..worker_config(cfg.clone())
    };
    let metrics = Metrics::new();
    let shutdown = Shutdown::new();
    let run = tokio::spawn(worker::run(
        worker_cfg(None),
        store.clone(),
        model.clone(),
        metrics.clone(),
        shutdown.clone(),
    ));
    wait_until(Duration::from_secs(60), "a first commit", || async {
        metrics.counts().committed > 0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    shutdown.cancel();
    let a = run.await.unwrap().unwrap().counts;
    eprintln!("stopped worker: {a:?}");
    assert!(a.released > 0, "{a:?}");
    assert_eq!(a.nacked, 0, "hand-backs are not failure NACKs: {a:?}");
    assert_eq!(
        a.released + a.acked,
        a.received,
        "every message settled: {a:?}"
    );

    // The next worker (fast database) sees them again, as second deliveries, and does them all.
    proxy.set_latency(Duration::ZERO);
    let metrics = Metrics::new();
    let b = worker::run(
        worker_cfg(Some(Duration::from_secs(3))),
        Store::connect(&db).await.unwrap(),
        model,
        metrics.clone(),
        Shutdown::new(),
    )
    .await
    .unwrap();
    let store = Store::connect(&db).await.unwrap();
    assert_eq!(store.status(None).await.unwrap().done, n as i64);
    let exposition = metrics.render();
    let bucket = |le: &str| {
        let key = format!("spotinfer_delivery_attempt_bucket{{le=\"{le}\"}}");
        exposition
            .lines()
            .find(|l| l.starts_with(&key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let second = bucket("2.0") - bucket("1.0");
    assert!(
        second >= a.released,
        "handed-back messages come back as second deliveries: {second} of {}\n{exposition}",
        a.released
    );
    assert_eq!(b.counts.nacked + b.counts.released, 0, "{b:?}");
    assert_subscription_empty(&cfg, Duration::from_secs(2)).await;
}
