//! `spotinfer publish`: one message per JSONL line, from a file or gs://, with a progress bar.

use anyhow::Context;
use spotinfer::config::PublishArgs;
use spotinfer::external::gcs::Gcs;
use spotinfer::external::publish;
use spotinfer::external::pubsub::PubsubConfig;

/// Publishes every valid line; fails when any publish failed.
pub async fn run(a: PublishArgs) -> anyhow::Result<()> {
    let ps = PubsubConfig::from_args(&a.pubsub);
    let publisher = ps.publisher().await?;
    let data = match a.file.to_str().filter(|s| s.starts_with("gs://")) {
        Some(uri) => {
            Gcs::new(a.storage.storage_emulator_host.as_deref())
                .await?
                .read(uri, None)
                .await?
        }
        None => {
            std::fs::read(&a.file).with_context(|| format!("cannot read {}", a.file.display()))?
        }
    };
    let lines = std::io::Cursor::new(&data).lines_count()?;
    let progress = indicatif::ProgressBar::new(lines as u64).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} published {per_sec}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let input = std::io::Cursor::new(&data);
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

trait LinesCount {
    fn lines_count(self) -> std::io::Result<usize>;
}

impl<R: std::io::BufRead> LinesCount for R {
    fn lines_count(self) -> std::io::Result<usize> {
        let mut n = 0;
        for l in self.split(b'\n') {
            if !l?.iter().all(u8::is_ascii_whitespace) {
                n += 1;
            }
        }
        Ok(n)
    }
}
