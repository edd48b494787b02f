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
    /// Completes the blob of `file` (named `etag`, `size` bytes: [`Snapshot::head`]) from a
    /// prefix an earlier, cut-off download left, where there is one; anything that goes wrong
    /// leaves the download to hf-hub, from the first byte.
    pub(super) async fn resume(&self, file: &str, etag: &str, size: u64) {
        let blob = self.root.join("blobs").join(etag);
        let partial = PathBuf::from(format!("{}.incomplete", blob.display()));
        let have = std::fs::metadata(&partial).map_or(0, |m| m.len());
        if blob.exists() || have == 0 || have >= size {
            return;
        }
        match self.append_rest(file, &partial, have, size).await {
            Ok(()) => match std::fs::rename(&partial, &blob) {
                Ok(()) => tracing::info!(file, resumed_at = have, "cut-off download resumed"),
                Err(e) => tracing::warn!(file, error = %e, "cannot put the resumed file in place"),
            },
            Err(e) => tracing::warn!(file, error = %e, "resuming failed; the download starts over"),
        }
    }

    /// The etag (the blob's name) and size of `file` at the commit, from a HEAD request that
    /// does not follow the Hub's redirect to its storage (whose answer lacks the Hub's headers;
    /// hf-hub's `get_file_metadata` follows it, and hf-hub's own non-redirecting request is
    /// private to it). None for a Xet-stored file (hf-hub's other path leaves no prefix) or any
    /// failure.
    pub(super) async fn head(&self, file: &str) -> Option<(String, u64)> {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(super::CONNECT_TIMEOUT)
            .timeout(super::READ_TIMEOUT)
            .build()
            .ok()?;
        let url = format!(
            "{}/{}/resolve/{}/{file}",
            self.endpoint,
            self.id.repo(),
            self.commit
        );
        let mut request = client.head(url);
        if let Some(t) = &self.token {
            request = request.bearer_auth(t);
        }
        let response = request.send().await.ok()?;
        let status = response.status();
        if !(status.is_success() || status.is_redirection()) {
            return None;
        }
        let headers = response.headers();
        let header = |names: [&str; 2]| {
            names
                .iter()
                .find_map(|n| headers.get(*n).and_then(|v| v.to_str().ok()))
                .map(str::to_string)
        };
        if headers.contains_key("x-xet-hash") {
            return None;
        }
        let etag = header(["x-linked-etag", "etag"])?;
        let etag = etag.trim_start_matches("W/").trim_matches('"').to_string();
        let size = header(["x-linked-size", "content-length"])?.parse().ok()?;
        Some((etag, size))
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
