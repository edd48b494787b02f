//! What the pipeline's unit tests share: a [`Settle`] fake that records what each message was
//! told (the [`Ledger`]), deliveries that carry it, a SQLite store in a temporary directory and a
//! fixture model on its thread. The ledger is how the tests check the contract of
//! [`crate::pipeline::ack`]: every message ends in exactly one ack or one NACK, in the order the
//! contract says.

use crate::external::store::Store;
use crate::external::telemetry::Metrics;
use crate::model::Served;
use crate::model::{DeviceChoice, LoadOptions, ModelHandle, Output, TextModel};
use crate::pipeline::ack::{Ack, LeaseLoop, NackHold, Settle};
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
    /// A lease loop was shut down (recorded under the loop's name).
    LeaseShutDown,
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

    /// A lease loop named `id` that records its shutdown here.
    pub fn lease(&self, id: &str) -> FakeLease {
        FakeLease {
            id: id.to_string(),
            ledger: self.clone(),
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

/// A stand-in for a stream's lease loop.
#[derive(Debug)]
pub struct FakeLease {
    id: String,
    ledger: Ledger,
}

impl LeaseLoop for FakeLease {
    fn shut_down(&self) -> BoxFuture<'_, ()> {
        self.ledger.record(&self.id, Call::LeaseShutDown);
        Box::pin(async {})
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

    /// An outcome as the infer stage makes one: a record (with a vector) per id of `done`, an
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
                .map(|p| (p, Output::Embedding(vec![0.6, 0.8])))
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

/// The fixture model the tests embed with: a tiny random-weight BERT (mean pooling, f32
/// weights) that loads in milliseconds.
const FIXTURE_MODEL: &str = "bert-mean-old";

fn fixture_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(FIXTURE_MODEL)
}

/// The fixture model on its thread, on the CPU.
pub fn model() -> Served {
    let text_model = TextModel::open(&fixture_dir(), &LoadOptions::new(DeviceChoice::Cpu)).unwrap();
    served(spawn(text_model, None))
}

/// A text model's thread beside its task, as the worker's factory serves it.
fn served(handle: ModelHandle) -> Served {
    let running =
        crate::model::load::Running::without_interrupt(crate::model::load::ModelKind::Text, handle);
    let serving = crate::model::load::Serving {
        max_image_pixels: 0,
        checkpoints: None,
    };
    crate::model::load::serve(running, serving).expect("a text model is served")
}

/// The fixture model on its thread, failing its first `faults` batches (`None`: every batch)
/// with a device fault ([`crate::model::ModelError::Device`], not the input's).
pub fn faulty_model(faults: Option<u64>) -> Served {
    let text_model = TextModel::open(&fixture_dir(), &LoadOptions::new(DeviceChoice::Cpu)).unwrap();
    served(spawn(
        text_model,
        Some(faults.map_or("always".into(), |n| n.to_string())),
    ))
}

/// Spawns the model thread with `SPOTINFER_TEST_DEVICE_FAULT` set to `faults` (unset: none).
///
/// The model thread reads that variable once, as it starts (`model/thread.rs`), so the variable
/// is set around the spawn and its first batch, one lock for every model thread the tests
/// start: a thread started beside it never sees another's faults. The first batch, spent
/// here, is one more fault when faults are asked for.
fn spawn(text_model: TextModel, faults: Option<String>) -> ModelHandle {
    static ENV: Mutex<()> = Mutex::new(());
    const VAR: &str = "SPOTINFER_TEST_DEVICE_FAULT";
    let _env = ENV
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let faults = faults.map(|f| match f.parse::<u64>() {
        Ok(n) => (n + 1).to_string(),
        Err(_) => f,
    });
    match &faults {
        Some(f) => std::env::set_var(VAR, f),
        None => std::env::remove_var(VAR),
    }
    let model = ModelHandle::spawn(text_model).unwrap();
    // Blocks this thread for one tiny batch: once it is back, the thread has read the variable.
    let first = futures::executor::block_on(
        model.predict(vec![crate::model::Text::from("warm up".to_string())]),
    );
    std::env::remove_var(VAR);
    assert_eq!(
        first.is_err(),
        faults.is_some(),
        "the first batch shows whether faults were injected: {first:?}"
    );
    model
}

/// A copy of the fixture model whose embedding row for `word` is NaN, on its thread: a text
/// holding that word makes the model compute a NaN vector, which it refuses
/// ([`crate::model::ModelError::NonFinite`], an error the input is to blame for); the others
/// embed as usual. The directory must outlive the model's loading only.
pub fn poisoned_model(word: &str) -> Served {
    let src = fixture_dir();
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "model.safetensors" {
            std::os::unix::fs::symlink(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    let tokenizer = tokenizers::Tokenizer::from_file(src.join("tokenizer.json")).unwrap();
    let id = tokenizer
        .token_to_id(word)
        .expect("a word of the vocabulary") as usize;
    let mut bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let t = &header["embeddings.word_embeddings.weight"];
    assert_eq!(t["dtype"], "F32");
    let dim = t["shape"][1].as_u64().unwrap() as usize;
    let start = 8 + header_len + t["data_offsets"][0].as_u64().unwrap() as usize + id * dim * 4;
    for x in bytes[start..start + dim * 4].chunks_mut(4) {
        x.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    let text_model = TextModel::open(dir.path(), &LoadOptions::new(DeviceChoice::Cpu)).unwrap();
    served(spawn(text_model, None))
}

/// The fixture model, panicking on every batch that holds a text containing `word` (a bug
/// some input meets), on its thread; the other batches embed as usual.
pub fn panicking_model(word: &str) -> Served {
    struct Panicking(TextModel, String);
    impl crate::model::Predict for Panicking {
        fn info(&self) -> &crate::model::ModelInfo {
            self.0.info()
        }
        fn predict_items(
            &self,
            items: &[crate::model::Item],
        ) -> Result<crate::model::Predicted, crate::model::ModelError> {
            let poisoned = items
                .iter()
                .any(|i| matches!(i, crate::model::Item::Text(t) if t.text.contains(&self.1)));
            assert!(!poisoned, "a bug this input meets");
            self.0.predict_items(items)
        }
    }
    let text_model = TextModel::open(&fixture_dir(), &LoadOptions::new(DeviceChoice::Cpu)).unwrap();
    served(ModelHandle::spawn(Panicking(text_model, word.to_string())).unwrap())
}
