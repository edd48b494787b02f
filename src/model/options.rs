//! How a model is loaded beyond what its own files say: the device, the encoder, the precision
//! of its products, the name its results carry, its prompt and token limit. The enums are the
//! model layer's vocabulary; the command line picks them by name ([`crate::choice::Choice`]).

use super::PromptChoice;
use crate::choice::Choice;
use std::path::Path;

/// The compute device requested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// CUDA if available, else CPU.
    Auto,
    /// Always the CPU.
    Cpu,
    /// CUDA device 0; an error when unavailable.
    Cuda,
}

impl Choice for DeviceChoice {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("auto", Self::Auto),
        ("cpu", Self::Cpu),
        ("cuda", Self::Cuda),
    ];
}

/// The code that runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Fused on the CPU, candle on CUDA.
    Auto,
    /// The fused CPU encoder (`crates/fused-cpu`).
    Fused,
    /// The candle encoder (`src/model/engines/candle_bert.rs`).
    Candle,
    /// The candle encoder on packed batches with fused kernels on CUDA
    /// (`src/model/engines/unpadded`): opt-in until the GPU check has passed on a GPU.
    Unpadded,
    /// `Unpadded` with batches packed to buckets and, on CUDA, each bucket's launches captured
    /// once in a CUDA graph and replayed (`src/model/engines/unpadded/graphs.rs`): opt-in until
    /// the GPU check has passed on a GPU.
    UnpaddedGraphs,
    /// Generation models only: the paged decoder on candle's device (`--device`: CUDA, or the
    /// CPU for tests) in place of the CPU decoder (`src/model/engines/decoder/paged/`); what
    /// `Auto` builds a generation model into on CUDA.
    Paged,
}

impl Choice for Backend {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("auto", Self::Auto),
        ("fused", Self::Fused),
        ("candle", Self::Candle),
        ("unpadded", Self::Unpadded),
        ("unpadded-graphs", Self::UnpaddedGraphs),
        ("paged", Self::Paged),
    ];
}

/// The precision of the encoder's matrix products (pooling and normalisation are always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// f16 on CUDA (tensor cores); on the CPU the fastest of int8 and bf16 this CPU has whose
    /// vectors pass the load-time check, else f32 (embedding models; task models f32).
    Auto,
    /// f32 everywhere.
    F32,
    /// bf16 products with f32 sums (the fused CPU encoder on AVX-512 BF16 CPUs only).
    Bf16,
    /// f16 (candle backend only).
    F16,
    /// int8 products with i32 sums (the fused CPU encoder, on CPUs with integer dot products:
    /// AVX-512 VNNI, AVX-VNNI, AVX2 or Arm's dotprod).
    Int8,
    /// A GGUF generation model's weights kept in the file's block formats (Q4_0, Q4_1, Q8_0,
    /// Q4_K, Q5_K, Q6_K) and multiplied as llama.cpp multiplies them: a seventh of f32's memory.
    Gguf,
}

impl Choice for Precision {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("auto", Self::Auto),
        ("f32", Self::F32),
        ("bf16", Self::Bf16),
        ("f16", Self::F16),
        ("int8", Self::Int8),
        ("gguf", Self::Gguf),
    ];
}

/// The widest instructions the fused CPU encoder's and the CPU decoder's dense layers may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuKernels {
    /// The widest this CPU has.
    Auto,
    /// Everything but AMX's tiles: what a Sapphire Rapids runs with AMX off, as a Zen 4 or an
    /// Ice Lake runs (AVX-512, with its VNNI and BF16 where the CPU has them): bf16 on AVX-512
    /// BF16, a GGUF's blocks on VNNI's `vpdpbusd`.
    Avx512,
    /// AVX2 at most, what a CPU with neither AVX-512 nor AVX-VNNI runs (AMD's Zen 2 and 3):
    /// f32 on AVX2/FMA, int8 on `vpmaddubsw` (the feed-forward output on AVX2/FMA), a GGUF's
    /// blocks on `vpmaddubsw`, bf16 refused; to compare CPU classes on one machine, and to test
    /// that path on a CPU that has AVX-512.
    Avx2,
}

impl CpuKernels {
    /// The fused kernels' limit it sets.
    pub(crate) fn widest(self) -> spotinfer_fused_cpu::Widest {
        use spotinfer_fused_cpu::Widest;
        match self {
            Self::Auto => Widest::All,
            Self::Avx512 => Widest::NoAmx,
            Self::Avx2 => Widest::Avx2,
        }
    }
}

impl Choice for CpuKernels {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("auto", Self::Auto),
        ("avx512", Self::Avx512),
        ("avx2", Self::Avx2),
    ];
}

/// How to load a model, beyond what its own files say.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Where to run.
    pub device: DeviceChoice,
    /// Which encoder.
    pub backend: Backend,
    /// Precision of the encoder's matrix products.
    pub precision: Precision,
    /// The widest instructions the fused CPU encoder may use.
    pub cpu_kernels: CpuKernels,
    /// The name in result rows (default: the folder's name).
    pub name: Option<String>,
    /// The prompt when a record names none.
    pub prompt: PromptChoice,
    /// A lower token limit than the model's `max_seq_length`.
    pub max_seq_len: Option<usize>,
}

impl LoadOptions {
    /// The model as its files describe it, on `device`, with the default encoder.
    pub fn new(device: DeviceChoice) -> Self {
        Self {
            device,
            backend: Backend::Auto,
            precision: Precision::Auto,
            cpu_kernels: CpuKernels::Auto,
            name: None,
            prompt: PromptChoice::ModelDefault,
            max_seq_len: None,
        }
    }

    /// The same options with `backend` (`auto`: the fused encoder on the CPU, candle on CUDA).
    pub fn backend(self, backend: Backend) -> Self {
        Self { backend, ..self }
    }

    /// The same options with `precision`: `auto` is f16 on CUDA and, on the CPU, int8 or bf16
    /// where the CPU runs them fast and the model passes the load-time check (see `fused`),
    /// else f32.
    pub fn precision(self, precision: Precision) -> Self {
        Self { precision, ..self }
    }

    /// The same options with `cpu_kernels` (the fused CPU encoder's widest instructions).
    pub fn cpu_kernels(self, cpu_kernels: CpuKernels) -> Self {
        Self {
            cpu_kernels,
            ..self
        }
    }
}

/// The name a model's results carry unless `--model-name` says otherwise: the last segment of
/// its folder (or of its gs:// prefix, which is also its cache folder's name).
pub fn default_model_name(dir: &Path) -> String {
    let name = |d: &Path| d.file_name().map(|n| n.to_string_lossy().into_owned());
    name(dir)
        .or_else(|| dir.canonicalize().ok().as_deref().and_then(name))
        .unwrap_or_else(|| "model".into())
}
