//! `spotinfer models check`: what spotinfer understands of a model folder, proven by loading it
//! and embedding one text, or the exact reason it is refused.

use spotinfer::config::{ModelsArgs, ModelsCommand};
use spotinfer::model::DeviceChoice;
use spotinfer::model::{Embedder, LoadOptions, ModelSpec};

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
            let embedder = tokio::task::spawn_blocking(move || -> anyhow::Result<Embedder> {
                let e = Embedder::open(&dir, &options)?;
                e.embed(&["spotinfer checks this model"])?;
                Ok(e)
            })
            .await??;
            let info = embedder.info();
            println!("name:           {}", info.name);
            println!("weights hash:   {}", info.hash);
            println!("loaded on:      {} and embedded a text", info.device);
            println!("ok");
            Ok(())
        }
    }
}
