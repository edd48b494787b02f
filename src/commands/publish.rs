//! `spotinfer publish`: one message per JSONL line, from a file or gs://, read as it is
//! published (constant memory), with a progress bar over the input's bytes; with `--job`, the
//! job and every record id are registered in the database before the messages go out, and
//! every line refused is recorded in the job.

use anyhow::Context;
use spotinfer::config::PublishArgs;
use spotinfer::external::gcs::Gcs;
use spotinfer::external::store::Store;
use spotinfer::jobs::publish::{self, JobTarget};
use tokio::io::AsyncBufRead;

/// Publishes every valid line; fails when any publish failed.
pub async fn run(a: PublishArgs) -> anyhow::Result<()> {
    let ps = a.pubsub.config();
    let publisher = ps.publisher().await?;
    let (size, input_reader) = open_input(&a).await?;
    let progress = indicatif::ProgressBar::new(size).with_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} read {binary_bytes_per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let model = a.model.name();
    let input = input_name(&a);
    let store = match &a.job {
        Some(job) => Some(register(&a, job, &model, &input).await?),
        None => None,
    };
    let target = store
        .as_ref()
        .zip(a.job.as_deref())
        .map(|(store, job)| JobTarget {
            store,
            job,
            input: &input,
            model: &model,
            skip_done: a.skip_done,
        });
    let summary = publish::publish_lines(
        &publisher,
        input_reader,
        a.job.as_deref(),
        target,
        a.max_publish_bytes,
        &progress,
    )
    .await?;
    progress.finish_and_clear();
    println!(
        "published {} records to {} ({} lines skipped, {} failed{})",
        summary.published,
        ps.topic,
        summary.skipped,
        summary.failed,
        if a.skip_done {
            format!(", {} already done", summary.already_done)
        } else {
            String::new()
        }
    );
    if summary.failed > 0 {
        anyhow::bail!(
            "{} publishes failed; run the same publish again (the job's count will not double)",
            summary.failed
        );
    }
    if let Some(t) = target {
        let records = (summary.published + summary.already_done) as i64;
        t.store.finish_input(t.job, &input, records).await?;
        let status = t.store.job_status(t.job).await?;
        println!(
            "job {}: {} records in all, {} lines refused (`export --failed` lists them), model {}",
            t.job, status.published, status.refused, status.model
        );
    }
    Ok(())
}

/// Opens the database, registers `job` for `model` and marks `input` as being published to it.
async fn register(a: &PublishArgs, job: &str, model: &str, input: &str) -> anyhow::Result<Store> {
    let store = Store::connect(&a.db.database_url).await?;
    store.migrate().await?;
    store.register_job(job, model).await?;
    store.start_input(job, input).await?;
    Ok(store)
}

/// How the input is named in the job's list of inputs: a gs:// URI as given, a local file by
/// its absolute path (so a re-run from another directory is the same input).
fn input_name(a: &PublishArgs) -> String {
    let given = a.file.to_string_lossy();
    if given.starts_with("gs://") {
        return given.into_owned();
    }
    std::fs::canonicalize(&a.file)
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| given.into_owned())
}

/// The input's size and a reader over it: a local file or a gs:// object.
async fn open_input(
    a: &PublishArgs,
) -> anyhow::Result<(u64, Box<dyn AsyncBufRead + Unpin + Send>)> {
    if let Some(uri) = a.file.to_str().filter(|s| s.starts_with("gs://")) {
        let gcs = Gcs::new(a.storage.storage_emulator_host.as_deref()).await?;
        let (size, reader) = gcs.open(uri).await?;
        return Ok((size, Box::new(reader)));
    }
    let context = || format!("cannot read {}", a.file.display());
    let file = tokio::fs::File::open(&a.file).await.with_context(context)?;
    let size = file.metadata().await.with_context(context)?.len();
    Ok((size, Box::new(tokio::io::BufReader::new(file))))
}
