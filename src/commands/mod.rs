//! The commands: each a thin entry point over the library, one file each.

pub mod loadtest;
pub mod offline;
pub mod publish;
pub mod setup;
pub mod status;
pub mod work;

use anyhow::Context;
use spotinfer::config::ModelArgs;
use spotinfer::external::gcs::Gcs;
use spotinfer::model::{Embedder, ModelHandle};
use std::time::Instant;

/// The local model directory: `SPOTINFER_MODEL` itself, or, for gs://BUCKET/PREFIX, the
/// verified copy in the cache (downloaded unless a valid copy is already there).
pub async fn model_dir(m: &ModelArgs) -> anyhow::Result<std::path::PathBuf> {
    let Some(uri) = m.model.to_str().filter(|s| s.starts_with("gs://")) else {
        return Ok(m.model.clone());
    };
    let started = Instant::now();
    let gcs = Gcs::new(m.storage.storage_emulator_host.as_deref()).await?;
    let fetched = gcs
        .fetch_model(uri, &m.storage.cache_dir)
        .await
        .with_context(|| format!("cannot fetch the model from {uri}"))?;
    tracing::info!(model = uri, dir = %fetched.dir.display(), downloaded = ?fetched.downloaded, seconds = started.elapsed().as_secs_f64(), "model ready in the cache");
    Ok(fetched.dir)
}

pub async fn load_model(m: &ModelArgs) -> anyhow::Result<ModelHandle> {
    let dir = model_dir(m).await?;
    let (device, backend, precision) = (m.device, m.backend, m.precision);
    let budget = m.max_batch_tokens;
    let embedder = tokio::task::spawn_blocking(move || {
        Embedder::load_as(&dir, device, backend, precision).map(|e| e.with_max_batch_tokens(budget))
    })
    .await??;
    ModelHandle::spawn(embedder).context("cannot start the model thread")
}
