//! The commands: each a thin entry point over the library, one file each.

pub mod export;
pub mod loadtest;
pub mod models;
pub mod offline;
pub mod publish;
pub mod setup;
pub mod status;
pub mod work;

use anyhow::Context;
use spotinfer::config::ModelArgs;
use spotinfer::external::gcs::{FileList, Gcs};
use spotinfer::external::hub::{Hub, HubId, HubSettings};
use spotinfer::model::load::{self, LoadRequest, ModelKind, Running};
use spotinfer::model::{GenerateTask, GenerationDefaults, LoadOptions, PromptChoice, TextModel};
use std::path::Path;
use std::time::Instant;

/// The local model directory: `SPOTINFER_MODEL` itself; for gs://BUCKET/PREFIX, the verified
/// copy in the cache; for a Hugging Face Hub id, its snapshot in the Hub cache (each downloaded
/// unless a valid copy is already there).
pub async fn model_dir(m: &ModelArgs) -> anyhow::Result<std::path::PathBuf> {
    fetch_model(&m.source.model, &m.storage).await
}

/// [`model_dir`] for a model path and storage settings: `hf://` is the Hub's; an existing local
/// path wins; then `gs://`; then a value of the Hub-id form `owner/name[@revision]` whose
/// `owner` is no local folder (`HubId::from_model_arg`).
pub async fn fetch_model(
    model: &Path,
    storage: &spotinfer::config::StorageArgs,
) -> anyhow::Result<std::path::PathBuf> {
    if let Some(uri) = model.to_str().filter(|s| s.starts_with("gs://")) {
        return fetch_from_gcs(uri, storage).await;
    }
    match HubId::from_model_arg(model)? {
        Some(id) => fetch_from_hub(&id).await,
        None => Ok(model.to_path_buf()),
    }
}

/// The model layer's list of a model folder's files, for the model caches.
fn model_files(dir: &Path) -> FileList {
    let files = spotinfer::model::spec::model_files(dir);
    FileList {
        required: files.required,
        optional: files.optional,
    }
}

/// The model under gs://BUCKET/PREFIX, in the cache.
async fn fetch_from_gcs(
    uri: &str,
    storage: &spotinfer::config::StorageArgs,
) -> anyhow::Result<std::path::PathBuf> {
    let started = Instant::now();
    let gcs = Gcs::new(storage.storage_emulator_host.as_deref()).await?;
    let fetched = gcs
        .fetch_model(uri, &storage.cache_dir, "modules.json", model_files)
        .await
        .with_context(|| format!("cannot fetch the model from {uri}"))?;
    tracing::info!(model = uri, dir = %fetched.dir.display(), downloaded = ?fetched.downloaded, seconds = started.elapsed().as_secs_f64(), "model ready in the cache");
    Ok(fetched.dir)
}

/// The model `id` names on the Hugging Face Hub, in the Hub cache (endpoint, token and cache
/// from `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_CACHE` / `HF_HOME`).
async fn fetch_from_hub(id: &HubId) -> anyhow::Result<std::path::PathBuf> {
    let started = Instant::now();
    let hub = Hub::new(&HubSettings::default())?;
    let fetched = hub
        .fetch_model(id, "modules.json", model_files)
        .await
        .with_context(|| format!("cannot fetch the model {id} from {}", hub.endpoint()))?;
    tracing::info!(model = %id, dir = %fetched.dir.display(), downloaded = ?fetched.downloaded, seconds = started.elapsed().as_secs_f64(), "model ready in the Hub cache");
    Ok(fetched.dir)
}

/// The text model as `m` describes it, from `dir` (what [`model_dir`] returned), on this thread.
pub fn load_text_model(dir: &Path, m: &ModelArgs) -> anyhow::Result<TextModel> {
    match ModelKind::detect(dir)? {
        ModelKind::Generation => anyhow::bail!(
            "{} is a generation model: `embed` runs encoders; run prompt records through `work` \
             (`bench` measures its speed)",
            dir.display()
        ),
        ModelKind::Image => anyhow::bail!(
            "{} is an image model: `embed` and `bench` read files of texts; run image records \
             through `work` (examples/image_speed.rs measures the model alone)",
            dir.display()
        ),
        ModelKind::Text => open_text_model(dir, m),
    }
}

/// The generation model in `dir` as `m` describes it, with the worker's defaults, on this thread
/// (for `bench`: the same task a worker runs, its decode loop never interrupted).
pub fn open_generation_model(dir: &Path, m: &ModelArgs) -> anyhow::Result<GenerateTask> {
    let request = load_request(m);
    Ok(GenerateTask::open_uninterrupted(
        dir,
        &request.options,
        request.generation,
    )?)
}

/// The text model in `dir` as `m` describes it.
fn open_text_model(dir: &Path, m: &ModelArgs) -> anyhow::Result<TextModel> {
    Ok(TextModel::open(dir, &load_options(m))?.with_max_batch_tokens(m.max_batch_tokens))
}

/// How `m` asks for the model to be loaded.
fn load_options(m: &ModelArgs) -> LoadOptions {
    let prompt = match (&m.prompt_name, &m.prompt) {
        (Some(name), _) => PromptChoice::Named(name.clone()),
        (None, Some(text)) => PromptChoice::Text(text.clone()),
        (None, None) => PromptChoice::ModelDefault,
    };
    LoadOptions {
        device: m.device,
        backend: m.backend,
        precision: m.precision,
        cpu_kernels: m.cpu_kernels,
        name: m.source.model_name.clone(),
        prompt,
        max_seq_len: m.max_seq_length,
    }
}

/// How `m` asks for the model to be opened, whatever its kind (`model::load`).
fn load_request(m: &ModelArgs) -> LoadRequest {
    let g = &m.generation;
    LoadRequest {
        options: load_options(m),
        generation: GenerationDefaults {
            max_new_tokens: g.max_new_tokens,
            temperature: g.temperature,
            top_p: g.top_p,
            top_k: g.top_k,
            truncate_prompt: g.truncate_prompt,
            max_seconds: (!g.max_generation_seconds.is_zero()).then_some(g.max_generation_seconds),
            max_batch_tokens: m.max_batch_tokens,
        },
        max_batch_tokens: m.max_batch_tokens,
    }
}

/// The model on its own thread, for the worker (`model::load::spawn`).
pub async fn load_model(m: &ModelArgs) -> anyhow::Result<Running> {
    let dir = model_dir(m).await?;
    let request = load_request(m);
    Ok(tokio::task::spawn_blocking(move || load::spawn(dir, request)).await??)
}
