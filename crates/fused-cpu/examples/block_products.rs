//! The GGUF block products alone: billions of multiply-adds a second of each block format's kernel,
//! one thread, 32 activation rows (a decoding step at batch 32; or `rows=`) by the matrices of a
//! Qwen2.5-0.5B-class model, weights in the cache (the same matrix again and again), with the CPU
//! model and the kernel that ran. For tuning the kernels against what the CPU can do
//! (`bench/vnni_peak.c` times the instructions alone); the figures of record come from `spotinfer
//! bench` and the llama.cpp comparisons (docs/benchmarks.md).
//!
//!     cargo run --release -p spotinfer-fused-cpu --example block_products -- [avx2|avx512] [rows=32] [stream] [ROUNDS] [FORMAT…]
//!
//! `avx2`: the kernels an AVX2-only CPU runs; `avx512`: those a CPU without AMX runs; `rows=`:
//! activation rows other than 32; `stream`: matrices larger than the caches (the output layer's
//! 151,936 × 896, a feed-forward 20 times as wide), read from memory each time as a decoding
//! step reads its weights.
//!
//! FORMAT: only these formats (llama.cpp's names, e.g. `Q5_0`).
//!
//! The blocks are random bytes with their f16 scales set to small normal numbers (random bits
//! there could be infinities or NaN), so every format multiplies values it could hold.

use spotinfer_fused_cpu::{BlockFormat, BlockMatrix, Widest};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let widest = match () {
        _ if args.iter().any(|a| a == "avx2") => Widest::Avx2,
        _ if args.iter().any(|a| a == "avx512") => Widest::NoAmx,
        _ => Widest::All,
    };
    let rounds: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(200);
    let only: Vec<&String> = args.iter().filter(|a| a.starts_with('Q')).collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("one thread");
    let rows = args
        .iter()
        .find_map(|a| a.strip_prefix("rows=")?.parse().ok())
        .unwrap_or(32);
    // (format, outputs, inputs): the Qwen2.5-0.5B Q4_K_M file's matrices (its 896-input ones
    // fall back to Q5_0 and Q8_0), and the other formats on the feed-forward's shapes.
    let streamed = [
        (BlockFormat::Q8_0, 151_936, 896),
        (BlockFormat::Q5_0, 151_936, 896),
        (BlockFormat::Q4K, 17_920, 4864),
        (BlockFormat::Q6K, 17_920, 4864),
    ];
    let cached = [
        (BlockFormat::Q5_0, 4864, 896),
        (BlockFormat::Q5_0, 896, 896),
        (BlockFormat::Q8_0, 4864, 896),
        (BlockFormat::Q4K, 896, 4864),
        (BlockFormat::Q6K, 896, 4864),
        (BlockFormat::Q4_0, 4864, 896),
        (BlockFormat::Q4_1, 4864, 896),
        (BlockFormat::Q5_1, 4864, 896),
        (BlockFormat::Q5K, 896, 4864),
    ];
    let cases: &[(BlockFormat, usize, usize)] = match args.iter().any(|a| a == "stream") {
        true => &streamed,
        false => &cached,
    };
    let mut seed = 7u64;
    for &(format, n, k) in cases {
        if !only.is_empty() && !only.iter().any(|f| *f == format.name()) {
            continue;
        }
        let matrix = BlockMatrix::new(format, n, k, blocks(format, n, k, &mut seed))
            .expect("matrix")
            .prepared(widest);
        let x: Vec<f32> = (0..rows * k)
            .map(|_| (next(&mut seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let mut out = vec![0f32; rows * n];
        let mut times: Vec<f64> = (0..5)
            .map(|_| {
                let start = Instant::now();
                pool.install(|| {
                    for _ in 0..rounds {
                        matrix.apply(&x, &mut out);
                    }
                });
                start.elapsed().as_secs_f64() / rounds as f64
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let macs = (rows * n * k) as f64;
        println!(
            "{}",
            serde_json::json!({
                "cpu": cpu_model(), "kernels": matrix.kernels(), "format": format.name(),
                "rows": rows, "outputs": n, "inputs": k, "threads": 1,
                "ms": times[2] * 1e3, "gmacs": macs / times[2] / 1e9,
                "gmacs_all": times.iter().map(|t| (macs / t / 1e8).round() / 10.0).collect::<Vec<_>>(),
            })
        );
    }
}

/// `n` rows of `k / block_weights` random blocks of `format`, each scale a small normal f16.
fn blocks(format: BlockFormat, n: usize, k: usize, seed: &mut u64) -> Vec<u8> {
    let (size, count) = (format.block_bytes(), n * k / format.block_weights());
    let mut data: Vec<u8> = (0..size * count).map(|_| next(seed) as u8).collect();
    // Where each format keeps its f16 scale (and minimum, or minimum's scale).
    let scales: &[usize] = match format {
        BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => &[0],
        BlockFormat::Q4_1 | BlockFormat::Q5_1 | BlockFormat::Q4K | BlockFormat::Q5K => &[0, 2],
        BlockFormat::Q6K => &[208],
    };
    for block in data.chunks_exact_mut(size) {
        for &at in scales {
            let scale = half::f16::from_f32(0.001 + (next(seed) % 1000) as f32 * 1e-5);
            block[at..at + 2].copy_from_slice(&scale.to_le_bytes());
        }
    }
    data
}

fn next(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    *seed >> 33
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}
