//! The unpadded encoder's GPU side: the dense layers through cuBLASLt (cudarc, as candle links
//! it) with the bias as the product's epilogue, and the NVRTC kernels of `kernels/`, compiled
//! for the device's architecture the first time a process runs them (milliseconds; nothing at
//! build time). Each function is the `cuda_fwd` of the op of the same name in `ops.rs`, whose
//! `cpu_fwd` is its reference.

use super::ops::{AddNorm, Dense, VarlenAttention, NORM_THREADS};
use crate::model::engines::nvrtc::{ptx, view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Storage};
use std::sync::{Arc, Mutex, OnceLock};

/// The add + LayerNorm kernels.
const ADD_LAYER_NORM: &str = include_str!("kernels/add_layer_norm.cu");
/// The attention kernels.
const VARLEN_ATTENTION: &str = include_str!("kernels/varlen_attention.cu");
/// Query rows per attention block (`QUERIES` in varlen_attention.cu).
const QUERIES: usize = 16;

/// `ops::Dense` on CUDA: one cuBLASLt product, `x·Wᵀ + b` with the bias as its epilogue.
pub fn dense(op: &Dense, x: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
    let (tokens, _) = layout.shape().dims2()?;
    let call = op.call(tokens)?;
    let config = MatmulConfig {
        transa: call.transa,
        transb: call.transb,
        transc: false,
        m: call.m as u64,
        n: call.n as u64,
        k: call.k as u64,
        alpha: 1.0,
        lda: call.lda as i64,
        ldb: call.ldb as i64,
        beta: 0.0,
        ldc: call.ldc as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    };
    let dev = x.device().clone();
    let (w, w_layout) = op.weight.storage_and_layout();
    let (b, b_layout) = op.bias.storage_and_layout();
    let (Storage::Cuda(w), Storage::Cuda(b)) = (&*w, &*b) else {
        candle_core::bail!("dense: the weights are not on the GPU");
    };
    let lt = blas_lt(&dev)?;
    let shape = Shape::from((tokens, call.m));
    let out = match x.dtype() {
        DType::F16 => product::<half::f16>(&lt, config, (x, layout), (w, w_layout), (b, b_layout))?,
        DType::BF16 => {
            product::<half::bf16>(&lt, config, (x, layout), (w, w_layout), (b, b_layout))?
        }
        other => candle_core::bail!("dense: cuBLASLt runs f16 and bf16 here, not {other:?}"),
    };
    Ok((out, shape))
}

