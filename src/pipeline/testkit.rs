//! What the pipeline's unit tests share: a [`Settle`] fake that records what each message was
//! told (the [`Ledger`]), deliveries that carry it, a SQLite store in a temporary directory and a
//! fixture model on its thread. The ledger is how the tests check the contract of
//! [`crate::pipeline::ack`]: every message ends in exactly one ack or one NACK, in the order the
//! contract says.

use crate::external::store::Store;
use crate::external::telemetry::Metrics;
use crate::model::{DeviceChoice, Embedder, LoadOptions, ModelHandle};
use crate::pipeline::ack::{Ack, NackHold, Settle};
use crate::pipeline::message::{Batch, Delivery, MessageMeta, Outcome};
use crate::shutdown::Shutdown;
use bytes::Bytes;
use futures::future::BoxFuture;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// What a message's handler was told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// `ack`.
    Ack,
    /// `nack`.
    Nack,
    /// `confirmed_ack`, confirmed.
    ConfirmedAck,
    /// `confirmed_ack`, not confirmed.
    Unconfirmed,
    /// Dropped without being told anything (the real client would NACK it on its own; the
    /// pipeline must never leave that to it).
    Unsettled,
}

/// Every call the fake handlers received, in order, with when.
#[derive(Debug, Clone, Default)]
pub struct Ledger(Arc<Mutex<Vec<(String, Call, Instant)>>>);

impl Ledger {
    fn record(&self, id: &str, call: Call) {
        self.0
            .lock()
            .unwrap()
            .push((id.to_string(), call, Instant::now()));
    }

    /// A handler for message `id`; `confirms` says whether its `confirmed_ack` is confirmed.
    pub fn handler(&self, id: &str, confirms: bool) -> Fake {
        Fake {
            id: id.to_string(),
            ledger: self.clone(),
            confirms,
            settled: false,
        }
    }

