//! The GPU decoder (issue 52), built and tested without a GPU, a generation model's network on
//! CUDA since its GPU check passed on an H200 (`--backend paged` on any device):
//!
//! * `blocks`: the host's bookkeeping of the paged KV cache's blocks and sequences;
//! * `attention`: the writes that fill the cache and the attention that reads it through block
//!   tables, candle custom ops whose `cpu_fwd` is the reference of their NVRTC kernel
//!   (`kernels/paged.cu`, launched by `cuda`); `argmax` the greedy choice on the device, `sample`
//!   the seeded draw (temperature, top-k, top-p) there, `mask` a constrained row's grammar
//!   applied there first;
//! * `rotary`: a step's attention rows rotated (queries and keys) in one op, its kernel beside;
//! * `decoder`: the Llama-family network over the cache (`linear` its dense layers, on CUDA
//!   `pinned`'s cuBLASLt product, one configuration per weight shape whatever the batch), which
//!   the decode loop (`super::decode`) runs through [`super::Network`];
//! * `check`: all of it on a device against the references, and its batch invariance there
//!   (`products` that of the dense layers, and on CUDA their time against cuBLAS's own).

mod argmax;
pub mod attention;
pub mod blocks;
pub mod check;
#[cfg(feature = "cuda")]
mod cuda;
pub mod decoder;
mod linear;
pub mod mask;
#[cfg(feature = "cuda")]
mod pinned;
pub mod products;
pub mod rotary;
mod rows;
pub mod sample;
