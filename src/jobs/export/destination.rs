//! Where an export's bytes go: a local file or a Cloud Storage object, never visible under
//! the final name until the whole file is there.
//!
//! A local file is written to a hidden sibling (`.NAME.partial-PID`) and renamed over the final
//! name once synced; a `gs://` object is a resumable upload that is finalised only by
//! [`Destination::commit`]. Both are opened before any row is read, so an unwritable directory
//! or a missing bucket fails first, with nothing written.

use super::ExportError;
use crate::external::gcs::{Gcs, Upload};
use std::path::{Path, PathBuf};
use tokio::io::AsyncWriteExt;

/// An open destination.
pub enum Destination {
    /// A local file being written under a temporary name.
    Local(LocalFile),
    /// A Cloud Storage upload in progress.
    Gcs(Upload),
}

/// A local file written under a temporary name; removed again unless committed.
pub struct LocalFile {
    file: Option<tokio::fs::File>,
    partial: PathBuf,
    target: PathBuf,
}

impl Destination {
    /// Opens `path` (a file path or `gs://BUCKET/OBJECT`) for writing.
    pub async fn open(path: &str, emulator_host: Option<&str>) -> Result<Self, ExportError> {
        if path.starts_with("gs://") {
            let gcs = Gcs::new(emulator_host).await?;
            return Ok(Self::Gcs(gcs.upload(path).await?));
        }
        Ok(Self::Local(LocalFile::create(Path::new(path)).await?))
    }

    /// Appends bytes.
    pub async fn write(&mut self, bytes: Vec<u8>) -> Result<(), ExportError> {
        if bytes.is_empty() {
            return Ok(());
        }
        match self {
            Self::Local(f) => f.write(&bytes).await,
            Self::Gcs(u) => Ok(u.write(bytes.into()).await?),
        }
    }

    /// Makes the file visible under its final name.
    pub async fn commit(self) -> Result<(), ExportError> {
        match self {
            Self::Local(f) => f.commit().await,
            Self::Gcs(u) => {
                u.finish().await?;
                Ok(())
            }
        }
    }
}

impl LocalFile {
    async fn create(target: &Path) -> Result<Self, ExportError> {
        let name = target
            .file_name()
            .ok_or_else(|| ExportError::BadPath(target.display().to_string()))?;
        let partial = target.with_file_name(format!(
            ".{}.partial-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&partial)
            .await
            .map_err(|source| ExportError::Io {
                path: target.to_path_buf(),
                source,
            })?;
        Ok(Self {
            file: Some(file),
            partial,
            target: target.to_path_buf(),
        })
    }

    fn io(&self, source: std::io::Error) -> ExportError {
        ExportError::Io {
            path: self.target.clone(),
            source,
        }
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<(), ExportError> {
        let Some(file) = self.file.as_mut() else {
            return Ok(());
        };
        file.write_all(bytes).await.map_err(|e| self.io(e))
    }

    async fn commit(mut self) -> Result<(), ExportError> {
        if let Some(mut file) = self.file.take() {
            file.flush().await.map_err(|e| self.io(e))?;
            file.sync_all().await.map_err(|e| self.io(e))?;
        }
        tokio::fs::rename(&self.partial, &self.target)
            .await
            .map_err(|e| self.io(e))?;
        self.partial = PathBuf::new();
        Ok(())
    }
}

impl Drop for LocalFile {
    /// An export that did not commit leaves no partial file behind.
    fn drop(&mut self) {
        if !self.partial.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}
