//! The model thread: a loaded model on a dedicated OS thread behind a channel, so a batch that
//! computes for seconds never stalls the async runtime that keeps Pub/Sub leases, acks and nacks
//! flowing. Text models ([`TextModel`]) and image models (`tasks::image::ImageTask`) sit behind one
//! trait, [`Predict`], so the pipeline never asks which it has. A model that prepares its inputs
//! off the thread ([`Prepare`]: a text model's tokenizer) has each batch prepared as it is queued,
//! on blocking threads, while the model computes the batch before it.

use super::item::{Item, Prepare};
use super::types::{ModelError, ModelInfo, Predicted};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// What the model thread runs: a loaded model of any kind.
pub trait Predict: Send {
    /// What the model is and reads.
    fn info(&self) -> &ModelInfo;
    /// Computes the model's task for a batch, results in input order. An item the model does
    /// not read (an image to a text model) fails the batch as the input's fault
    /// ([`ModelError::Input`]); the pipeline refuses such records before they get here.
    fn predict_items(&self, items: &[Item]) -> Result<Predicted, ModelError>;
    /// The model as one whose batches join while others compute (a generation model's decode
    /// loop); none for a model that computes a batch at a time.
    fn joining(&mut self) -> Option<&mut dyn Joining> {
        None
    }
    /// What prepares this model's batches before they queue (see [`Prepare`]); none: the model
    /// thread takes the items as they come.
    fn preparer(&self) -> Option<Arc<dyn Prepare>> {
        None
    }
}

/// A model that takes new batches while it computes: the model thread admits each batch as it
/// arrives and answers each when it is done, so a generation batch's short answers do not wait
/// for a batch before it, and its last long answer runs beside the next batch's.
pub trait Joining {
    /// Takes a batch under `job`; its results come from a later [`Joining::step`]. An error:
    /// the batch cannot be taken at all (an item the model does not read).
    fn admit(&mut self, job: u64, items: &[Item]) -> Result<(), ModelError>;
    /// Computes one step of every admitted batch; returns the batches now done.
    fn step(&mut self) -> Vec<(u64, Result<Predicted, ModelError>)>;
    /// Whether no admitted batch is left.
    fn idle(&self) -> bool;
    /// Forgets every admitted batch (after a panic left their state unknown).
    fn reset(&mut self);
    /// Forgets the admitted batch `job`, whose results nobody waits for any more (its pipeline
    /// was drained), so its sequences stop taking the model's time and cache.
    fn forget(&mut self, job: u64);
}

struct Job {
    items: Vec<Item>,
    reply: oneshot::Sender<Result<Predicted, ModelError>>,
}

/// Reloads the model from its files: how the model thread rebuilds itself after a device
/// fault. Its error is only logged (the thread then keeps the model it has).
pub type Reload = Box<dyn Fn() -> Result<Box<dyn Predict>, String> + Send>;

/// A handle to the model thread. Cheap to clone; the thread stops when every handle is dropped.
#[derive(Clone)]
pub struct ModelHandle {
    tx: mpsc::Sender<Job>,
    info: ModelInfo,
    prep: Option<Arc<dyn Prepare>>,
}

impl ModelHandle {
    /// Moves `model` onto a new thread named `model` and returns a handle to it.
    pub fn spawn(model: impl Predict + 'static) -> std::io::Result<Self> {
        Self::spawn_with_reload(Box::new(model), None)
    }