    /// The calls so far, in order.
    pub fn calls(&self) -> Vec<(String, Call)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|(id, c, _)| (id.clone(), *c))
            .collect()
    }

    /// The calls so far with their times.
    pub fn timed(&self) -> Vec<(String, Call, Instant)> {
        self.0.lock().unwrap().clone()
    }

    /// The ids told `call`, in the order they were.
    pub fn ids(&self, call: Call) -> Vec<String> {
        self.calls()
            .into_iter()
            .filter(|(_, c)| *c == call)
            .map(|(id, _)| id)
            .collect()
    }

    /// Each message's calls.
    pub fn by_message(&self) -> BTreeMap<String, Vec<Call>> {
        let mut m: BTreeMap<String, Vec<Call>> = BTreeMap::new();
        for (id, c) in self.calls() {
            m.entry(id).or_default().push(c);
        }
        m
    }

    /// Asserts that every message in `expected` was told exactly its call, once, and that no
    /// other message was told anything.
    #[track_caller]
    pub fn assert_settled(&self, expected: &[(&str, Call)]) {
        let want: BTreeMap<String, Vec<Call>> = expected
            .iter()
            .map(|(id, c)| (id.to_string(), vec![*c]))
            .collect();
        assert_eq!(
            self.by_message(),
            want,
            "calls in order: {:?}",
            self.calls()
        );
    }

    /// Waits (up to 10 s) until `n` calls have been recorded.
    pub async fn wait_for(&self, n: usize) {
        let started = std::time::Instant::now();
        while self.calls().len() < n {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "waited for {n} calls, have {:?}",
                self.calls()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A recording stand-in for the Pub/Sub client's handler of one message.
#[derive(Debug)]
pub struct Fake {
    id: String,
    ledger: Ledger,
    confirms: bool,
    settled: bool,
}

impl Settle for Fake {
    fn ack(mut self: Box<Self>) {
        self.settled = true;
        self.ledger.record(&self.id, Call::Ack);
    }

    fn nack(mut self: Box<Self>) {
        self.settled = true;
        self.ledger.record(&self.id, Call::Nack);
    }

    fn confirmed_ack(mut self: Box<Self>) -> BoxFuture<'static, Result<(), String>> {
        self.settled = true;
        let (call, result) = if self.confirms {
            (Call::ConfirmedAck, Ok(()))
        } else {
            (Call::Unconfirmed, Err("not confirmed".to_string()))
        };
        self.ledger.record(&self.id, call);
        Box::pin(async move {
            tokio::task::yield_now().await;
            result
        })
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        if !self.settled {
            self.ledger.record(&self.id, Call::Unsettled);
        }
    }
}

/// One test's worker state: the ledger, counters, the shutdown and its NACK hold.
#[derive(Debug, Clone)]
pub struct Kit {
    /// What the messages were told.
    pub ledger: Ledger,
    /// The counters the acks update.
    pub metrics: Arc<Metrics>,
    /// The worker's shutdown.
    pub shutdown: Shutdown,
    /// The hold on that shutdown.
    pub hold: NackHold,
}

impl Kit {
    /// A fresh kit.
    pub fn new() -> Self {
        let shutdown = Shutdown::new();
        Self {
            ledger: Ledger::default(),
            metrics: Metrics::new(),
            hold: NackHold::new(shutdown.clone()),
            shutdown,
        }
    }

    /// The ack of message `id`.
    pub fn ack(&self, id: &str) -> Ack {
        Ack::new(
            self.ledger.handler(id, true),
            self.metrics.clone(),
            self.hold.clone(),
        )
    }

    /// The ack of message `id`, whose exactly-once confirmation fails.
    pub fn unconfirmed_ack(&self, id: &str) -> Ack {
        Ack::new(
            self.ledger.handler(id, false),
            self.metrics.clone(),
            self.hold.clone(),
        )
    }

    /// Message `id` carrying `data`, parsed as the source parses it.
    pub fn delivery(&self, id: &str, data: &str) -> Delivery {
        self.delivery_with(id, data, self.ack(id))
    }

    /// [`Kit::delivery`] with `ack`.
    pub fn delivery_with(&self, id: &str, data: &str, ack: Ack) -> Delivery {
        Delivery {
            meta: MessageMeta {
                message_id: id.to_string(),
                publish_time_us: 1,
                delivery_attempt: 1,
            },
            payload: crate::record::parse(data.as_bytes(), 1 << 20),
            data: Bytes::from(data.to_string()),
            ack,
        }
    }

    /// Message `id`: a record with id `id` and `text`.
    pub fn record(&self, id: &str, text: &str) -> Delivery {
        self.delivery(id, &serde_json::json!({"id": id, "text": text}).to_string())
    }

    /// Message `id`: a record with id `id`, `text` and the model prompt `prompt`.
    pub fn prompted(&self, id: &str, text: &str, prompt: &str) -> Delivery {
        let data = serde_json::json!({"id": id, "text": text, "prompt_name": prompt});
        self.delivery(id, &data.to_string())
    }

    /// Message `id` with a payload that is not a record.
    pub fn invalid(&self, id: &str) -> Delivery {
        self.delivery(id, "not json")
    }

    /// A batch of `deliveries`, as the batcher makes one.
    pub fn batch(&self, deliveries: impl IntoIterator<Item = Delivery>) -> Batch {
        let mut batch = Batch::default();
        for d in deliveries {
            batch.push(d);
        }
        batch
    }

    /// An outcome as the model stage makes one: a record (with a vector) per id of `done`, an
    /// invalid payload per id of `rejected`.
    pub fn outcome(&self, done: &[&str], rejected: &[&str]) -> Outcome {
        let batch = self.batch(
            done.iter()
                .map(|id| self.record(id, "some text"))
                .chain(rejected.iter().map(|id| self.invalid(id))),
        );
        Outcome {
            done: batch
                .records
                .into_iter()
                .map(|p| (p, vec![0.6, 0.8]))
                .collect(),
            rejected: batch.rejected,
        }
    }
}

/// A migrated SQLite store in a temporary directory (kept alive by the returned guard).
pub async fn sqlite() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("test.db").display());
    let store = Store::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    (dir, store)
}

/// Runs `sql` on a SQLite store.
pub async fn execute(store: &Store, sql: &str) {
    let Store::Sqlite(pool) = store else {
        unreachable!("a SQLite store")
    };
    sqlx::raw_sql(sql).execute(pool).await.unwrap();
}

/// The fixture model `name` (tests/fixtures/models, a tiny random-weight encoder that loads in
/// milliseconds) on the CPU, with an optional lower token limit.
pub fn embedder(name: &str, max_seq_len: Option<usize>) -> Embedder {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name);
    let options = LoadOptions {
        max_seq_len,
        ..LoadOptions::new(DeviceChoice::Cpu)
    };
    Embedder::open(&dir, &options).unwrap()
}

/// [`embedder`] on its model thread.
pub fn model(name: &str, max_seq_len: Option<usize>) -> ModelHandle {
    ModelHandle::spawn(embedder(name, max_seq_len)).unwrap()
}