/// One product through cuBLASLt, its output allocated here.
fn product<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
    lt: &CudaBlasLT,
    config: MatmulConfig,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
) -> Result<CudaStorage>
where
    CudaBlasLT: Matmul<T>,
{
    let dev = x.0.device().clone();
    let (x, w, b) = (view::<T>(x)?, view::<T>(w)?, view::<T>(b)?);
    // SAFETY: every element is written by the product.
    let mut out: CudaSlice<T> = unsafe { dev.alloc::<T>((config.m * config.n) as usize)? };
    // SAFETY: the extents match the call (`GemmCall::extents`, checked by the reference's tests).
    unsafe { lt.matmul(config, &w, &x, &mut out, Some(&b), None) }.map_err(blas_error)?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `ops::VarlenAttention` on CUDA (`kernels/varlen_attention.cu`).
pub fn varlen_attention(
    op: &VarlenAttention,
    qkv: &CudaStorage,
    qkv_layout: &Layout,
    cu_seqlens: &CudaStorage,
    cu_layout: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (tokens, _) = qkv_layout.shape().dims2()?;
    let sequences = cu_layout.shape().elem_count() - 1;
    let width = op.heads * op.head_dim;
    let dev = qkv.device().clone();
    let cu = view::<u32>((cu_seqlens, cu_layout))?;
    let config = LaunchConfig {
        grid_dim: (
            sequences as u32,
            op.max_len.div_ceil(QUERIES).max(1) as u32,
            op.heads as u32,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (heads, head_dim, scale) = (op.heads as i32, op.head_dim as i32, op.scale());
    macro_rules! run {
        ($t:ty, $name:literal) => {{
            let func = dev.get_or_load_custom_func(
                $name,
                "varlen_attention",
                &ptx(&dev, "varlen_attention", VARLEN_ATTENTION)?,
            )?;
            let input = view::<$t>((qkv, qkv_layout))?;
            // SAFETY: every element is written by the kernel (each row's every head).
            let out = unsafe { dev.alloc::<$t>(tokens * width)? };
            let mut args = func.builder();
            args.arg(&input).arg(&cu).arg(&out);
            args.arg(&heads).arg(&head_dim).arg(&scale);
            // SAFETY: the arguments are the kernel's, in its order.
            unsafe { args.launch(config) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match qkv.dtype() {
        DType::F32 => run!(f32, "varlen_attention_f32"),
        DType::F16 => run!(half::f16, "varlen_attention_f16"),
        DType::BF16 => run!(half::bf16, "varlen_attention_bf16"),
        other => candle_core::bail!("varlen-attention: not in {other:?}"),
    };
    Ok((out, Shape::from((tokens, width))))
}

/// `ops::AddNorm` on CUDA (`kernels/add_layer_norm.cu`).
pub fn add_norm(
    op: &AddNorm,
    x: &CudaStorage,
    x_layout: &Layout,
    residual: &CudaStorage,
    r_layout: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (tokens, width) = x_layout.shape().dims2()?;
    let dev = x.device().clone();
    let (g, g_layout) = op.gamma.storage_and_layout();
    let (b, b_layout) = op.beta.storage_and_layout();
    let (Storage::Cuda(g), Storage::Cuda(b)) = (&*g, &*b) else {
        candle_core::bail!("add-layer-norm: the weights are not on the GPU");
    };
    let config = LaunchConfig {
        grid_dim: (tokens as u32, 1, 1),
        block_dim: (NORM_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (width_arg, eps) = (width as i32, op.eps);
    let rows = tokens * width;
    macro_rules! run {
        ($t:ty, $name:literal) => {{
            let func = dev.get_or_load_custom_func(
                $name,
                "add_layer_norm",
                &ptx(&dev, "add_layer_norm", ADD_LAYER_NORM)?,
            )?;
            let (xv, rv) = (
                view::<$t>((x, x_layout))?,
                view::<$t>((residual, r_layout))?,
            );
            let (gv, bv) = (view::<$t>((g, g_layout))?, view::<$t>((b, b_layout))?);
            // SAFETY: every element is written by the kernel (one block a row; the sums' half
            // with keep_sum, which is the only case it exists).
            let out = unsafe { dev.alloc::<$t>(if op.keep_sum { 2 * rows } else { rows })? };
            let sums = if op.keep_sum {
                out.slice(rows..)
            } else {
                out.slice(..)
            };
            let mut args = func.builder();
            args.arg(&xv)
                .arg(&rv)
                .arg(&gv)
                .arg(&bv)
                .arg(&out)
                .arg(&sums);
            args.arg(&width_arg).arg(&eps);
            // SAFETY: the arguments are the kernel's, in its order.
            unsafe { args.launch(config) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match (x.dtype(), op.keep_sum) {
        (DType::F32, false) => run!(f32, "add_layer_norm_f32"),
        (DType::F16, false) => run!(half::f16, "add_layer_norm_f16"),
        (DType::BF16, false) => run!(half::bf16, "add_layer_norm_bf16"),
        (DType::F32, true) => run!(f32, "add_layer_norm_sum_f32"),
        (DType::F16, true) => run!(half::f16, "add_layer_norm_sum_f16"),
        (DType::BF16, true) => run!(half::bf16, "add_layer_norm_sum_bf16"),
        (other, _) => candle_core::bail!("add-layer-norm: not in {other:?}"),
    };
    Ok((out, op.out_shape(x_layout.shape())?))
}

/// A cuBLASLt status as candle's error (candle converts the other CUDA libraries' errors, not
/// this one's).
fn blas_error(
    e: candle_core::cuda_backend::cudarc::cublaslt::result::CublasError,
) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt: {e:?}"))
}

/// This process's cuBLASLt handle (with its workspace), made on first use.
fn blas_lt(dev: &CudaDevice) -> Result<Arc<CudaBlasLT>> {
    static LT: OnceLock<Mutex<Option<Arc<CudaBlasLT>>>> = OnceLock::new();
    let mut lt = LT
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg("cuBLASLt handle poisoned".into()))?;
    if let Some(lt) = lt.as_ref() {
        return Ok(lt.clone());
    }
    let made = Arc::new(CudaBlasLT::new(dev.cuda_stream()).map_err(blas_error)?);
    *lt = Some(made.clone());
    Ok(made)
}
