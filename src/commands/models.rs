//! `spotinfer models check`: what spotinfer understands of a model folder, proven by loading it
//! and running it on one input (a text, or a pair for a cross-encoder), or the exact reason it
//! is refused.

use spotinfer::config::{ModelsArgs, ModelsCommand};
use spotinfer::model::DeviceChoice;
use spotinfer::model::{Input, LoadOptions, Model, ModelSpec, Output};

/// Runs a `models` subcommand.
pub async fn run(a: ModelsArgs) -> anyhow::Result<()> {
    match a.action {
        ModelsCommand::Check(c) => {
            let dir = super::fetch_model(&c.dir, &c.storage).await?;
            let spec = ModelSpec::read(&dir)?;
            print!("{spec}");
            let options = LoadOptions {
                backend: c.backend,
                ..LoadOptions::new(DeviceChoice::Cpu)
            };
            let (embedder, output) =
                tokio::task::spawn_blocking(move || -> anyhow::Result<(Model, Output)> {
                    let e = Model::open(&dir, &options)?;
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
            let info = embedder.info();
            println!("name:           {}", info.name);
            println!("weights hash:   {}", info.hash);
            println!("loaded on:      {} and ran one input", info.device);
            println!("computed:       {}", summary(&output));
            println!("ok");
            Ok(())
        }
    }
}

/// One line on what the model computed for the check's input.
fn summary(output: &Output) -> String {
    match output {
        Output::Embedding(v) => format!("a vector of {} floats", v.len()),
        Output::Classes { label, score, .. } => format!("label {label} (score {score:.4})"),
        Output::Score(s) => format!("score {s:.4}"),
        Output::Entities(e) => format!("{} entities", e.len()),
    }
}
