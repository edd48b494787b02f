//! CUDA graphs for the unpadded encoder (issue 51, step 5; opt-in as `--backend
//! unpadded-graphs` until the GPU check has passed on a GPU). A BERT-base batch is about a hundred
//! kernels of a few microseconds each; launched one by one from the host, the gaps between them
//! are what left the H100 idle. A graph records a batch's launches once and replays them with one
//! call.
//!
//! A graph replays fixed shapes and fixed buffers, so a batch is packed to its [`Bucket`]: its
//! token count rounded up, the extra tokens split into padding sequences of their own (they
//! attend only to each other and are never pooled), and the sequence count rounded up with empty
//! sequences. Batches of one bucket share one graph; the batch's ids, types, positions and bounds
//! are copied into the graph's input buffers before each replay, and its output is read from the
//! buffer the capture allocated. The bucketed packing runs on the CPU too, where nothing is
//! captured, so the tests prove on candle's CPU backend that padding to a bucket changes no
//! text's vector; the capture itself is checked on a GPU by `bench/gpu-check.sh`.

/// Tokens a bucket rounds up to a multiple of.
pub const TOKEN_STEP: usize = 128;
/// Sequences a bucket rounds up to a multiple of.
pub const SEQUENCE_STEP: usize = 8;
/// Graphs kept per model; batches of further buckets run without one.
pub const MAX_GRAPHS: usize = 64;

/// A batch's shape rounded up, so that batches of similar size share one graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bucket {
    /// Tokens, a multiple of [`TOKEN_STEP`].
    pub tokens: usize,
    /// Sequences (the texts, the padding sequences, then empty ones), a multiple of
    /// [`SEQUENCE_STEP`].
    pub sequences: usize,
    /// The longest sequence, a power of two of at least 16 (the attention's grid is sized by
    /// it).
    pub max_len: usize,
}

impl Bucket {
    /// The bucket of a batch of texts of `lengths` tokens.
    pub fn of(lengths: &[usize]) -> Self {
        let real: usize = lengths.iter().sum();
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let tokens = real.div_ceil(TOKEN_STEP).max(1) * TOKEN_STEP;
        let max_len = longest.max(16).next_power_of_two();
        let padding = (tokens - real).div_ceil(max_len);
        let sequences = (lengths.len() + padding).div_ceil(SEQUENCE_STEP) * SEQUENCE_STEP;
        Self {
            tokens,
            sequences,
            max_len,
        }
    }

    /// Pads a packed batch's host arrays to the bucket: padding tokens (id 0, type 0, the first
    /// position) in sequences of at most `max_len`, then empty sequences.
    pub fn pad(&self, host: &mut super::HostBatch, first_position: u32) {
        let mut total = host.ids.len();
        while total < self.tokens {
            let n = (self.tokens - total).min(self.max_len);
            host.ids.resize(total + n, 0);
            host.types.resize(total + n, 0);
            host.positions.resize(total + n, first_position);
            total += n;
            host.bounds.push(total as u32);
        }
        host.bounds.resize(self.sequences + 1, total as u32);
    }
}

#[cfg(feature = "cuda")]
pub use captured::Graphs;

/// Without the `cuda` feature there is nothing to capture: the bucketed batch runs as it is.
#[cfg(not(feature = "cuda"))]
#[derive(Default)]
pub struct Graphs;

#[cfg(not(feature = "cuda"))]
impl Graphs {
    /// The encoder on the bucketed batch, without a graph.
    pub fn run(
        &self,
        model: &super::UnpaddedBert,
        batch: super::Packed,
    ) -> candle_core::Result<candle_core::Tensor> {
        model.forward(&batch)
    }
}

#[cfg(feature = "cuda")]
mod captured {
    use super::super::{Packed, UnpaddedBert};
    use super::{Bucket, MAX_GRAPHS};
    use candle_core::cuda_backend::cudarc::driver::sys::{
        CUdeviceptr, CUgraphInstantiate_flags, CUstreamCaptureMode,
    };
    use candle_core::cuda_backend::cudarc::driver::{result, CudaGraph, DevicePtr};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{DType, Device, Result, Storage, Tensor};
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    /// The graphs captured so far, by bucket.
    #[derive(Default)]
    pub struct Graphs {
        captured: Mutex<HashMap<Bucket, Captured>>,
        /// Set when a capture failed: the rest of the run goes without graphs.
        off: AtomicBool,
    }

    /// One bucket's graph: its input buffers (a packed batch kept for the purpose), their device
    /// addresses, the host arrays copied into them, and the hidden state the graph writes.
    struct Captured {
        inputs: Packed,
        pointers: [CUdeviceptr; 4],
        hidden: Tensor,
        graph: CudaGraph,
    }

    // SAFETY: a `CudaGraph` is not internally synchronised; every use of one is inside the
    // `Graphs` mutex, so no two threads touch it at once.
    unsafe impl Send for Captured {}

