//! `spotinfer publish`: one message per record of an input (a file, a folder, a gs:// object,
//! prefix or glob; JSON lines, CSV, TSV or Parquet), read as it is published (bounded memory),
//! with a progress bar on a terminal; with `--job`, the job and every record id are registered
//! in the database before the messages go out, every refused row is recorded in the job, and a
//! re-run skips the shards an earlier run finished.

use spotinfer::config::PublishArgs;
use spotinfer::external::gcs::{check_bucket, Gcs};
use spotinfer::external::store::Store;
use spotinfer::jobs::input::{self, Format, Input};
use spotinfer::jobs::publish::{JobTarget, Publish, PublishSummary};
use spotinfer::record::generation::Constraint;

/// Publishes every valid record; fails when any publish failed.
pub async fn run(a: PublishArgs) -> anyhow::Result<()> {
    let ps = a.pubsub.config();
    let columns = a.columns.columns();
    let gcs = match a.input.starts_with("gs://") {
        true => {
            // Refused before anything is read: the list that keeps records' `uri`s to the
            // buckets meant binds the publisher's input too.
            let bucket = a.input["gs://".len()..]
                .split('/')
                .next()
                .unwrap_or_default();
            check_bucket(&a.storage.allowed_buckets, bucket, &a.input)?;
            Some(Gcs::new(a.storage.storage_emulator_host.as_deref()).await?)
        }
        false => None,
    };
    let input = input::list(&a.input, a.format, gcs.as_ref()).await?;
    if !input.skipped.is_empty() {
        eprintln!(
            "left out {} files with no known suffix (such as {}); --format reads them",
            input.skipped.len(),
            input.skipped[0]
        );
    }
    let publisher = ps.publisher().await?;
    let progress = progress_bar(input.bytes());
    let model = a.model.name();
    let store = match &a.job {
        Some(job) => Some(register(&a, job, &model).await?),
        None => None,
    };
    let target = store
        .as_ref()
        .zip(a.job.as_deref())
        .map(|(store, job)| JobTarget {
            store,
            job,
            model: &model,
            skip_done: a.skip_done,
        });
    let response_format = a
        .response_format
        .as_deref()
        .map(response_format)
        .transpose()?;
    let publish = Publish {
        response_format: response_format.as_ref(),
        publisher: &publisher,
        gcs: gcs.as_ref(),
        columns: columns.as_ref(),
        job: a.job.as_deref(),
        target,
        republish: a.republish,
        max_held_bytes: a.max_publish_bytes,
        progress: &progress,
    };
    let summary = publish.run(&input).await?;
    progress.finish_and_clear();
    report(&a, &input, &summary, &ps.topic);
    if summary.failed > 0 {
        anyhow::bail!(
            "{} publishes failed; run the same publish again (the job's count will not double)",
            summary.failed
        );
    }
    if let Some(t) = target {
        let status = t.store.job_status(t.job).await?;
        println!(
            "job {}: {} records in all, {} {} refused (`export --failed` lists them), model {}",
            t.job,
            status.published,
            status.refused,
            unit(&input),
            status.model
        );
    }
    Ok(())
}

/// Prints what the publish did.
fn report(a: &PublishArgs, input: &Input, summary: &PublishSummary, topic: &str) {
    println!(
        "published {} records to {} ({} {} skipped, {} failed{})",
        summary.published,
        topic,
        summary.skipped,
        unit(input),
        summary.failed,
        if a.skip_done {
            format!(", {} already done", summary.already_done)
        } else {
            String::new()
        }
    );
    if summary.rows_resumed > 0 {
        println!(
            "resumed: {} rows an interrupted run got through were not published again",
            summary.rows_resumed
        );
    }
    if input.shards.len() > 1 || summary.shards_skipped > 0 {
        println!(
            "shards: {} read, {} skipped (finished by an earlier run), {} in all",
            summary.shards,
            summary.shards_skipped,
            input.shards.len()
        );
    }
}

/// What the input's rows are called: lines of JSON lines, rows of a table.
fn unit(input: &Input) -> &'static str {
    match input.shards.iter().all(|s| s.format == Format::Jsonl) {
        true => "lines",
        false => "rows",
    }
}

/// The progress bar over the input's bytes, with rows read, published and refused, the rate
/// and the time left; drawn only on a terminal (logs and CI see the final count alone).
fn progress_bar(bytes: u64) -> indicatif::ProgressBar {
    indicatif::ProgressBar::new(bytes).with_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {bytes}/{total_bytes} {msg} ({binary_bytes_per_sec}, ETA {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    )
}

/// Opens the database and registers `job` for `model`.
async fn register(a: &PublishArgs, job: &str, model: &str) -> anyhow::Result<Store> {
    let store = Store::connect(&a.db.database_url).await?;
    store.migrate().await?;
    store.register_job(job, model).await?;
    Ok(store)
}

/// The constraint in the file `--response-format` names.
fn response_format(path: &std::path::Path) -> anyhow::Result<Constraint> {
    use anyhow::Context;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--response-format {}", path.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("--response-format {}: not JSON", path.display()))?;
    Constraint::for_every_record(value)
        .map_err(|e| anyhow::anyhow!("--response-format {}: {e}", path.display()))
}
