//! `spotinfer embed` and `spotinfer bench`: the model over a JSONL file, without Pub/Sub.

use spotinfer::config::{BenchArgs, EmbedArgs};
use spotinfer::jobs::{generation_bench, offline};
use spotinfer::model::Predict;
use std::time::Instant;

/// Runs the text model over a file into result lines: `{"id", …}` with the task's keys
/// (`embedding`; `label`, `score`, `scores`; `entities`).
pub async fn embed(mut a: EmbedArgs) -> anyhow::Result<()> {
    a.model.source.model = super::model_dir(&a.model).await?;
    tokio::task::spawn_blocking(move || embed_file(a)).await?
}

fn embed_file(a: EmbedArgs) -> anyhow::Result<()> {
    let model = super::load_text_model(&a.model.source.model, &a.model)?;
    let n = offline::embed_file(
        &model,
        &a.input,
        &a.output,
        a.model.max_text_bytes,
        a.batch.batch_size,
    )?;
    println!("embedded {n} records into {}", a.output.display());
    Ok(())
}

/// Measures model throughput; the last line printed is the JSON report.
pub async fn bench(mut a: BenchArgs) -> anyhow::Result<()> {
    a.model.source.model = super::model_dir(&a.model).await?;
    tokio::task::spawn_blocking(move || bench_file(a)).await?
}

fn bench_file(a: BenchArgs) -> anyhow::Result<()> {
    let records = offline::read_records(&a.input, a.model.max_text_bytes)?;
    let kind = spotinfer::model::load::ModelKind::detect(&a.model.source.model)?;
    if kind == spotinfer::model::load::ModelKind::Generation {
        return bench_generation(a, &records);
    }
    let started = Instant::now();
    let mut model = super::load_text_model(&a.model.source.model, &a.model)?;
    if a.profile_device {
        model = model.with_device_profile();
        anyhow::ensure!(
            model.device_stages().is_some(),
            "--profile-device times the candle encoder's device stages; this model runs on the \
             fused CPU encoder (add --backend candle)"
        );
    }
    let load_seconds = started.elapsed().as_secs_f64();
    let report = offline::bench(&model, &records, a.batch.batch_size, a.warmup, load_seconds)?;
    println!(
        "{} records, {} tokens in {:.3} s: {:.1} records/s, {:.0} tokens/s on {}; the model \
         computed {:.0}% of the time, tokenizing took {:.3} s beside it",
        report.records,
        report.tokens,
        report.seconds,
        report.records_per_s,
        report.tokens_per_s,
        report.device,
        report.model_busy * 100.0,
        report.tokenize_seconds
    );
    if let Some(check) = &report.precision {
        println!("precision: {check}");
    }
    if let Some(s) = &report.device_stages {
        println!(
            "device stages over {} encoder batches: inputs {:.3} s, layers {:.3} s, results {:.3} s",
            s.batches, s.inputs_s, s.encoder_s, s.outputs_s
        );
    }
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// `bench` on a generation model: each batch size asked in turn, one line each, then the JSON
/// report (a list, one object a batch size).
fn bench_generation(a: BenchArgs, records: &[spotinfer::record::Record]) -> anyhow::Result<()> {
    let prompts = generation_bench::prompts(records);
    anyhow::ensure!(
        !prompts.is_empty(),
        "{} holds no prompt record ({{\"id\", \"prompt\"}} or {{\"id\", \"messages\"}})",
        a.input.display()
    );
    let started = Instant::now();
    let task = super::open_generation_model(&a.model.source.model, &a.model)?;
    let load_seconds = started.elapsed().as_secs_f64();
    let device = task.info().device.clone();
    println!(
        "loaded {} in {load_seconds:.2} s on {device}",
        a.model.source.model.display()
    );
    let sizes = if a.batch_sizes.is_empty() {
        vec![a.batch.batch_size]
    } else {
        a.batch_sizes.clone()
    };
    let mut report = vec![];
    for batch_size in sizes {
        let b = generation_bench::bench(&task, &prompts, batch_size)?;
        println!(
            "batch {}: {} records ({} refused), {} prompt and {} generated tokens in {:.2} s: \
             {:.1} generated tokens/s, {:.1} prompt tokens/s, first token {:.3} s, peak {:.0} MiB",
            b.batch_size,
            b.records,
            b.refused,
            b.prompt_tokens,
            b.generated_tokens,
            b.seconds,
            b.generated_tokens_per_s,
            b.prompt_tokens_per_s,
            b.first_token_s,
            b.peak_rss_mib
        );
        report.push(
            serde_json::json!({ "device": device, "load_seconds": load_seconds, "bench": b }),
        );
    }
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
