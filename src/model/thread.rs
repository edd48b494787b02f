//! The model thread: an [`Embedder`] on a dedicated OS thread behind a channel, so a batch that
//! computes for seconds never stalls the async runtime that keeps Pub/Sub leases, acks and nacks
//! flowing.

use super::{Embedded, Embedder, Input, ModelError, ModelInfo};
use tokio::sync::{mpsc, oneshot};

/// One text for the model thread, with the name of the prompt it asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text {
    /// The text.
    pub text: String,
    /// The model prompt to put before it; none: the worker's default.
    pub prompt_name: Option<String>,
}

impl From<String> for Text {
    fn from(text: String) -> Self {
        Self {
            text,
            prompt_name: None,
        }
    }
}

struct Job {
    texts: Vec<Text>,
    reply: oneshot::Sender<Result<Embedded, ModelError>>,
}

/// A handle to the model thread. Cheap to clone; the thread stops when every handle is dropped.
#[derive(Clone)]
pub struct ModelHandle {
    tx: mpsc::Sender<Job>,
    info: ModelInfo,
}

impl ModelHandle {
    /// Moves `embedder` onto a new thread named `model` and returns a handle to it.
    pub fn spawn(embedder: Embedder) -> std::io::Result<Self> {
        let info = embedder.info().clone();
        // One job queued while one computes: enough to keep the model busy, little to discard
        // on shutdown.
        let (tx, mut rx) = mpsc::channel::<Job>(1);
        std::thread::Builder::new()
            .name("model".into())
            .spawn(move || {
                while let Some(job) = rx.blocking_recv() {
                    if job.reply.is_closed() {
                        continue; // the caller gave up (shutdown): skip the work
                    }
                    let inputs: Vec<Input<'_>> = job
                        .texts
                        .iter()
                        .map(|t| Input {
                            text: &t.text,
                            prompt_name: t.prompt_name.as_deref(),
                        })
                        .collect();
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        embedder.embed_inputs(&inputs)
                    }))
                    .unwrap_or_else(|p| {
                        Err(ModelError::Panic(crate::shutdown::panic_message(
                            p.as_ref(),
                        )))
                    });
                    let _ = job.reply.send(result);
                }
            })?;
        Ok(Self { tx, info })
    }

    /// What the model is.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Embeds `texts` on the model thread.
    pub async fn embed(&self, texts: Vec<Text>) -> Result<Embedded, ModelError> {
        self.submit(texts).await?.wait().await
    }

    /// Queues `texts` for the model thread and returns at once with the [`Reply`] to wait on, so
    /// the caller can queue the next batch while this one computes. Waits only while the model
    /// already has a batch computing and one queued.
    pub async fn submit(&self, texts: Vec<Text>) -> Result<Reply, ModelError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Job { texts, reply })
            .await
            .map_err(|_| ModelError::Stopped)?;
        Ok(Reply(rx))
    }
}

/// The result of a batch queued with [`ModelHandle::submit`]. Dropping it cancels the work if
/// the model has not started it.
#[derive(Debug)]
pub struct Reply(oneshot::Receiver<Result<Embedded, ModelError>>);

impl Reply {
    /// Waits for the vectors.
    pub async fn wait(self) -> Result<Embedded, ModelError> {
        self.0.await.map_err(|_| ModelError::Stopped)?
    }
}