    /// [`ModelHandle::spawn`], and after a batch fails for a reason that is not its input's
    /// ([`ModelError::blames_input`]: a panic that may have left the encoder's buffers half
    /// written, a device error), the thread replaces its model by `reload`'s before the next
    /// batch, so a retry does not run on the state that just failed.
    pub fn spawn_with_reload(
        model: Box<dyn Predict>,
        reload: Option<Reload>,
    ) -> std::io::Result<Self> {
        let info = model.info().clone();
        // A reloaded model prepares as this one does (the same files): its own preparer is not
        // needed.
        let prep = model.preparer();
        // One job queued while one computes: enough to keep the model busy, little to discard
        // on shutdown.
        let (tx, rx) = mpsc::channel::<Job>(1);
        std::thread::Builder::new()
            .name("model".into())
            .spawn(move || serve(model, reload, rx))?;
        Ok(Self { tx, info, prep })
    }
    /// What the model is.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Computes the model's task for `items` (texts, or [`Item`]s) on the model thread.
    pub async fn predict(&self, items: Vec<impl Into<Item>>) -> Result<Predicted, ModelError> {
        self.submit(items.into_iter().map(Into::into).collect())
            .await?
            .wait()
            .await
    }

    /// Prepares `items` ([`Prepare`], on blocking threads), queues them for the model thread and
    /// returns with the [`Reply`] to wait on, so the caller can prepare and queue the next batch
    /// while this one computes. Waits while the batch is prepared, and while the model already
    /// has a batch computing and one queued.
    pub async fn submit(&self, items: Vec<Item>) -> Result<Reply, ModelError> {
        let items = match &self.prep {
            Some(prep) => {
                let prep = prep.clone();
                tokio::task::spawn_blocking(move || {
                    let prepared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        prep.prepare(&items)
                    }));
                    // A preparer that panicked leaves the batch to the model thread, whose own
                    // failure the pipeline knows how to handle.
                    prepared.ok().flatten().unwrap_or(items)
                })
                .await
                .map_err(|_| ModelError::Stopped)?
            }
            None => items,
        };
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Job { items, reply })
            .await
            .map_err(|_| ModelError::Stopped)?;
        Ok(Reply(rx))
    }
}

/// The result of a batch queued with [`ModelHandle::submit`]. Dropping it cancels the work if
/// the model has not started it.
#[derive(Debug)]
pub struct Reply(oneshot::Receiver<Result<Predicted, ModelError>>);

impl Reply {
    /// Waits for the results.
    pub async fn wait(self) -> Result<Predicted, ModelError> {
        self.0.await.map_err(|_| ModelError::Stopped)?
    }
}

/// The model thread's loop: one job at a time until every handle is gone (a [`Joining`] model:
/// [`serve_joining`]).
fn serve(mut model: Box<dyn Predict>, reload: Option<Reload>, mut rx: mpsc::Receiver<Job>) {
    if model.joining().is_some() {
        return serve_joining(model, rx);
    }
    let mut faults = fault::Injected::from_env();
    while let Some(job) = rx.blocking_recv() {
        if job.reply.is_closed() {
            continue; // the caller gave up (shutdown): skip the work
        }
        let result = faults
            .next()
            .map_or_else(|| run(model.as_ref(), &job.items), Err);
        if let (Err(e), Some(reload)) = (&result, &reload) {
            if !e.blames_input() {
                tracing::warn!(error = %e, "rebuilding the model after a fault that is not the input's");
                match reload() {
                    Ok(fresh) => model = fresh,
                    Err(r) => {
                        tracing::error!(error = %r, "cannot rebuild the model; keeping the one that failed")
                    }
                }
            }
        }
        let _ = job.reply.send(result);
    }
}

