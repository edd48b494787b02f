//! Exactly-once subscriptions and dead-letter policies, against the real emulator.

mod common;

use common::*;
use spotinfer::config::{DeviceChoice, SubscriptionPolicyArgs};
use spotinfer::external::pubsub::PubsubConfig;
use spotinfer::external::store::Store;
use spotinfer::external::telemetry::Metrics;
use spotinfer::model::{Embedder, ModelHandle};
use spotinfer::pipeline::batcher::BatchConfig;
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
