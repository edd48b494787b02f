//! Images/s of an image model folder on this machine's CPU, split into decode, preprocess and
//! network: the first speed figures of issue 29, before images reach `spotinfer bench`.
//! `bench/image_peer.py` is the transformers side of the same measurement.
//!
//!     cargo run --release --example image_speed -- --model DIR --photos DIR [--batch 16]
//!
//! Prints one JSON line: images, seconds per stage (decode and preprocess on the calling thread,
//! one image after another; the network in batches), images/s end to end.

use clap::Parser;
use spotinfer::model::image::decode::decode;
use spotinfer::model::image::towers::ImageModel;
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
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let model = ImageModel::load(&a.model, &candle_core::Device::Cpu)?;
    let mut files: Vec<Vec<u8>> = Vec::new();
    for entry in std::fs::read_dir(&a.photos)? {
        files.push(std::fs::read(entry?.path())?);
    }
    let files: Vec<Vec<u8>> = (0..a.rounds).flat_map(|_| files.clone()).collect();
    // One warm-up batch, untimed.
    let warm = decode(&files[0], u64::MAX)?;
    let warm = model
        .processor
        .pixel_values(&warm)
        .ok_or_else(|| anyhow::anyhow!("cannot preprocess"))?;
    model.images(&[warm])?;
    let (mut decode_s, mut prep_s, mut net_s) = (0.0, 0.0, 0.0);
    let all = Instant::now();
    for chunk in files.chunks(a.batch) {
        let mut pixels = Vec::with_capacity(chunk.len());
        for bytes in chunk {
            let t = Instant::now();
            let img = decode(bytes, u64::MAX)?;
            decode_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            pixels.push(
                model
                    .processor
                    .pixel_values(&img)
                    .ok_or_else(|| anyhow::anyhow!("cannot preprocess"))?,
            );
            prep_s += t.elapsed().as_secs_f64();
        }
        let t = Instant::now();
        model.images(&pixels)?;
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
        })
    );
    Ok(())
}