    impl Graphs {
        /// The encoder on `batch` (packed to its bucket): by the bucket's graph when there is
        /// one; else run directly, then captured for the next batches of the bucket. f32 runs
        /// without graphs (its products are cuBLAS calls, not cuBLASLt ones, and cuBLAS may
        /// allocate a workspace while it is being captured).
        pub fn run(&self, model: &UnpaddedBert, batch: Packed) -> Result<Tensor> {
            let Some(bucket) = batch.bucket else {
                return model.forward(&batch);
            };
            if self.off.load(Ordering::Relaxed) || model.words.dtype() == DType::F32 {
                return model.forward(&batch);
            }
            let mut captured = self
                .captured
                .lock()
                .map_err(|_| candle_core::Error::Msg("CUDA graphs poisoned".into()))?;
            if let Some(c) = captured.get(&bucket) {
                c.load(&batch)?;
                c.graph.launch().w()?;
                return Ok(c.hidden.clone());
            }
            // Run first: modules are compiled and loaded and handles made outside the capture.
            let hidden = model.forward(&batch)?;
            if captured.len() < MAX_GRAPHS {
                match capture(model, batch) {
                    Ok(c) => {
                        captured.insert(bucket, c);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "CUDA graph capture failed: graphs off");
                        self.off.store(true, Ordering::Relaxed);
                    }
                }
            }
            Ok(hidden)
        }
    }

    impl Captured {
        /// Copies `batch`'s arrays into the graph's input buffers, on the model's stream.
        fn load(&self, batch: &Packed) -> Result<()> {
            let Device::Cuda(dev) = self.inputs.ids.device() else {
                candle_core::bail!("CUDA graphs on a device that is not CUDA");
            };
            let stream = dev.cuda_stream();
            let host = batch.host.as_ref().ok_or_else(|| {
                candle_core::Error::Msg("a bucketed batch keeps its host arrays".into())
            })?;
            let arrays = [&host.ids, &host.types, &host.positions, &host.bounds];
            for (pointer, array) in self.pointers.iter().zip(arrays) {
                // SAFETY: the buffer holds u32s of the bucket's length, which the batch's arrays
                // have (one bucket, one shape); it lives as long as `self`; the copy is queued on
                // the stream the graph runs on, and a pageable source is staged before the call
                // returns.
                unsafe { result::memcpy_htod_async(*pointer, array, stream.cu_stream()) }.w()?;
            }
            Ok(())
        }
    }

    /// Records the encoder's launches on `batch` into a graph (run once by the caller already).
    fn capture(model: &UnpaddedBert, batch: Packed) -> Result<Captured> {
        let device = model.device();
        let Device::Cuda(dev) = device else {
            candle_core::bail!("CUDA graphs need a CUDA device");
        };
        device.synchronize()?;
        let stream = dev.cuda_stream();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .w()?;
        let forward = model.forward(&batch);
        // Ended whatever happened, so the stream leaves capture mode; allocations the graph does
        // not free (the hidden state) are freed when it is launched again.
        let graph = stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
            .w();
        let hidden = forward?;
        let Some(graph) = graph? else {
            candle_core::bail!("the stream capture gave no graph");
        };
        let pointers = [
            pointer(&batch.ids)?,
            pointer(&batch.types)?,
            pointer(&batch.positions)?,
            pointer(&batch.cu_seqlens)?,
        ];
        Ok(Captured {
            inputs: batch,
            pointers,
            hidden,
            graph,
        })
    }

    /// A u32 tensor's first element's device address.
    fn pointer(t: &Tensor) -> Result<CUdeviceptr> {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            candle_core::bail!("a graph input that is not on the GPU");
        };
        let slice = s.as_cuda_slice::<u32>()?;
        let (address, _synced) = slice.device_ptr(slice.stream());
        Ok(address + (layout.start_offset() * std::mem::size_of::<u32>()) as CUdeviceptr)
    }
}

#[cfg(test)]
mod tests {
    use super::{Bucket, SEQUENCE_STEP, TOKEN_STEP};
    use crate::model::engines::unpadded::HostBatch;

    /// Every bucket covers its batch: tokens and sequences rounded up to their steps, the
    /// longest text within `max_len`, and padding that fills the bucket exactly with sequences
    /// no longer than `max_len`.
    #[test]
    fn a_bucket_covers_its_batch_and_padding_fills_it() {
        for lengths in [
            vec![1],
            vec![5, 17, 1, 40],
            vec![128; 8],
            vec![3; 200],
            vec![512, 9],
        ] {
            let bucket = Bucket::of(&lengths);
            let real: usize = lengths.iter().sum();
            assert!(
                bucket.tokens >= real && bucket.tokens.is_multiple_of(TOKEN_STEP),
                "{lengths:?}"
            );
            assert!(
                bucket.sequences.is_multiple_of(SEQUENCE_STEP),
                "{lengths:?}"
            );
            assert!(lengths.iter().all(|&n| n <= bucket.max_len), "{lengths:?}");
            let mut bounds = vec![0u32];
            for n in &lengths {
                bounds.push(bounds[bounds.len() - 1] + *n as u32);
            }
            let mut host = HostBatch {
                ids: vec![7; real],
                types: vec![0; real],
                positions: vec![1; real],
                bounds,
            };
            bucket.pad(&mut host, 2);
            assert_eq!(host.ids.len(), bucket.tokens, "{lengths:?}");
            assert_eq!(host.bounds.len(), bucket.sequences + 1, "{lengths:?}");
            assert_eq!(host.bounds[bucket.sequences] as usize, bucket.tokens);
            let longest = host.bounds.windows(2).map(|w| w[1] - w[0]).max().unwrap();
            assert!(longest as usize <= bucket.max_len, "{lengths:?}");
            assert!(host.positions[real..].iter().all(|&p| p == 2));
        }
    }
}