/// The model thread's loop for a [`Joining`] model: jobs are admitted as they arrive (the thread
/// waits for one only when none is admitted), each step computed, and each job answered when it
/// is done. A job whose caller has gone (a drained pipeline) is dropped at the next step. A panic
/// taking a job in or in a step is not blamed on every job it hit: their items are computed
/// again one by one ([`recover`]), so only the item that panics alone is refused, with the
/// panic's message.
fn serve_joining(mut model: Box<dyn Predict>, mut rx: mpsc::Receiver<Job>) {
    let mut admitted: HashMap<u64, Job> = HashMap::new();
    let mut next = 0u64;
    while let Some(joining) = model.joining() {
        let mut arrived = Vec::new();
        if joining.idle() {
            match rx.blocking_recv() {
                Some(job) => arrived.push(job),
                None => return,
            }
        }
        while let Ok(job) = rx.try_recv() {
            arrived.push(job);
        }
        for job in arrived.into_iter().filter(|j| !j.reply.is_closed()) {
            next += 1;
            let id = next;
            let taken = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                joining.admit(id, &job.items)
            }));
            match taken {
                Ok(Ok(())) => {
                    admitted.insert(id, job);
                }
                Ok(Err(e)) => {
                    let _ = job.reply.send(Err(e));
                }
                // A panic taking the batch in (a bug one of its inputs meets) leaves the loop's
                // state unknown, as a panicking step does.
                Err(p) => {
                    let jobs = admitted.drain().map(|(_, j)| j).chain([job]).collect();
                    recover(joining, jobs, p.as_ref(), &mut next);
                }
            }
        }
        let gone: Vec<u64> = admitted
            .iter()
            .filter(|(_, job)| job.reply.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            joining.forget(id);
            admitted.remove(&id);
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| joining.step())) {
            Ok(done) => {
                for (id, result) in done {
                    if let Some(job) = admitted.remove(&id) {
                        let _ = job.reply.send(result);
                    }
                }
            }
            Err(p) => {
                let jobs = admitted.drain().map(|(_, j)| j).collect();
                recover(joining, jobs, p.as_ref(), &mut next);
            }
        }
    }
}

/// After a panic `p` in the decode loop: forgets every admitted batch and computes each of
/// `jobs` again one record at a time ([`solo`]), answering each.
fn recover(
    joining: &mut dyn Joining,
    jobs: Vec<Job>,
    p: &(dyn std::any::Any + Send),
    next: &mut u64,
) {
    let message = crate::shutdown::panic_message(p);
    tracing::warn!(panic = %message, jobs = jobs.len(), "the model panicked; computing its batches again one record at a time");
    joining.reset();
    for job in jobs {
        let result = solo(joining, &job.items, next);
        let _ = job.reply.send(result);
    }
}

/// Computes `items` one at a time on `joining`, each alone in the decode loop, so a panic names
/// its item: that item's output is [`super::Output::Refused`] with the panic's message (a
/// failure row), the others are what they would have been in any batch.
fn solo(
    joining: &mut dyn Joining,
    items: &[Item],
    next: &mut u64,
) -> Result<Predicted, ModelError> {
    let started = std::time::Instant::now();
    let (mut outputs, mut tokens) = (Vec::with_capacity(items.len()), 0);
    for item in items {
        *next += 1;
        let id = *next;
        let alone = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            joining.admit(id, std::slice::from_ref(item))?;
            loop {
                if let Some((_, result)) = joining.step().into_iter().find(|(j, _)| *j == id) {
                    return result;
                }
            }
        }));
        match alone {
            Ok(Ok(mut predicted)) if predicted.outputs.len() == 1 => {
                tokens += predicted.tokens;
                outputs.extend(predicted.outputs.pop());
            }
            Ok(Ok(_)) => return Err(ModelError::Input("not one result for one input".into())),
            Ok(Err(e)) => return Err(e),
            Err(p) => {
                joining.reset();
                let message = crate::shutdown::panic_message(p.as_ref());
                outputs.push(super::Output::Refused(format!(
                    "the model panicked: {message}"
                )));
            }
        }
    }
    Predicted::checked(outputs, tokens, started)
}

/// Computes one job's items, a panic caught as [`ModelError::Panic`].
fn run(model: &dyn Predict, items: &[Item]) -> Result<Predicted, ModelError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.predict_items(items)))
        .unwrap_or_else(|p| {
            Err(ModelError::Panic(crate::shutdown::panic_message(
                p.as_ref(),
            )))
        })
}

/// Device faults injected for the tests that prove a failing device is never blamed on the
/// records: in debug builds `SPOTINFER_TEST_DEVICE_FAULT=N` fails the first N batches the
/// thread computes (`always`: every one) with [`ModelError::Device`]. Release builds never read
/// the variable.
mod fault {
    use super::ModelError;

