//! The engines' GPU kernels compiled at run time by NVRTC (linked with candle's CUDA build, so
//! nothing is compiled at build time): each kernel file is handed to NVRTC after the shared
//! header `kernels/common.cuh` (element loads and stores without CUDA headers), for the device's
//! own architecture, with `--fmad=false` so that every product and sum is rounded as the
//! kernel's CPU reference rounds it. `scripts/check-kernels.py` compiles the same sources for
//! compute_80, 89 and 90 in CI. [`view`] hands the kernels their operands.

use candle_core::cuda_backend::cudarc::driver::CudaView;
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, Layout, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Prepended to each kernel file: NVRTC is handed one source and no include path.
const COMMON: &str = include_str!("kernels/common.cuh");

/// Compiled PTX by (module, architecture).
type PtxCache = HashMap<(&'static str, i32), Arc<str>>;

/// The PTX of kernel module `module` (its source `source`), compiled for `dev`'s architecture
/// the first time a process asks (candle then loads it once per device, by the module's name).
pub fn ptx(dev: &CudaDevice, module: &'static str, source: &str) -> Result<Arc<str>> {
    static PTX: OnceLock<Mutex<PtxCache>> = OnceLock::new();
    let (major, minor) = dev.cuda_stream().context().compute_capability().w()?;
    let arch = major * 10 + minor;
    let mut compiled = PTX
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg("NVRTC cache poisoned".into()))?;
    if let Some(ptx) = compiled.get(&(module, arch)) {
        return Ok(ptx.clone());
    }
    let options = CompileOptions {
        fmad: Some(false),
        options: vec![format!("--gpu-architecture=compute_{arch}")],
        ..Default::default()
    };
    let ptx: Arc<str> = compile_ptx_with_opts(format!("{COMMON}\n{source}"), options)
        .map_err(|e| candle_core::Error::Msg(format!("NVRTC, {module}: {e}")))?
        .to_src()
        .into();
    compiled.insert((module, arch), ptx.clone());
    Ok(ptx)
}

/// A contiguous operand's elements on the device, as the kernels take them.
pub fn view<'a, T: CudaDType>((s, layout): (&'a CudaStorage, &Layout)) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("the engines' kernels take contiguous operands");
    };
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}
