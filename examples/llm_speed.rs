//! spotinfer's generation speed on a model, batched as the worker batches: B requests given to
//! the decode loop at once (each prompt read whole when it joins, then one token per sequence
//! per step), greedy, each stopping at its end token or after N new tokens. The counterpart of
//! `bench/llm_speed.py` (llama.cpp) on the same prompt ids.
//!
//!     cargo run --release --example llm_speed -- MODEL PROMPTS.json B N [f32|bf16|gguf] [avx2|avx512]
//!
//! PROMPTS.json: {"cases": [{"messages": [...]}, ...]} as `bench/llm_greedy.py` writes it. Prints
//! one JSON line: generated tokens, seconds (prompt processing included), tokens/s. `avx2`: the
//! dense layers held to what an AVX2-only CPU runs (`--cpu-kernels avx2`), whatever this one has;
//! `avx512`: to what a CPU without AMX runs (`--cpu-kernels avx512`).

use spotinfer::model::engines::decoder::{
    Build, DecoderPrecision, Generated, Interrupt, LanguageModel, Message, Prompt, Request,
};
use spotinfer::model::CpuKernels;

fn main() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().collect();
    let kernels = match args.last().map(String::as_str) {
        Some("avx2") => {
            args.pop();
            CpuKernels::Avx2
        }
        Some("avx512") => {
            args.pop();
            CpuKernels::Avx512
        }
        _ => CpuKernels::Auto,
    };
    let (model, prompts, b, n, precision) = match args.as_slice() {
        [_, m, p, b, n] => (m, p, b, n, DecoderPrecision::F32),
        [_, m, p, b, n, bf16] if bf16 == "bf16" => (m, p, b, n, DecoderPrecision::Bf16),
        [_, m, p, b, n, f32] if f32 == "f32" => (m, p, b, n, DecoderPrecision::F32),
        [_, m, p, b, n, gguf] if gguf == "gguf" => (m, p, b, n, DecoderPrecision::Gguf),
        _ => anyhow::bail!("usage: llm_speed MODEL PROMPTS.json B N [f32|bf16|gguf] [avx2|avx512]"),
    };
    let (b, n): (usize, usize) = (b.parse()?, n.parse()?);
    let model =
        LanguageModel::open_as(std::path::Path::new(model), &Build::Cpu(precision, kernels))?;
    let refs: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(prompts)?)?;
    let requests: Vec<Request> = refs["cases"]
        .as_array()
        .into_iter()
        .flatten()
        .take(b)
        .map(|c| -> anyhow::Result<Request> {
            let messages: Vec<Message> = serde_json::from_value(c["messages"].clone())?;
            Ok(Request::greedy(Prompt::Chat(messages), n))
        })
        .collect::<Result<_, _>>()?;
    let started = std::time::Instant::now();
    let out = model.generate(&requests, 0, &Interrupt::new(), None);
    let seconds = started.elapsed().as_secs_f64();
    let tokens: usize = out
        .iter()
        .map(|g| match g {
            Generated::Done(c) => c.completion_tokens,
            _ => 0,
        })
        .sum();
    println!(
        "{}",
        serde_json::json!({
            "side": "spotinfer", "batch": b, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens as f64 / seconds, "kernels": model.kernels(),
            "precision": format!("{:?}", model.precision()),
            "format": model.format, "threads": rayon::current_num_threads(),
        })
    );
    Ok(())
}
