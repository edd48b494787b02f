//! `spotinfer models check`: what spotinfer understands of a model folder, proven by loading it
//! and running it on one input (a text, or a pair for a cross-encoder), or the exact reason it
//! is refused.

use spotinfer::config::{ModelsArgs, ModelsCommand};
use spotinfer::model::load::ModelKind;
use spotinfer::model::{
    probe_images, Backend, DeviceChoice, ImageTask, Item, Predict, Reads, Text,
};
use spotinfer::model::{Input, LoadOptions, ModelSpec, Output, TextModel};

/// Runs a `models` subcommand.
pub async fn run(a: ModelsArgs) -> anyhow::Result<()> {
    match a.action {
        ModelsCommand::Check(c) => {
            let dir = super::fetch_model(&c.dir, &c.storage).await?;
            match ModelKind::detect(&dir)? {
                ModelKind::Image => return check_image_model(dir, c.backend).await,
                ModelKind::Generation => return check_generation_model(dir, c.precision).await,
                ModelKind::Text => {}
            }
            let spec = ModelSpec::read(&dir)?;
            print!("{spec}");
            let options = LoadOptions {
                backend: c.backend,
                precision: c.precision,
                ..LoadOptions::new(DeviceChoice::Cpu)
            };
            let (model, output) =
                tokio::task::spawn_blocking(move || -> anyhow::Result<(TextModel, Output)> {
                    let e = TextModel::open(&dir, &options)?;
                    let input = Input {
                        text: "spotinfer checks this model",
                        text_pair: e.info().task.needs_pairs().then_some("on one input"),
                        prompt_name: None,
                    };
                    let mut out = e.predict(&[input])?.outputs;
                    let output = out.pop().unwrap_or(Output::Embedding(Vec::new()));
                    Ok((e, output))
                })
                .await??;
            let info = model.info();
            println!("name:           {}", info.name);
            println!("weights hash:   {}", info.hash);
            println!("loaded on:      {} and ran one input", info.device);
            if let Some(check) = model.precision_check() {
                println!("precision:      {check}");
            }
            println!("computed:       {}", summary(&output));
            println!("ok");
            Ok(())
        }
        ModelsCommand::Kernels(k) => {
            let checks = tokio::task::spawn_blocking(move || match k.paged {
                true => spotinfer::model::check_paged_kernels(k.device, &k.dir),
                false => spotinfer::model::check_unpadded_kernels(&k.dir, k.device, &k.lengths),
            })
            .await??;
            for check in &checks {
                println!("{}", serde_json::to_string(check)?);
            }
            let failed: Vec<String> = checks
                .iter()
                .filter(|c| !c.passed)
                .map(|c| format!("{} {} {}", c.op, c.dtype, c.shape))
                .collect();
            anyhow::ensure!(failed.is_empty(), "past the bar: {}", failed.join("; "));
            println!("ok: {} operations within their bars", checks.len());
            Ok(())
        }
        ModelsCommand::Agree(a) => {
            let line = tokio::task::spawn_blocking(move || agree(&a)).await??;
            println!("{line}");
            Ok(())
        }
    }
}

/// One sequence of `models agree`: token ids, where the other engine's part starts, and that
/// engine's greedy choice after each position from `from - 1` on.
#[derive(serde::Deserialize)]
struct Sequence {
    ids: Vec<u32>,
    from: usize,
    top1: Vec<u32>,
}

/// `models agree`: the model's teacher-forced greedy choices against the other engine's.
fn agree(a: &spotinfer::config::ModelAgreeArgs) -> anyhow::Result<serde_json::Value> {
    use spotinfer::model::{argmax, LanguageModel};
    use spotinfer::model::{decoder_build, decoder_precision, GenerationDefaults};
    let options = LoadOptions {
        backend: a.backend,
        precision: a.precision,
        ..LoadOptions::new(a.device)
    };
    let precision = decoder_precision(a.precision).map_err(anyhow::Error::msg)?;
    let build = decoder_build(&options, precision, &GenerationDefaults::default())
        .map_err(anyhow::Error::msg)?;
    let model = LanguageModel::open_as(&a.model, &build)?;
    let vocab = model.vocab();
    let (mut agreed, mut total, mut sequences) = (0usize, 0usize, 0usize);
    for (n, line) in std::fs::read_to_string(&a.sequences)?.lines().enumerate() {
        let s: Sequence = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("{}:{}: {e}", a.sequences.display(), n + 1))?;
        anyhow::ensure!(
            s.from >= 1 && s.from + s.top1.len() <= s.ids.len() + 1,
            "line {}: `from` {} and {} top-1 ids do not fit {} ids",
            n + 1,
            s.from,
            s.top1.len(),
            s.ids.len()
        );
        let logits = model.teacher_forced(&s.ids)?;
        let rows = logits.chunks(vocab).skip(s.from - 1);
        agreed += rows
            .zip(&s.top1)
            .filter(|(row, &t)| argmax(row) == t)
            .count();
        total += s.top1.len();
        sequences += 1;
    }
    Ok(serde_json::json!({
        "agree": agreed,
        "total": total,
        "sequences": sequences,
        "device": model.kernels(),
    }))
}