    /// The faults still to inject.
    pub(super) struct Injected(u64);

    impl Injected {
        pub(super) fn from_env() -> Self {
            #[cfg(debug_assertions)]
            {
                let v = std::env::var("SPOTINFER_TEST_DEVICE_FAULT").unwrap_or_default();
                Self(match v.as_str() {
                    "always" => u64::MAX,
                    n => n.parse().unwrap_or(0),
                })
            }
            #[cfg(not(debug_assertions))]
            Self(0)
        }

        /// The next batch's injected fault, if any.
        pub(super) fn next(&mut self) -> Option<ModelError> {
            if self.0 == 0 {
                return None;
            }
            self.0 = self.0.saturating_sub(u64::from(self.0 != u64::MAX));
            Some(ModelError::Device(
                "SPOTINFER_TEST_DEVICE_FAULT: injected device fault".into(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Output, Reads, Task, TokenIds};
    use crate::model::{Text, Tokenized};

    /// A model that answers 1 for each input that reached it tokenized, 0 for a raw text.
    struct Echo(ModelInfo, Option<Arc<dyn Prepare>>);

    impl Predict for Echo {
        fn info(&self) -> &ModelInfo {
            &self.0
        }
        fn predict_items(&self, items: &[Item]) -> Result<Predicted, ModelError> {
            let outputs = items
                .iter()
                .map(|i| Output::Score(f32::from(u8::from(matches!(i, Item::Tokens(_))))))
                .collect();
            Predicted::checked(outputs, 0, std::time::Instant::now())
        }
        fn preparer(&self) -> Option<Arc<dyn Prepare>> {
            self.1.clone()
        }
    }

    /// Tokenizes every text to its length; fails (`None`) a batch holding "fail", panics on
    /// "panic".
    struct Lengths;

    impl Prepare for Lengths {
        fn prepare(&self, items: &[Item]) -> Option<Vec<Item>> {
            items
                .iter()
                .map(|item| match item {
                    Item::Text(t) if t.text == "panic" => panic!("a tokenizer bug"),
                    Item::Text(t) if t.text == "fail" => None,
                    Item::Text(t) => Some(Item::Tokens(Arc::new(Tokenized::Sequence(TokenIds {
                        ids: vec![t.text.len() as u32],
                        type_ids: vec![0],
                    })))),
                    other => Some(other.clone()),
                })
                .collect()
        }
    }

    /// A joining model that answers each text with its length, one step per batch, and
    /// panics in any step that holds the text "panic".
    struct Stepping(ModelInfo, Vec<(u64, Vec<Item>)>);

    impl Predict for Stepping {
        fn info(&self) -> &ModelInfo {
            &self.0
        }
        fn predict_items(&self, _: &[Item]) -> Result<Predicted, ModelError> {
            unreachable!("the thread runs a joining model through Joining")
        }
        fn joining(&mut self) -> Option<&mut dyn Joining> {
            Some(self)
        }
    }

    impl Joining for Stepping {
        fn admit(&mut self, job: u64, items: &[Item]) -> Result<(), ModelError> {
            let poisoned = items
                .iter()
                .any(|i| matches!(i, Item::Text(t) if t.text == "panic reading"));
            assert!(!poisoned, "a prompt bug");
            self.1.push((job, items.to_vec()));
            Ok(())
        }
        fn step(&mut self) -> Vec<(u64, Result<Predicted, ModelError>)> {
            let text = |i: &Item| match i {
                Item::Text(t) => t.text.clone(),
                _ => String::new(),
            };
            let poisoned = self
                .1
                .iter()
                .flat_map(|(_, items)| items)
                .any(|i| text(i) == "panic");
            assert!(!poisoned, "a decoding bug");
            std::mem::take(&mut self.1)
                .into_iter()
                .map(|(job, items)| {
                    let outputs = items
                        .iter()
                        .map(|i| Output::Score(text(i).len() as f32))
                        .collect();
                    (
                        job,
                        Predicted::checked(outputs, 0, std::time::Instant::now()),
                    )
                })
                .collect()
        }
        fn idle(&self) -> bool {
            self.1.is_empty()
        }
        fn reset(&mut self) {
            self.1.clear();
        }
        fn forget(&mut self, job: u64) {
            self.1.retain(|(j, _)| *j != job);
        }
    }

    /// Issue 40: a panicking step of a joining model (a generation decode loop) fails no batch
    /// whole: each record is computed again alone, only the one that panics is refused with the
    /// panic's message, and the thread goes on.
    #[tokio::test]
    async fn a_joining_model_that_panics_refuses_only_the_record_that_panics_alone() {
        let h = ModelHandle::spawn(Stepping(info(), Vec::new())).unwrap();
        let texts = |t: &[&str]| {
            t.iter()
                .map(|t| Text::from(t.to_string()))
                .collect::<Vec<_>>()
        };
        let out = h
            .predict(texts(&["ab", "panic", "abc"]))
            .await
            .unwrap()
            .outputs;
        assert_eq!(out[0], Output::Score(2.0));
        assert!(
            matches!(&out[1], Output::Refused(why) if why.contains("panicked") && why.contains("a decoding bug")),
            "{:?}",
            out[1]
        );
        assert_eq!(out[2], Output::Score(3.0));
        let out = h.predict(texts(&["a"])).await.unwrap().outputs;
        assert_eq!(out, vec![Output::Score(1.0)]);
        // A panic taking a batch in is isolated the same way.
        let out = h
            .predict(texts(&["ab", "panic reading"]))
            .await
            .unwrap()
            .outputs;
        assert_eq!(out[0], Output::Score(2.0));
        assert!(
            matches!(&out[1], Output::Refused(why) if why.contains("a prompt bug")),
            "{:?}",
            out[1]
        );
    }

    fn info() -> ModelInfo {
        ModelInfo {
            name: "echo".into(),
            hash: String::new(),
            dim: 1,
            max_seq_len: 8,
            device: "Cpu".into(),
            prompts: Vec::new(),
            task: Task::Score,
            labels: Vec::new(),
            reads: Reads::Texts,
            processor: None,
        }
    }

    fn handle(prep: Option<Arc<dyn Prepare>>) -> ModelHandle {
        ModelHandle::spawn(Echo(info(), prep)).unwrap()
    }

    async fn reached_tokenized(handle: &ModelHandle, texts: &[&str]) -> Vec<Output> {
        let items: Vec<Text> = texts.iter().map(|t| Text::from(t.to_string())).collect();
        handle.predict(items).await.unwrap().outputs
    }

    #[tokio::test]
    async fn a_model_s_preparer_runs_before_its_batch_reaches_the_model_thread() {
        let prepared = handle(Some(Arc::new(Lengths)));
        let out = reached_tokenized(&prepared, &["a", "bb"]).await;
        assert_eq!(out, vec![Output::Score(1.0), Output::Score(1.0)]);
        let unprepared = handle(None);
        let out = reached_tokenized(&unprepared, &["a", "bb"]).await;
        assert_eq!(out, vec![Output::Score(0.0), Output::Score(0.0)]);
    }

    #[tokio::test]
    async fn a_batch_its_preparer_fails_or_panics_on_reaches_the_model_thread_as_it_was() {
        let h = handle(Some(Arc::new(Lengths)));
        for bad in ["fail", "panic"] {
            let out = reached_tokenized(&h, &["a", bad]).await;
            assert_eq!(out, vec![Output::Score(0.0), Output::Score(0.0)], "{bad}");
        }
        // The handle and its preparer still work after the panic.
        let out = reached_tokenized(&h, &["a"]).await;
        assert_eq!(out, vec![Output::Score(1.0)]);
    }
}
