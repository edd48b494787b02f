//! The encoder alone in f32, bf16 and int8, alternated: records/s of each (with the kernels
//! that ran and the CPU model) and the worst cosine of bf16's and int8's vectors against f32's,
//! on random token ids of realistic lengths. For tuning the kernels; the figures of record come
//! from `spotinfer bench` and bench/compare.py.
//!
//!     cargo run --release -p spotinfer-fused-cpu --example precision -- MODEL.safetensors [ROUNDS]
//!
//! The shape is all-MiniLM-L6-v2's (384 wide, 6 layers, 12 heads, 1536 feed-forward).

use spotinfer_fused_cpu::{CpuBert, Dims, Layout, Pooling, Precision, Tokens};
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: precision MODEL.safetensors [ROUNDS]");
    let rounds: usize = args.next().map_or(5, |r| r.parse().expect("ROUNDS"));
    let dims = Dims {
        hidden: 384,
        heads: 12,
        intermediate: 1536,
        layers: 6,
        vocab: 30522,
        max_positions: 512,
        type_vocab: 2,
        eps: 1e-12,
        position_offset: 0,
        layout: Layout::Bert,
    };
    let mut bert = CpuBert::load(path.as_ref(), dims, Pooling::Mean).expect("load");
    bert.set_precision(Precision::Bf16).expect("bf16");
    // 1024 texts of 8..=120 tokens, in batches of 32 sorted by length, as the batcher cuts them.
    let mut seed = 1u32;
    let mut next = |m: u32| {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (seed >> 8) % m
    };
    let mut texts: Vec<Vec<u32>> = (0..1024)
        .map(|_| {
            let len = 8 + next(113) as usize;
            let mut t: Vec<u32> = (0..len).map(|_| 1000 + next(28000)).collect();
            t[0] = 101;
            t[len - 1] = 102;
            t
        })
        .collect();
    texts.sort_by_key(Vec::len);
    let types: Vec<Vec<u32>> = texts.iter().map(|t| vec![0; t.len()]).collect();
    let batches: Vec<Vec<Tokens<'_>>> = texts
        .chunks(32)
        .zip(types.chunks(32))
        .map(|(t, ty)| {
            t.iter()
                .zip(ty)
                .map(|(ids, type_ids)| Tokens {
                    ids,
                    type_ids,
                    skip: 0,
                })
                .collect()
        })
        .collect();
    let run = |bert: &mut CpuBert, p: Precision| {
        bert.set_precision(p).expect("precision");
        let started = Instant::now();
        let v: Vec<Vec<f32>> = batches
            .iter()
            .flat_map(|b| bert.embed(b).expect("embed"))
            .collect();
        (texts.len() as f64 / started.elapsed().as_secs_f64(), v)
    };
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(str::to_owned)
        })
        .unwrap_or_default();
    println!("{cpu}");
    let calibration: Vec<Tokens<'_>> = batches[batches.len() / 2].clone();
    bert.calibrate(&calibration).expect("calibrate");
    let sides = [Precision::F32, Precision::Bf16, Precision::Int8];
    let mut rates = vec![Vec::new(); sides.len()];
    let mut worst = vec![1.0f64; sides.len()];
    let mut kernels = vec![""; sides.len()];
    for r in 0..rounds {
        let mut reference = Vec::new();
        for (i, &p) in sides.iter().enumerate() {
            let (rate, v) = run(&mut bert, p);
            kernels[i] = bert.kernels();
            if i == 0 {
                reference = v;
            } else {
                for (x, y) in reference.iter().zip(&v) {
                    worst[i] = worst[i].min(cosine(x, y));
                }
            }
            println!("round {r}: {p:?} on {}: {rate:.1} rec/s", kernels[i]);
            rates[i].push(rate);
        }
    }
    for (i, p) in sides.iter().enumerate() {
        rates[i].sort_by(f64::total_cmp);
        let median = rates[i][rates[i].len() / 2];
        println!(
            "median {p:?} on {}: {median:.1} rec/s, {:.2}x f32; worst cosine against f32 {:.7}",
            kernels[i],
            median / rates[0][rates[0].len() / 2],
            worst[i]
        );
    }
}

fn cosine(x: &[f32], y: &[f32]) -> f64 {
    let dot: f64 = x.iter().zip(y).map(|(a, b)| f64::from(a * b)).sum();
    let nx: f64 = x.iter().map(|a| f64::from(a * a)).sum::<f64>().sqrt();
    let ny: f64 = y.iter().map(|a| f64::from(a * a)).sum::<f64>().sqrt();
    dot / (nx * ny)
}
