//! The model thread: an [`Embedder`] on a dedicated OS thread behind a channel, so a batch that
//! computes for seconds never stalls the async runtime that keeps Pub/Sub leases, acks and nacks
//! flowing.

use super::{Embedded, Embedder, ModelError, ModelInfo};
use tokio::sync::{mpsc, oneshot};

struct Job {
    texts: Vec<String>,
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
                    let texts: Vec<&str> = job.texts.iter().map(String::as_str).collect();
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        embedder.embed(&texts)
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
    pub async fn embed(&self, texts: Vec<String>) -> Result<Embedded, ModelError> {
        self.submit(texts).await?.wait().await
    }

    /// Queues `texts` for the model thread and returns at once with the [`Reply`] to wait on, so
    /// the caller can queue the next batch while this one computes. Waits only while the model
    /// already has a batch computing and one queued.
    pub async fn submit(&self, texts: Vec<String>) -> Result<Reply, ModelError> {
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
