//! spotinfer's networks on the CPU, each fused by hand for throughput rather than built from a
//! general tensor library's operations:
//!
//! - the text encoder ([`CpuBert`]): BERT, RoBERTa, XLM-RoBERTa and DistilBERT checkpoints, with
//!   the pooling sentence-transformers configures, over unpadded batches;
//! - the image towers ([`CpuVision`]): CLIP's and ViT's vision transformers;
//! - the decoder ([`CpuDecoder`]): Llama-style models (Llama and SmolLM, Qwen2, Qwen3) for
//!   batched generation, each sequence with its own key and value cache.
//!
//! Their dense layers run on this crate's kernels over weights packed at load: f32, bf16
//! (AMX tiles, or AVX-512 BF16) or int8 (integer dot products on x86-64 and Arm), as
//! [`Precision`] picks; the decoder takes f32 or bf16. Where a CPU has no packed f32 kernel, the
//! f32 products fall back to the `gemm` crate. The passes between the products (attention,
//! softmax, norms, activations) are fused and parallel over rows; beside dense layers on AMX,
//! the encoder's and image towers' attention multiplies on the tiles too. The encoder and
//! the image towers read their weights from memory-mapped safetensors files; the decoder takes
//! its tensors from a reader the caller passes.

#![deny(missing_docs)]

mod attention;
mod decoder;
mod dense;
mod encoder;
mod error;
mod kernels;
mod packed;
mod quant;
mod types;
mod vision;
mod weights;

pub use decoder::{CpuDecoder, DecoderDims, KvCache, Outputs, Step, Want};
pub use encoder::{CpuBert, SMALL_BATCH_MACS};
pub use error::FusedError;
/// Whether bf16 products run on AMX tiles here (the CPU has AMX-BF16 and Linux granted the tile
/// state): then bf16 is the fastest precision, int8 on AVX-512 VNNI included.
#[cfg(target_arch = "x86_64")]
pub use packed::amx::supported as amx_supported;
pub use packed::bf16::supported as bf16_supported;
pub use packed::bf16_full_rate;
pub use quant::{argmax, BlockFormat, BlockMatrix, PreparedProduct, Weights};
pub use types::{int8_kernels, int8_supported, Dims, Layout, Pooling, Precision, Tokens, Widest};
pub use vision::{CpuVision, VisionDims, VisionLayout};

/// Whether bf16 products run on AMX tiles here: never off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub fn amx_supported() -> bool {
    false
}
