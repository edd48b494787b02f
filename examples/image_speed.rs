//! Images/s of an image model folder on this machine's CPU, split into decode, preprocess and
//! network; `bench/images.py` runs it beside `bench/image_peer.py` (transformers), alternated.
//!
//!     cargo run --release --example image_speed -- --model DIR --photos DIR \
//!         [--batch 16] [--backend auto|candle] [--precision auto|f32|bf16]
//!
//! Prints one JSON line: images, seconds per stage (decode and preprocess on the calling thread,
//! one image after another; the network in batches, as the model thread runs it), images/s end
//! to end, and the engine, precision and kernels that ran.

use clap::Parser;
use spotinfer::model::image::decode::decode;
use spotinfer::model::{Backend, DeviceChoice, ImageTask, Item, LoadOptions, Precision, Predict};
use std::path::PathBuf;
use std::time::Instant;

/// Time an image model over a folder of photographs.
#[derive(Parser)]
struct Args {
    /// The model folder (CLIPModel, SiglipModel or ViTForImageClassification).
    #[arg(long)]
    model: PathBuf,
    /// A folder of image files, each read once per round.
    #[arg(long)]
    photos: PathBuf,
    /// Images per network batch.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Passes over the folder.
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// `auto` (the CPU image tower where the model has one) or `candle`.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// `auto`, `f32` or `bf16`.
    #[arg(long, default_value = "auto")]
    precision: String,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let options = LoadOptions {
        backend: match a.backend.as_str() {
            "candle" => Backend::Candle,
            _ => Backend::Auto,
        },
        precision: match a.precision.as_str() {
            "f32" => Precision::F32,
            "bf16" => Precision::Bf16,
            "int8" => Precision::Int8,
            _ => Precision::Auto,
        },
        ..LoadOptions::new(DeviceChoice::Cpu)
    };
    let model = ImageTask::open(&a.model, &options)?;
    let processor = model
        .info()
        .processor
        .clone()
        .ok_or_else(|| anyhow::anyhow!("not an image model"))?;
    let mut names: Vec<PathBuf> = std::fs::read_dir(&a.photos)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    names.sort();
    let mut files: Vec<Vec<u8>> = Vec::new();
    for name in &names {
        files.push(std::fs::read(name)?);
    }
    let files: Vec<Vec<u8>> = (0..a.rounds).flat_map(|_| files.clone()).collect();
    // One warm-up batch, untimed.
    let warm = processor.prepare(&files[0], u64::MAX)?;
    model.predict_items(&[Item::Pixels(warm.into())])?;
    let (mut decode_s, mut prep_s, mut net_s) = (0.0, 0.0, 0.0);
    let all = Instant::now();
    for chunk in files.chunks(a.batch) {
        let mut items = Vec::with_capacity(chunk.len());
        for bytes in chunk {
            let t = Instant::now();
            let img = decode(bytes, u64::MAX)?;
            decode_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let pixels = processor
                .pixel_values(&img)
                .ok_or_else(|| anyhow::anyhow!("cannot preprocess"))?;
            items.push(Item::Pixels(pixels.into()));
            prep_s += t.elapsed().as_secs_f64();
        }
        let t = Instant::now();
        model.predict_items(&items)?;
        net_s += t.elapsed().as_secs_f64();
    }
    let total = all.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({
            "images": files.len(),
            "decode_s": decode_s,
            "preprocess_s": prep_s,
            "network_s": net_s,
            "seconds": total,
            "images_per_s": files.len() as f64 / total,
            "batch": a.batch,
            "engine": model.info().device,
        })
    );
    Ok(())
}
