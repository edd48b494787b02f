//! `spotinfer publish`: one message per JSONL line, from a file or gs://, read as it is
//! published (constant memory), with a progress bar over the input's bytes.

use anyhow::Context;
use spotinfer::config::PublishArgs;
use spotinfer::external::gcs::Gcs;
use spotinfer::external::publish;
use spotinfer::external::pubsub::PubsubConfig;
use tokio::io::AsyncBufRead;

/// Publishes every valid line; fails when any publish failed.
pub async fn run(a: PublishArgs) -> anyhow::Result<()> {
    let ps = PubsubConfig::from_args(&a.pubsub);
    let publisher = ps.publisher().await?;
    let (size, input) = open_input(&a).await?;
    let progress = indicatif::ProgressBar::new(size).with_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} read {binary_bytes_per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let summary = publish::publish_lines(&publisher, input, a.job.as_deref(), &progress).await?;
    progress.finish_and_clear();
    println!(
        "published {} records to {} ({} lines skipped, {} failed)",
        summary.published, ps.topic, summary.skipped, summary.failed
    );
    if summary.failed > 0 {
        anyhow::bail!("{} publishes failed", summary.failed);
    }
    Ok(())
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
