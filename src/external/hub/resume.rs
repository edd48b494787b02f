//! A cut-off download resumed where it stopped.
//!
//! hf-hub 1.0.0 streams a file into `blobs/<etag>.incomplete` and renames it when complete; a
//! download cut off leaves that prefix behind, and the next `download_file` truncates it and
//! starts from the first byte (`repository/download.rs`, `stream_response_to_file_with_progress`
//! opens it with `File::create`). Before asking hf-hub, this asks the Hub for the rest alone (a
//! Range request, through hf-hub's own `download_file_stream`), appends it and puts the blob in
//! place; hf-hub then finds the blob and only links it into the snapshot, and the hash check
//! that follows every fetch covers the joined file (a bad join is removed and fetched whole).

use super::Snapshot;
use futures::StreamExt;
use std::io::Write;
use std::path::{Path, PathBuf};

impl Snapshot<'_> {
    /// Completes the blob of `file` from a prefix an earlier, cut-off download left, where there
    /// is one; anything that goes wrong leaves the download to hf-hub, from the first byte.
    pub(super) async fn resume(&self, file: &str) {
        let meta = self
            .repo
            .get_file_metadata()
            .filepath(file.to_string())
            .revision(&self.commit)
            .send()
            .await;
        // A Xet-stored file is fetched by hf-hub's other path, which leaves no such prefix.
        let Ok(meta) = meta.map_err(|_| ()).and_then(|m| match m.xet_hash {
            None => Ok(m),
            Some(_) => Err(()),
        }) else {
            return;
        };
        let blob = self.root.join("blobs").join(&meta.etag);
        let partial = PathBuf::from(format!("{}.incomplete", blob.display()));
        let have = std::fs::metadata(&partial).map_or(0, |m| m.len());
        if blob.exists() || have == 0 || have >= meta.file_size {
            return;
        }
        match self.append_rest(file, &partial, have, meta.file_size).await {
            Ok(()) => match std::fs::rename(&partial, &blob) {
                Ok(()) => tracing::info!(file, resumed_at = have, "cut-off download resumed"),
                Err(e) => tracing::warn!(file, error = %e, "cannot put the resumed file in place"),
            },
            Err(e) => tracing::warn!(file, error = %e, "resuming failed; the download starts over"),
        }
    }

    /// Appends bytes `have..size` of `file` to `partial`.
    async fn append_rest(
        &self,
        file: &str,
        partial: &Path,
        have: u64,
        size: u64,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let (_, mut stream) = self
            .repo
            .download_file_stream()
            .filename(file.to_string())
            .revision(self.commit.clone())
            .range(have..size)
            .send()
            .await?;
        let mut out = std::fs::OpenOptions::new().append(true).open(partial)?;
        let mut got = have;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk?;
            out.write_all(&chunk)?;
            got += chunk.len() as u64;
        }
        out.sync_all()?;
        if got != size {
            return Err(format!("the rest ended at byte {got} of {size}").into());
        }
        Ok(())
    }
}
