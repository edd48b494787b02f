//! What reading a shared system prompt once saves (issue 55): N chat requests with one system
//! prompt of about 500 tokens and a question of about 50 each (real texts, from PROMPTS.json),
//! run through the decode loop as the worker runs a batch, with the shared prefix read once and
//! with every prompt read whole, alternated for ROUNDS rounds. Prints each run's tokens/s, the
//! medians, their ratio, and whether every answer was the same both ways.
//!
//!     cargo run --release --example prefix_speed -- MODEL PROMPTS.json N NEW_TOKENS [f32|gguf] [ROUNDS]

use spotinfer::model::engines::decoder::{
    DecoderPrecision, Generated, Interrupt, LanguageModel, Message, Prompt, Request, Scheduler,
};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, model, prompts, n, new_tokens, rest @ ..] = args.as_slice() else {
        anyhow::bail!("usage: prefix_speed MODEL PROMPTS.json N NEW_TOKENS [f32|gguf] [ROUNDS]");
    };
    let precision = match rest.first().map(String::as_str) {
        Some("gguf") => DecoderPrecision::Gguf,
        _ => DecoderPrecision::F32,
    };
    let rounds: usize = rest.get(1).map_or(Ok(3), |r| r.parse())?;
    let (n, new_tokens): (usize, usize) = (n.parse()?, new_tokens.parse()?);
    let model = LanguageModel::open_in(std::path::Path::new(model), precision)?;
    let refs: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(prompts)?)?;
    let mut texts = refs["cases"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["messages"][0]["content"].as_str().map(str::to_owned))
        .cycle();
    let count = |text: &str| {
        model
            .prompt_ids(&Prompt::Raw(text.to_owned()))
            .map(|t| t.len())
    };
    let mut take_until = |tokens: usize| -> anyhow::Result<String> {
        let mut text = String::new();
        while count(&text).map_err(anyhow::Error::msg)? < tokens {
            text = format!("{text} {}", texts.next().unwrap_or_default());
        }
        Ok(text.trim().to_owned())
    };
    let system = take_until(500)?;
    let mut requests = Vec::with_capacity(n);
    for _ in 0..n {
        let messages = vec![
            Message {
                role: "system".into(),
                content: system.clone(),
            },
            Message {
                role: "user".into(),
                content: take_until(50)?,
            },
        ];
        requests.push(Request::greedy(Prompt::Chat(messages), new_tokens));
    }
    let prompt_tokens: usize = requests
        .iter()
        .map(|r| model.prompt_ids(&r.prompt).map(|t| t.len()))
        .sum::<Result<usize, String>>()
        .map_err(anyhow::Error::msg)?;
    let run = |share: bool| {
        let mut scheduler = Scheduler::new(0, None);
        if !share {
            scheduler = scheduler.without_shared_prefixes();
        }
        let started = Instant::now();
        scheduler.admit(&model, 0, requests.clone());
        let results = loop {
            if let Some((_, r)) = scheduler.step(&model, &Interrupt::new()).pop() {
                break r;
            }
        };
        let seconds = started.elapsed().as_secs_f64();
        let answers: Vec<Vec<u32>> = results
            .iter()
            .map(|g| match g {
                Generated::Done(c) => c.tokens.clone(),
                _ => Vec::new(),
            })
            .collect();
        let generated: usize = answers.iter().map(Vec::len).sum();
        (
            generated as f64 / seconds,
            answers,
            scheduler.shared_tokens(),
        )
    };
    let (mut shared, mut whole, mut same) = (Vec::new(), Vec::new(), true);
    for round in 0..rounds {
        let order = if round % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        let mut answers = Vec::new();
        for share in order {
            let (rate, a, saved) = run(share);
            println!("round {} shared={share}: {rate:.2} generated tokens/s ({saved} prompt tokens not read again)", round + 1);
            (if share { &mut shared } else { &mut whole }).push(rate);
            answers.push(a);
        }
        same &= answers[0] == answers[1];
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (s, w) = (median(&mut shared), median(&mut whole));
    println!(
        "{}",
        serde_json::json!({
            "requests": n, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "precision": format!("{:?}", model.precision()), "kernels": model.kernels(),
            "shared_tokens_per_s": s, "whole_tokens_per_s": w, "ratio": s / w,
            "answers_identical": same,
            "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        })
    );
    Ok(())
}