/// The check for an image model: loaded, then run on one generated image (and one text, for
/// CLIP and SigLIP).
async fn check_image_model(dir: std::path::PathBuf, backend: Backend) -> anyhow::Result<()> {
    let options = LoadOptions {
        backend,
        ..LoadOptions::new(DeviceChoice::Cpu)
    };
    let (model, outputs) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let model = ImageTask::open(&dir, &options)?;
        let pixels = model
            .info()
            .processor
            .as_ref()
            .and_then(|p| probe_images(p).into_iter().next())
            .ok_or_else(|| anyhow::anyhow!("the processor gives no pixel values"))?;
        let mut items = vec![Item::Pixels(pixels.into())];
        if model.info().reads.texts() {
            items.push(Item::Text(Text::from("a photograph".to_string())));
        }
        let outputs = model.predict_items(&items)?.outputs;
        Ok((model, outputs))
    })
    .await??;
    let info = model.info();
    let reads = match info.reads {
        Reads::Images => "images",
        _ => "images and texts",
    };
    println!(
        "task:           {} (an image model: reads {reads})",
        info.task.name()
    );
    if !info.labels.is_empty() {
        println!("labels:         {}", info.labels.join(", "));
    }
    println!("name:           {}", info.name);
    println!("weights hash:   {}", info.hash);
    println!("loaded on:      {} and ran one image", info.device);
    for output in &outputs {
        println!("computed:       {}", summary(output));
    }
    println!("ok");
    Ok(())
}

/// The check for a generation model: loaded, then asked for eight greedy tokens of a chat
/// answer (a raw prompt where it has no chat template).
async fn check_generation_model(
    path: std::path::PathBuf,
    precision: spotinfer::model::Precision,
) -> anyhow::Result<()> {
    use spotinfer::model::{GenerateTask, GenerationDefaults};
    use spotinfer::record::generation::{Input, Message, Prompt};
    let (task, output) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let options = LoadOptions::new(DeviceChoice::Cpu).precision(precision);
        let defaults = GenerationDefaults {
            max_new_tokens: 8,
            ..GenerationDefaults::default()
        };
        let task = GenerateTask::open_uninterrupted(&path, &options, defaults)?;
        let input = Input {
            prompt: Prompt::Chat(vec![Message {
                role: "user".into(),
                content: "What is a spot node?".into(),
            }]),
            max_new_tokens: None,
            temperature: None,
            top_p: None,
            top_k: None,
            seed: 0,
            stop: Vec::new(),
            constraint: None,
        };
        let mut out = task
            .predict_items(&[Item::Generate(input.into(), Vec::new())])?
            .outputs;
        let output = out.pop().unwrap_or(Output::Refused("no output".into()));
        Ok((task, output))
    })
    .await??;
    let info = task.info();
    println!("task:           generate (a decoder LLM: reads prompts and conversations)");
    println!("context:        {} tokens", info.max_seq_len);
    println!("name:           {}", info.name);
    println!("weights hash:   {}", info.hash);
    println!("loaded on:      {} and answered one chat turn", info.device);
    println!("computed:       {}", summary(&output));
    println!("ok");
    Ok(())
}

/// One line on what the model computed for the check's input.
fn summary(output: &Output) -> String {
    match output {
        Output::Embedding(v) => format!("a vector of {} floats", v.len()),
        Output::Classes { label, score, .. } => format!("label {label} (score {score:.4})"),
        Output::Score(s) => format!("score {s:.4}"),
        Output::Entities(e) => format!("{} entities", e.len()),
        Output::Generated(c) => format!(
            "{} tokens ({}): {:?}",
            c.completion_tokens,
            c.finish_reason.as_str(),
            c.text
        ),
        Output::Refused(why) => format!("refused: {why}"),
        Output::Interrupted(t) => format!("interrupted after {} tokens", t.len()),
    }
}
