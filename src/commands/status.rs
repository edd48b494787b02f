//! `spotinfer status`: done and failed counts, or one job's progress: N of M, the input lines
//! its publishes refused, the last minute's rate, the ETA and whether it is complete (once, as
//! JSON, or redrawn until complete).

use spotinfer::config::StatusArgs;
use spotinfer::external::store::{JobStatus, Store, StoreError};

/// Prints the counts, for one job or all.
pub async fn run(a: StatusArgs) -> anyhow::Result<()> {
    let store = Store::connect(&a.db.database_url).await?;
    store.migrate().await?;
    let Some(job) = &a.job else {
        let c = store.status(None).await?;
        println!("{} done, {} failed", c.done, c.failed);
        return Ok(());
    };
    if let Err(e @ StoreError::UnknownJob(_)) = store.job_model(job).await {
        // Records published without --job may still carry the tag: say what they add up to.
        let tagged = store.status(Some(job)).await?;
        anyhow::bail!(
            "{e}; rows tagged with it: {} done, {} failed",
            tagged.done,
            tagged.failed
        );
    }
    if !a.watch {
        let s = store.job_status(job).await?;
        print_once(&s, a.json)?;
        return Ok(());
    }
    watch(&store, job, &a).await
}

fn print_once(s: &JobStatus, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
    } else {
        println!("{}", summary(s));
    }
    Ok(())
}

/// Redraws the job's progress every `--interval` until it is complete (JSON: one line each time).
async fn watch(store: &Store, job: &str, a: &StatusArgs) -> anyhow::Result<()> {
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} settled  {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut tick = tokio::time::interval(a.interval);
    loop {
        tick.tick().await;
        let s = store.job_status(job).await?;
        if a.json {
            println!("{}", serde_json::to_string(&s)?);
        } else {
            bar.set_length(s.published.max(0) as u64);
            bar.set_position((s.done + s.failed).max(0) as u64);
            bar.set_message(rate_and_eta(&s));
        }
        if s.complete {
            bar.finish_and_clear();
            if !a.json {
                println!("{}", summary(&s));
            }
            return Ok(());
        }
    }
}

/// The human summary.
pub fn summary(s: &JobStatus) -> String {
    let pct = |n: i64| {
        if s.published > 0 {
            format!(" ({:.1}%)", 100.0 * n as f64 / s.published as f64)
        } else {
            String::new()
        }
    };
    let state = if s.complete {
        "complete"
    } else if s.publishing {
        "in progress (a publish to this job is running, or was interrupted: re-run it)"
    } else {
        "in progress"
    };
    format!(
        "job {} (model {}): {state}\n  published  {}\n  done       {}{}\n  failed     {}{}\n  remaining  {}\n  refused    {} input lines (never published; `export --failed` lists them)\n  {}",
        s.job,
        s.model,
        s.published,
        s.done,
        pct(s.done),
        s.failed,
        pct(s.failed),
        s.remaining,
        s.refused,
        rate_and_eta(s),
    )
}

fn rate_and_eta(s: &JobStatus) -> String {
    let eta = match s.eta_seconds {
        Some(t) if s.remaining > 0 => {
            humantime::format_duration(std::time::Duration::from_secs(t.ceil() as u64)).to_string()
        }
        Some(_) => "none left".to_string(),
        None => "unknown (nothing committed in the last minute)".to_string(),
    };
    format!(
        "{:.1} records/s over the last minute, ETA {eta}",
        s.records_per_s
    )
}
