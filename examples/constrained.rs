//! Constrained generation's cost and effect (issue 56): N extraction prompts over real texts
//! (RECORDS.jsonl, `{"id", "text"}` lines as `bench/real_corpus.py` writes them), the schema of
//! tests/fixtures/llm/extraction_schema.json in a shared system prompt, run through the decode
//! loop B at a time: constrained greedy, unconstrained greedy and constrained seeded sampling
//! (temperature 0.8, top-p 0.95), alternated for ROUNDS rounds. The unconstrained run may write
//! each prompt as many tokens as its constrained answer took (an unconstrained answer runs on to
//! the length limit far more often, and a batch's speed depends on how long its rows run), so
//! the two runs' tokens/s compare like for like. Prints each run's generated tokens/s and the
//! medians' ratio, and writes every answer's text to OUT.json
//! (`{"schema", "constrained", "unconstrained", "sampled"}`) for `bench/constrained.sh` to
//! validate with Python's `jsonschema`.
//!
//!     cargo run --release --example constrained -- MODEL RECORDS.jsonl N B OUT.json [f32|gguf] [ROUNDS]

use serde_json::{json, Value};
use spotinfer::model::engines::decoder::{
    Constraint, DecoderPrecision, Generated, Interrupt, LanguageModel, Message, Prompt, Request,
};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, model, records, n, b, out, rest @ ..] = args.as_slice() else {
        anyhow::bail!("usage: constrained MODEL RECORDS.jsonl N B OUT.json [f32|gguf] [ROUNDS]");
    };
    let precision = match rest.first().map(String::as_str) {
        Some("gguf") => DecoderPrecision::Gguf,
        _ => DecoderPrecision::F32,
    };
    let rounds: usize = rest.get(1).map_or(Ok(1), |r| r.parse())?;
    let (n, b): (usize, usize) = (n.parse()?, b.parse()?);
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/llm/extraction_schema.json"
    ))?)?;
    let system = format!("Label the user's text. Answer with JSON matching this schema: {schema}");
    let texts: Vec<String> = std::fs::read_to_string(records)?
        .lines()
        .take(n)
        .map(|l| -> anyhow::Result<String> {
            let v: Value = serde_json::from_str(l)?;
            Ok(v["text"].as_str().unwrap_or_default().to_string())
        })
        .collect::<Result<_, _>>()?;
    let model = LanguageModel::open_in(std::path::Path::new(model), precision)?;
    let request = |text: &str, constrained: bool, seed: Option<u64>, most: usize| {
        let chat = vec![
            Message {
                role: "system".into(),
                content: system.clone(),
            },
            Message {
                role: "user".into(),
                content: text.into(),
            },
        ];
        let mut r = Request::greedy(Prompt::Chat(chat), most);
        r.constraint = constrained.then(|| Constraint::JsonSchema(schema.clone()));
        if let Some(seed) = seed {
            r.sampling.temperature = 0.8;
            r.sampling.top_p = 0.95;
            r.sampling.seed = seed;
        }
        r
    };
    let kinds = ["constrained", "unconstrained", "sampled"];
    let mut speeds: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    let mut answers: Vec<Vec<String>> = vec![Vec::new(); kinds.len()];
    let mut lengths = vec![256; texts.len()];
    for round in 0..rounds {
        for (k, kind) in kinds.iter().enumerate() {
            let requests: Vec<Request> = texts
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let most = if k == 1 { lengths[i] } else { 256 };
                    request(t, k != 1, (k == 2).then_some(i as u64), most)
                })
                .collect();
            let (texts, counts, seconds) = run(&model, &requests, b)?;
            if k == 0 {
                lengths = counts.clone();
            }
            let tokens: usize = counts.iter().sum();
            let speed = tokens as f64 / seconds;
            println!(
                "{}",
                json!({"round": round, "kind": kind, "tokens": tokens, "seconds": seconds,
                       "tokens_per_s": speed, "batch": b, "kernels": model.kernels()})
            );
            speeds[k].push(speed);
            answers[k] = texts;
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (c, u) = (median(&mut speeds[0]), median(&mut speeds[1]));
    println!(
        "{}",
        json!({"constrained_tokens_per_s": c, "unconstrained_tokens_per_s": u, "ratio": c / u})
    );
    let written = json!({"schema": schema, "constrained": answers[0],
                         "unconstrained": answers[1], "sampled": answers[2]});
    std::fs::write(out, written.to_string())?;
    Ok(())
}

/// Every request's text and tokens generated, B at a time; the seconds taken.
fn run(
    model: &LanguageModel,
    requests: &[Request],
    b: usize,
) -> anyhow::Result<(Vec<String>, Vec<usize>, f64)> {
    let started = Instant::now();
    let (mut texts, mut tokens) = (Vec::new(), Vec::new());
    for chunk in requests.chunks(b) {
        for g in model.generate(chunk, 0, &Interrupt::new(), None) {
            match g {
                Generated::Done(c) => {
                    tokens.push(c.completion_tokens);
                    texts.push(c.text);
                }
                other => anyhow::bail!("not completed: {other:?}"),
            }
        }
    }
    Ok((texts, tokens, started.elapsed().as_secs_f64()))
}
