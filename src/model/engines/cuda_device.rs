//! The CUDA device the engines share, opened once with two settings candle leaves at CUDA's
//! defaults, both of which cost every step of a decode loop host time that the GPU waits out:
//!
//! * **The memory pool keeps what it has reserved.** candle allocates every tensor with
//!   `cuMemAllocAsync` from the device's default pool, whose release threshold is 0: at each
//!   synchronisation (a decode step ends in one, copying its chosen ids back) the pool hands its
//!   free memory back to the driver, and the next step maps it again, allocation by allocation.
//!   RAPIDS' RMM, CCCL and CuPy raise the threshold for the same reason; here it is set to
//!   "never release", as a worker owns its GPU (the decoder's cache is reserved up front anyway).
//! * **No event pair a tensor.** cudarc creates a read and a write event with every allocation
//!   for ordering across streams; candle computes on one stream, where they are never recorded,
//!   but still created and destroyed with each tensor.

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::{Device, Result};

/// CUDA device `ordinal`, set up as the module says.
pub fn open(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    let cuda = device.as_cuda_device()?;
    // SAFETY: candle computes on one stream (the device's own), so no tensor is used on another
    // stream, which is what the events would order.
    unsafe { cuda.disable_event_tracking() };
    let stream = cuda.cuda_stream();
    let context = stream.context();
    context.bind_to_thread().map_err(candle_core::Error::wrap)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the context is bound to this thread and its device handle is live; the pool handle
    // written is the device's default pool, which lives as long as the device.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, context.cu_device()) }
        .result()
        .map_err(candle_core::Error::wrap)?;
    let mut threshold = u64::MAX;
    // SAFETY: the release threshold's value is a cuuint64_t, as passed.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold) as *mut u64 as *mut std::ffi::c_void,
        )
    }
    .result()
    .map_err(candle_core::Error::wrap)?;
    Ok(device)
}
