//! An exclusive lock on a file, so that several workers on one node download a model file once
//! (the gs:// model cache and the Hugging Face Hub cache both take it).

use std::path::Path;

/// An exclusive lock on a file (`File::lock`: flock on Linux), held while the value lives; the
/// lock goes with the file descriptor when it is dropped.
pub(crate) struct FileLock(#[allow(dead_code)] std::fs::File);

impl FileLock {
    /// Waits for the lock on a blocking thread, so other tasks run meanwhile.
    pub(crate) async fn acquire(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        tokio::task::spawn_blocking(move || file.lock().map(|()| Self(file)))
            .await
            .map_err(std::io::Error::other)?
    }
}
