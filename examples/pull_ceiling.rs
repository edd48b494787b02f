//! The Pub/Sub endpoint's own delivery rate, with nothing behind it: N streaming pulls, every
//! message acked as it arrives, no parsing, model or database. Beside the worker's end-to-end
//! rate it shows how much of the ceiling is the endpoint's (the emulator's, here) rather than
//! the worker's. bench/ceiling.sh runs it; docs/benchmarks.md has the figures.
//!
//!     cargo run --release --example pull_ceiling -- --subscription S --streams 8 --messages 20000

use clap::Parser;
use spotinfer::config::PubsubArgs;
use std::time::Instant;

/// Pull and ack only, and print messages/s.
#[derive(Parser)]
struct Args {
    #[command(flatten)]
    pubsub: PubsubArgs,
    /// Streaming pulls.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Flow control per stream (the worker's is its window over its streams).
    #[arg(long, default_value_t = 1250)]
    max_outstanding: i64,
    /// Stop after this many messages.
    #[arg(long)]
    messages: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let cfg = a.pubsub.config();
    let subscriber = cfg.subscriber(a.streams).await?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    for _ in 0..a.streams {
        let mut stream = subscriber
            .subscribe(&cfg.subscription)
            .set_max_outstanding_messages(a.max_outstanding)
            .build();
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Some(Ok((_, handler))) = stream.next().await {
                handler.ack();
                if tx.send(Instant::now()).is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);
    let first = rx
        .recv()
        .await
        .ok_or_else(|| anyhow::anyhow!("no message"))?;
    let mut last = first;
    let mut count = 1u64;
    while count < a.messages {
        let Some(at) = rx.recv().await else { break };
        last = at;
        count += 1;
    }
    let seconds = last.duration_since(first).as_secs_f64().max(1e-9);
    println!(
        "{}",
        serde_json::json!({
            "messages": count,
            "streams": a.streams,
            "seconds": seconds,
            "messages_per_s": (count - 1) as f64 / seconds,
        })
    );
    Ok(())
}
