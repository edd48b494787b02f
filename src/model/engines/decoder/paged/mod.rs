//! The paged KV cache a GPU decoder reads (issue 52), built and tested without a GPU: the
//! host's bookkeeping of blocks and sequences (`blocks`), and the attention that reads the cache
//! through block tables and the writes that fill it (`attention`: candle custom ops, each
//! `cpu_fwd` the reference of its NVRTC kernel in `kernels/paged.cu`, `cuda`); `check` runs
//! them on a device against their references and checks their batch invariance there.
//!
//! Not yet built on them: the decoder's layers on candle's devices and its place behind the
//! decode loop (`super::decode`), so a generation model still runs on the CPU decoder.

mod argmax;
pub mod attention;
pub mod blocks;
pub mod check;
#[cfg(feature = "cuda")]
mod cuda;
pub mod decoder;
mod linear;
