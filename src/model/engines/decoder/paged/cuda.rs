//! The paged cache's GPU side: the `cuda_fwd` of `attention.rs`'s ops, each the NVRTC kernel
//! of `kernels/paged.cu` (compiled for the device the first time a process runs it).

use super::attention::{PagedAttention, WriteCache, KEY_TILE};
use super::rotary::RotaryRows;
use crate::model::engines::nvrtc::{ptx, view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaViewMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result, Shape};

/// The paged cache's kernels.
const PAGED: &str = include_str!("kernels/paged.cu");

/// `WriteCache` on CUDA: one block a new token.
pub fn write_cache(
    op: &WriteCache,
    (cache, cache_layout): (&mut CudaStorage, &Layout),
    rows: (&CudaStorage, &Layout),
    slots: (&CudaStorage, &Layout),
    tokens: usize,
) -> Result<()> {
    let l = op.0;
    let dev = cache.device().clone();
    let capacity = cache_layout.shape().dims4()?.1;
    let Some((start, end)) = cache_layout.contiguous_offsets() else {
        candle_core::bail!("paged write: the cache is not contiguous");
    };
    let config = LaunchConfig {
        grid_dim: (tokens as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (stride, k_at, v_at) = (l.stride as i32, l.k_at as i32, l.v_at as i32);
    let (kv_width, slots_arg) = ((l.kv_heads * l.head_dim) as i32, capacity as i64);
    let slot_of = view::<u32>(slots)?;
    macro_rules! run {
        ($t:ty, $name:literal) => {{
            let func = dev.get_or_load_custom_func($name, "paged", &ptx(&dev, "paged", PAGED)?)?;
            let input = view::<$t>(rows)?;
            let mut target: CudaViewMut<'_, $t> =
                cache.as_cuda_slice_mut::<$t>()?.slice_mut(start..end);
            let mut args = func.builder();
            args.arg(&mut target).arg(&input).arg(&slot_of);
            args.arg(&stride)
                .arg(&k_at)
                .arg(&v_at)
                .arg(&kv_width)
                .arg(&slots_arg);
            // SAFETY: the arguments are the kernel's, in its order; every slot is below the
            // cache's capacity (the block pool gives no other).
            unsafe { args.launch(config) }.w()?;
        }};
    }
    match cache.dtype() {
        DType::F32 => run!(f32, "write_cache_f32"),
        DType::F16 => run!(half::f16, "write_cache_f16"),
        DType::BF16 => run!(half::bf16, "write_cache_bf16"),
        other => candle_core::bail!("paged write: not in {other:?}"),
    }
    Ok(())
}

/// `PagedAttention` on CUDA: one warp a (new token, head).
pub fn paged_attention(
    op: &PagedAttention,
    rows: (&CudaStorage, &Layout),
    cache: (&CudaStorage, &Layout),
    plan: (&CudaStorage, &Layout),
    (tokens, slots): (usize, usize),
) -> Result<(CudaStorage, Shape)> {
    let l = op.layout;
    let dev = rows.0.device().clone();
    let config = LaunchConfig {
        grid_dim: (tokens as u32, l.heads as u32, 1),
        block_dim: (KEY_TILE as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let ints = [
        tokens as i32,
        l.stride as i32,
        l.q_at as i32,
        l.heads as i32,
        l.kv_heads as i32,
        l.head_dim as i32,
        op.block_size as i32,
        op.width as i32,
    ];
    let (slots_arg, scale) = (slots as i64, op.scale());
    let plan = view::<u32>(plan)?;
    let width = l.heads * l.head_dim;
    macro_rules! run {
        ($t:ty, $name:literal) => {{
            let func = dev.get_or_load_custom_func($name, "paged", &ptx(&dev, "paged", PAGED)?)?;
            let (input, kv) = (view::<$t>(rows)?, view::<$t>(cache)?);
            // SAFETY: every element is written by the kernel (each token's every head).
            let out = unsafe { dev.alloc::<$t>(tokens * width)? };
            let mut args = func.builder();
            args.arg(&input).arg(&kv).arg(&plan).arg(&out);
            for i in &ints {
                args.arg(i);
            }
            args.arg(&slots_arg).arg(&scale);
            // SAFETY: the arguments are the kernel's, in its order; the plan's rows and
            // positions lie within its tables and the tables' slots within the cache (the block
            // pool gives no other).
            unsafe { args.launch(config) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match rows.0.dtype() {
        DType::F32 => run!(f32, "paged_attention_f32"),
        DType::F16 => run!(half::f16, "paged_attention_f16"),
        DType::BF16 => run!(half::bf16, "paged_attention_bf16"),
        other => candle_core::bail!("paged attention: not in {other:?}"),
    };
    Ok((out, Shape::from((tokens, width))))
}

/// `ArgmaxRows` on CUDA: one block a row.
pub fn argmax_rows(logits: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
    let (rows, vocab) = layout.shape().dims2()?;
    let dev = logits.device().clone();
    let config = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let vocab_arg = vocab as i32;
    macro_rules! run {
        ($t:ty, $name:literal) => {{
            let func = dev.get_or_load_custom_func($name, "paged", &ptx(&dev, "paged", PAGED)?)?;
            let input = view::<$t>((logits, layout))?;
            // SAFETY: every element is written by the kernel (one block a row).
            let out = unsafe { dev.alloc::<u32>(rows)? };
            let mut args = func.builder();
            args.arg(&input).arg(&out).arg(&vocab_arg);
            // SAFETY: the arguments are the kernel's, in its order.
            unsafe { args.launch(config) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match logits.dtype() {
        DType::F32 => run!(f32, "argmax_rows_f32"),
        DType::F16 => run!(half::f16, "argmax_rows_f16"),
        DType::BF16 => run!(half::bf16, "argmax_rows_bf16"),
        other => candle_core::bail!("argmax: not in {other:?}"),
    };
    Ok((out, Shape::from(rows)))
}

/// `MaskRows` on CUDA: one thread an element, 256 a block, a row of blocks a row.
pub fn mask_rows(
    logits: (&CudaStorage, &Layout),
    masks: (&CudaStorage, &Layout),
    (rows, vocab, words, allowed): (usize, usize, usize, usize),
) -> Result<(CudaStorage, Shape)> {
    let dev = logits.0.device().clone();
    let config = LaunchConfig {
        grid_dim: (vocab.div_ceil(256) as u32, rows as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let ints = [vocab as i32, words as i32, allowed as i32];
    let mask_words = view::<u32>(masks)?;
    macro_rules! run {
        ($t:ty, $name:literal) => {{
            let func = dev.get_or_load_custom_func($name, "paged", &ptx(&dev, "paged", PAGED)?)?;
            let input = view::<$t>(logits)?;
            // SAFETY: every element is written by the kernel (one thread an element).
            let out = unsafe { dev.alloc::<f32>(rows * vocab)? };
            let mut args = func.builder();
            args.arg(&input).arg(&mask_words).arg(&out);
            for i in &ints {
                args.arg(i);
            }
            // SAFETY: the arguments are the kernel's, in its order; `MaskRows` checked the
            // masks' shape against the logits'.
            unsafe { args.launch(config) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match logits.0.dtype() {
        DType::F32 => run!(f32, "mask_rows_f32"),
        DType::F16 => run!(half::f16, "mask_rows_f16"),
        DType::BF16 => run!(half::bf16, "mask_rows_bf16"),
        other => candle_core::bail!("mask: not in {other:?}"),
    };
    Ok((out, Shape::from((rows, vocab))))
}

/// `SampleRows` on CUDA: one block of 1,024 threads a row.
pub fn sample_rows(
    logits: (&CudaStorage, &Layout),
    params: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let (rows, vocab) = logits.1.shape().dims2()?;
    let dev = logits.0.device().clone();
    let config = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    let vocab_arg = vocab as i32;
    let words = view::<u32>(params)?;
    macro_rules! run {
        ($t:ty, $name:literal) => {{
            let func = dev.get_or_load_custom_func($name, "paged", &ptx(&dev, "paged", PAGED)?)?;
            let input = view::<$t>(logits)?;
            // SAFETY: every element is written by the kernel (the one thread of a row's block
            // whose chunk holds the draw; a row of NaNs by its first thread).
            let out = unsafe { dev.alloc::<u32>(rows)? };
            let mut args = func.builder();
            args.arg(&input).arg(&words).arg(&out).arg(&vocab_arg);
            // SAFETY: the arguments are the kernel's, in its order; `SampleRows` checked the
            // parameters' shape against the logits'.
            unsafe { args.launch(config) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match logits.0.dtype() {
        DType::F32 => run!(f32, "sample_rows_f32"),
        DType::F16 => run!(half::f16, "sample_rows_f16"),
        DType::BF16 => run!(half::bf16, "sample_rows_bf16"),
        other => candle_core::bail!("device sampling: not in {other:?}"),
    };
    Ok((out, Shape::from(rows)))
}

/// `RotaryRows` on CUDA: one block a token.
pub fn rotary_rows(
    op: &RotaryRows,
    rows: (&CudaStorage, &Layout),
    cos: (&CudaStorage, &Layout),
    sin: (&CudaStorage, &Layout),
    tokens: usize,
) -> Result<CudaStorage> {
    let dev = rows.0.device().clone();
    let config = LaunchConfig {
        grid_dim: (tokens as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let ints = [op.heads as i32, op.kv_heads as i32, op.head_dim as i32];
    let width = op.width();
    macro_rules! run {
        ($t:ty, $name:literal) => {{
            let func = dev.get_or_load_custom_func($name, "paged", &ptx(&dev, "paged", PAGED)?)?;
            let (input, c, s) = (view::<$t>(rows)?, view::<$t>(cos)?, view::<$t>(sin)?);
            // SAFETY: every element is written by the kernel (each token's every column).
            let out = unsafe { dev.alloc::<$t>(tokens * width)? };
            let mut args = func.builder();
            args.arg(&input).arg(&c).arg(&s).arg(&out);
            for i in &ints {
                args.arg(i);
            }
            // SAFETY: the arguments are the kernel's, in its order; `RotaryRows` checked the
            // operands' shapes.
            unsafe { args.launch(config) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    Ok(match rows.0.dtype() {
        DType::F32 => run!(f32, "rotary_rows_f32"),
        DType::F16 => run!(half::f16, "rotary_rows_f16"),
        DType::BF16 => run!(half::bf16, "rotary_rows_bf16"),
        other => candle_core::bail!("rotary rows: not in {other:?}"),
    })
}
