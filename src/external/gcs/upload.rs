//! Writing an object by a resumable upload (`export` to `gs://`): the object appears only once
//! the upload is finished, never as a short object from one cut off.

use super::{parse_uri, request_error, Gcs, StorageError};

/// Pieces an upload may hold queued before [`Upload::write`] waits (the client buffers its own
/// resumable chunk on top).
const UPLOAD_QUEUE: usize = 4;

/// One piece of an upload's data, or its end: the upload is finalised only by an explicit end,
/// so one cut off (an error, a dropped [`Upload`]) never becomes a short object.
enum Piece {
    Bytes(bytes::Bytes),
    End,
}

/// The upload's data as the storage client pulls it. It tells [`Gcs::upload`] when the client
/// first asks for data, which is after the resumable session was created: a missing bucket or
/// a refused write fails before that, with nothing written.
struct Pieces {
    rx: tokio::sync::mpsc::Receiver<Piece>,
    asked: Option<tokio::sync::oneshot::Sender<()>>,
}

impl google_cloud_storage::streaming_source::StreamingSource for Pieces {
    type Error = std::io::Error;

    async fn next(&mut self) -> Option<Result<bytes::Bytes, Self::Error>> {
        if let Some(asked) = self.asked.take() {
            let _ = asked.send(());
        }
        match self.rx.recv().await {
            Some(Piece::Bytes(b)) => Some(Ok(b)),
            Some(Piece::End) => None,
            None => Some(Err(std::io::Error::other(
                "the upload was abandoned before its end",
            ))),
        }
    }
}

/// An object being written by a resumable upload (CRC32C-checked by the client against what
/// the service stored). The object exists only once [`Upload::finish`] returns.
pub struct Upload {
    uri: String,
    tx: tokio::sync::mpsc::Sender<Piece>,
    task: tokio::task::JoinHandle<Result<(), google_cloud_storage::Error>>,
}

impl Gcs {
    /// Starts a resumable upload to `uri`; returns once the service accepted the session.
    pub async fn upload(&self, uri: &str) -> Result<Upload, StorageError> {
        let (bucket, object) = parse_uri(uri)?;
        let (tx, rx) = tokio::sync::mpsc::channel(UPLOAD_QUEUE);
        let (asked, asked_rx) = tokio::sync::oneshot::channel();
        let source = Pieces {
            rx,
            asked: Some(asked),
        };
        let client = self.client.clone();
        let task = tokio::spawn(async move {
            client
                .write_object(bucket, object, source)
                .send_buffered()
                .await
                .map(|_| ())
        });
        let mut upload = Upload {
            uri: uri.to_string(),
            tx,
            task,
        };
        if asked_rx.await.is_err() {
            // The task ended before asking for data: the session was refused.
            return Err(upload.outcome().await.err().unwrap_or_else(|| {
                StorageError::Client(format!("the upload to {uri} ended before it started"))
            }));
        }
        Ok(upload)
    }
}

impl Upload {
    /// Queues bytes for the upload.
    pub async fn write(&mut self, bytes: bytes::Bytes) -> Result<(), StorageError> {
        if self.tx.send(Piece::Bytes(bytes)).await.is_err() {
            return self.outcome().await;
        }
        Ok(())
    }

    /// Ends the upload and waits until the object is stored and its checksum verified.
    pub async fn finish(mut self) -> Result<(), StorageError> {
        if self.tx.send(Piece::End).await.is_err() {
            return self.outcome().await;
        }
        self.outcome().await
    }

    /// What the upload task ended with.
    async fn outcome(&mut self) -> Result<(), StorageError> {
        let uri = self.uri.clone();
        match (&mut self.task).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => match request_error(&uri, e) {
                StorageError::NotFound(uri) => Err(StorageError::NoBucket(uri)),
                other => Err(other),
            },
            Err(e) => Err(StorageError::Client(format!("upload to {uri}: {e}"))),
        }
    }
}

impl Drop for Upload {
    /// An upload dropped before [`Upload::finish`] is cancelled: its session is never
    /// finalised, so no object appears.
    fn drop(&mut self) {
        self.task.abort();
    }
}
