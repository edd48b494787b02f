//! spotinfer's block products against llama.cpp's own (`bench/ggml_products.py`, ggml's
//! `mul_mat` on the same GGUF bytes and activation rows): per matrix, how many outputs are the
//! same bits and the largest difference relative to the largest output. ggml sums a row's
//! blocks in its own float order (lanes, FMA), so equal integer sums leave differences in the
//! last bits; a different rounding of the activations would leave ~1e-3.
//!
//!     cargo run --release --example ggml_products -- OUT_DIR
//!
//! Prints one JSON line per matrix.

use spotinfer_fused_cpu::{BlockFormat, BlockMatrix};

fn main() -> anyhow::Result<()> {
    let dir = std::path::PathBuf::from(
        std::env::args()
            .nth(1)
            .ok_or_else(|| anyhow::anyhow!("usage: ggml_products OUT_DIR"))?,
    );
    let index: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("index.json"))?)?;
    let floats = |path: std::path::PathBuf| -> anyhow::Result<Vec<f32>> {
        Ok(std::fs::read(path)?
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    };
    for entry in index {
        let name = entry["name"].as_str().unwrap_or_default();
        let field = |key: &str| entry[key].as_u64().unwrap_or_default() as usize;
        let format = BlockFormat::ALL
            .into_iter()
            .find(|f| Some(f.name()) == entry["format"].as_str())
            .ok_or_else(|| anyhow::anyhow!("{name}: format {}", entry["format"]))?;
        let weights = std::fs::read(dir.join(format!("{name}.w")))?;
        let matrix = BlockMatrix::new(format, field("rows"), field("k"), weights)
            .map_err(anyhow::Error::msg)?;
        let x = floats(dir.join(format!("{name}.x")))?;
        let want = floats(dir.join(format!("{name}.y")))?;
        let mut got = vec![0f32; want.len()];
        let kernels = matrix.product(&x, &mut got);
        let same = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() == b.to_bits());
        let largest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!(
            "{}",
            serde_json::json!({
                "matrix": name, "format": format.name(), "rows": field("m"),
                "outputs": want.len(), "same_bits": same.count(),
                "largest_difference_relative": worst / largest.max(f32::MIN_POSITIVE),
                "kernels": kernels,
            })
        );
    }
    Ok(())
}
