//! The paged decoder's dense products on CUDA pinned to one cuBLASLt configuration per weight
//! shape (issue 52). candle's CUDA product is cuBLAS's, whose heuristic picks its kernel (tile,
//! split-K) by the row count as well, so a sequence's rows may be summed in another order alone
//! and in a batch, and its logits differ in their last bits. Here `x · wᵀ` is `cublasLtMatmul`
//! with ONE algorithm per (device, outputs, inputs, dtype): the heuristic's first answer for
//! [`REFERENCE_ROWS`] rows that needs no reduction across blocks (preference
//! `CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK` = `CUBLASLT_REDUCTION_SCHEME_NONE`, algorithm
//! `CUBLASLT_ALGO_CONFIG_SPLITK_NUM` = 1) and that serves one row too, asked first with no
//! workspace at all (where partial sums across blocks would live), and only where none serves
//! with a workspace of [`WORKSPACE`] bytes; chosen the first time a process asks and kept for
//! every later row count, checked for each with `cublasLtMatmulAlgoCheck` (a row count it cannot
//! serve is an error, never another algorithm). A product of more rows than [`REFERENCE_ROWS`] is
//! computed that many rows a call. Each output element is then one thread block's
//! sum over the inputs in one order, in f32 (compute type 32F, also for bf16 and f16), whatever
//! the other rows: `super::products` checks it bit for bit on the device.
//!
//! cudarc's safe `cublaslt::Matmul` cannot do this: every call asks the heuristic afresh for that
//! call's shape (and takes its first answer, split-K allowed), which is the row-count dependence
//! this module exists to remove; so the calls are cudarc's `result` and `sys` bindings.

use crate::model::engines::nvrtc::view;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublaslt::result::{self as lt, CublasError};
use candle_core::cuda_backend::cudarc::cublaslt::sys;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, DeviceId, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The row count each weight shape's algorithm is chosen for: a prefill's batch, large enough
/// that the heuristic answers with a kernel fit for batches, small enough to serve decoding.
pub const REFERENCE_ROWS: usize = 256;
/// Answers asked of the heuristic: the first that also serves one row is kept.
const CANDIDATES: usize = 16;
/// The byte alignment the chosen algorithms may assume of every operand (the heuristic's default
/// is 256, which a view into a larger tensor need not meet): an operand off it is copied first.
const ALIGNMENT: usize = 16;
/// The workspace offered where no algorithm needing none serves a shape (NVIDIA's advice for
/// Hopper), one a candle device (a stream), allocated the first time one is needed.
pub const WORKSPACE: usize = 32 << 20;

/// `x · wᵀ` for `x` `(rows, inputs)` and `w` `(outputs, inputs)` on a CUDA device, in bf16, f16
/// or f32, through the one cuBLASLt algorithm pinned to `w`'s shape and dtype on that device, so
/// that each output row is summed in the same order whatever the row count (see the module's
/// doc); the paged decoder's dense layers on CUDA.
pub fn pinned_product(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (rows, inputs) = x.dims2()?;
    let (outputs, k) = w.dims2()?;
    if k != inputs {
        candle_core::bail!("pinned product: rows of {inputs} against weights of {k}");
    }
    if x.dtype() != w.dtype() {
        candle_core::bail!(
            "pinned product: rows in {:?} against weights in {:?}",
            x.dtype(),
            w.dtype()
        );
    }
    if rows == 0 {
        return Tensor::zeros((0, outputs), x.dtype(), x.device());
    }
    aligned(x)?.apply_op2_no_bwd(&aligned(w)?, &PinnedProduct)
}

/// `t` contiguous, its first element on an [`ALIGNMENT`]-byte boundary (candle's allocations
/// are; a view into one may start off it, and is then copied).
fn aligned(t: &Tensor) -> Result<Tensor> {
    let offset = t.layout().start_offset() * t.dtype().size_in_bytes();
    match t.is_contiguous() && offset.is_multiple_of(ALIGNMENT) {
        true => Ok(t.clone()),
        false => t.force_contiguous(),
    }
}

/// The custom op behind [`pinned_product`]: `cuda_fwd` returns candle's storage of the product;
/// there is no CPU side (the CPU's dense layers are `linear`'s own op).
struct PinnedProduct;

impl CustomOp2 for PinnedProduct {
    fn name(&self) -> &'static str {
        "pinned-product"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the pinned cuBLASLt product runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_layout: &Layout,
        w: &CudaStorage,
        w_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, inputs) = x_layout.shape().dims2()?;
        let (outputs, k) = w_layout.shape().dims2()?;
        if k != inputs {
            candle_core::bail!("pinned product: rows of {inputs} against weights of {k}");
        }
        let dims = Dims {
            rows,
            inputs,
            outputs,
        };
        let (x, w) = ((x, x_layout), (w, w_layout));
        let out = match x.0.dtype() {
            DType::F32 => run::<f32>(x, w, dims)?,
            DType::F16 => run::<half::f16>(x, w, dims)?,
            DType::BF16 => run::<half::bf16>(x, w, dims)?,
            other => candle_core::bail!("pinned product: not in {other:?}"),
        };
        Ok((out, Shape::from((rows, outputs))))
    }
}

/// One product's sizes.
#[derive(Clone, Copy)]
struct Dims {
    rows: usize,
    inputs: usize,
    outputs: usize,
}

/// The product in `T`: the output allocated on the device, cuBLASLt called on candle's stream.
fn run<T: CudaDType + DeviceRepr>(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    dims: Dims,
) -> Result<CudaStorage> {
    let dev = x.0.device().clone();
    if w.0.device().cuda_stream().context().ordinal() != dev.cuda_stream().context().ordinal() {
        candle_core::bail!("pinned product: rows and weights on different devices");
    }
    let (x_view, w_view) = (view::<T>(x)?, view::<T>(w)?);
    // SAFETY: cuBLASLt writes every element of the output (beta is 0: nothing is read from it).
    let mut out = unsafe { dev.alloc::<T>(dims.rows * dims.outputs)? };
    let stream = dev.cuda_stream();
    {
        let (x_ptr, _x_read) = x_view.device_ptr(&stream);
        let (w_ptr, _w_read) = w_view.device_ptr(&stream);
        let (y_ptr, _y_write) = out.device_ptr_mut(&stream);
        let size = std::mem::size_of::<T>() as u64;
        // At most REFERENCE_ROWS rows a call: the row counts the device check proves the
        // algorithm row-invariant at. A prompt step of thousands of rows is so many such calls
        // (each row computed as it is alone), not a row count nothing was checked at.
        for first in (0..dims.rows).step_by(REFERENCE_ROWS) {
            let rows = REFERENCE_ROWS.min(dims.rows - first);
            let pointers = Pointers {
                x: x_ptr + first as u64 * dims.inputs as u64 * size,
                w: w_ptr,
                y: y_ptr + first as u64 * dims.outputs as u64 * size,
            };
            let chunk = Dims { rows, ..dims };
            matmul(&dev, &stream, x.0.dtype(), chunk, pointers)?;
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The operands' device addresses.
struct Pointers {
    x: u64,
    w: u64,
    y: u64,
}

/// `y = x · wᵀ` in cuBLASLt's column-major terms: `yᵀ (outputs × rows) = w (outputs × inputs) ·
/// xᵀ (inputs × rows)`, with `w` read transposed (row-major `w` is column-major `wᵀ`).
fn matmul(
    dev: &CudaDevice,
    stream: &CudaStream,
    dtype: DType,
    dims: Dims,
    p: Pointers,
) -> Result<()> {
    for (name, ptr) in [("rows", p.x), ("weights", p.w), ("output", p.y)] {
        if !ptr.is_multiple_of(ALIGNMENT as u64) {
            candle_core::bail!("pinned product: the {name} are not {ALIGNMENT}-byte aligned");
        }
    }
    stream.context().bind_to_thread().w()?;
    let ordinal = stream.context().ordinal();
    let key = Key {
        ordinal,
        outputs: dims.outputs,
        inputs: dims.inputs,
        dtype,
    };
    let problem = Problem::new(dtype, dims.outputs, dims.inputs, dims.rows)?;
    let mut guard = state()?;
    let handle = guard.handle(ordinal)?;
    let state = &mut *guard;
    let pinned = match state.algos.entry(key) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => {
            let (algo, workspace) = choose(handle, key)?;
            e.insert(Pinned {
                algo,
                workspace,
                served: HashSet::new(),
            })
        }
    };
    if !pinned.served.contains(&dims.rows) {
        problem
            .check(handle, &pinned.algo, pinned.workspace)
            .map_err(|e| {
                candle_core::Error::Msg(format!(
                    "pinned product: the cuBLASLt algorithm pinned to {} -> {} in {dtype:?} on \
                 device {ordinal} cannot serve {} rows ({e}); no other is chosen, since another \
                 would sum these rows in another order",
                    dims.inputs, dims.outputs, dims.rows
                ))
            })?;
        pinned.served.insert(dims.rows);
    }
    let workspace = match pinned.workspace {
        0 => None,
        _ => Some(match state.workspaces.entry(dev.id()) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(dev.alloc_zeros::<u8>(WORKSPACE)?),
        }),
    };
    let (workspace_ptr, _workspace_use) = match workspace {
        Some(w) => {
            let (ptr, guard) = w.device_ptr_mut(stream);
            (ptr, Some(guard))
        }
        None => (0, None),
    };
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: the descriptors are live (owned by `problem`), describe the operands' sizes and
    // leading dimensions (checked contiguous by `view`), and the algorithm was checked against
    // them above; the pointers are the operands' device memory, kept alive and ordered on
    // `stream` by the callers' guards; C is D (beta is 0, so C is not read); the workspace is
    // `pinned.workspace` bytes of device memory (none, a null pointer, where it is 0), at least
    // what the algorithm needs (`Problem::check`), ordered on `stream` by its guard.
    unsafe {
        sys::cublasLtMatmul(
            handle,
            problem.desc.0,
            (&alpha) as *const f32 as *const c_void,
            p.w as *const c_void,
            problem.a.0,
            p.x as *const c_void,
            problem.b.0,
            (&beta) as *const f32 as *const c_void,
            p.y as *const c_void,
            problem.c.0,
            p.y as *mut c_void,
            problem.c.0,
            &pinned.algo,
            workspace_ptr as *mut c_void,
            pinned.workspace,
            stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .result()
    .map_err(|e| failed("cublasLtMatmul", e))
}

/// A weight shape on a device: what one algorithm is pinned to.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Key {
    ordinal: usize,
    outputs: usize,
    inputs: usize,
    dtype: DType,
}

/// The algorithm pinned to a [`Key`], the workspace it is given (0 or [`WORKSPACE`] bytes) and
/// the row counts it was checked to serve.
struct Pinned {
    algo: sys::cublasLtMatmulAlgo_t,
    workspace: usize,
    served: HashSet<usize>,
}

/// A cuBLASLt handle, one a device for the process's life.
struct Handle(sys::cublasLtHandle_t);

// SAFETY: a cuBLASLt handle is not tied to the thread that made it, and it is only used under
// `STATE`'s lock.
unsafe impl Send for Handle {}

/// The process's handles (one a GPU), workspaces (one a candle device, whose stream orders its
/// uses) and pinned algorithms.
#[derive(Default)]
struct State {
    handles: HashMap<usize, Handle>,
    workspaces: HashMap<DeviceId, CudaSlice<u8>>,
    algos: HashMap<Key, Pinned>,
}

impl State {
    /// The handle of device `ordinal` (whose context is current), made the first time.
    fn handle(&mut self, ordinal: usize) -> Result<sys::cublasLtHandle_t> {
        if let Some(h) = self.handles.get(&ordinal) {
            return Ok(h.0);
        }
        let h = lt::create_handle().map_err(|e| failed("cublasLtCreate", e))?;
        self.handles.insert(ordinal, Handle(h));
        Ok(h)
    }
}

/// The process's state, locked.
fn state() -> Result<MutexGuard<'static, State>> {
    static STATE: OnceLock<Mutex<State>> = OnceLock::new();
    STATE
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg("pinned product: state poisoned".into()))
}

/// A cuBLASLt failure as candle's error.
fn failed(call: &str, e: CublasError) -> candle_core::Error {
    candle_core::Error::Msg(format!("pinned product: {call}: {e}"))
}

/// cuBLASLt's name for `dtype`.
fn data_type(dtype: DType) -> Result<sys::cudaDataType> {
    Ok(match dtype {
        DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
        DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
        other => candle_core::bail!("pinned product: not in {other:?}"),
    })
}

/// The algorithm pinned to `key` and the workspace it is given: of the heuristic's answers for
/// [`REFERENCE_ROWS`] rows with no reduction across blocks, the first that (split-K pinned to 1)
/// serves those rows and one row, with no workspace if one such needs none, else with
/// [`WORKSPACE`] bytes.
fn choose(handle: sys::cublasLtHandle_t, key: Key) -> Result<(sys::cublasLtMatmulAlgo_t, usize)> {
    let reference = Problem::new(key.dtype, key.outputs, key.inputs, REFERENCE_ROWS)?;
    let one = Problem::new(key.dtype, key.outputs, key.inputs, 1)?;
    let mut refused = vec![];
    for workspace in [0, WORKSPACE] {
        let answers = heuristic(handle, &reference, workspace)?;
        if answers.is_empty() {
            refused.push(format!("{workspace} B: no answer"));
        }
        for (i, answer) in answers.iter().enumerate() {
            let mut algo = answer.algo;
            let served = pin_split_k(&mut algo)
                .map_err(|e| e.to_string())
                .and_then(|_| reference.check(handle, &algo, workspace))
                .and_then(|_| one.check(handle, &algo, workspace));
            match served {
                Ok(()) => return Ok((algo, workspace)),
                Err(e) => refused.push(format!("{workspace} B, answer {i}: {e}")),
            }
        }
    }
    candle_core::bail!(
        "pinned product: cuBLASLt offers no algorithm without split-K for {} -> {} in {:?} \
         serving 1 and {REFERENCE_ROWS} rows ({})",
        key.inputs,
        key.outputs,
        key.dtype,
        refused.join("; ")
    )
}

/// The heuristic's answers for `problem` with no reduction across blocks (no split-K), at most
/// `workspace` bytes of workspace and operands on [`ALIGNMENT`]-byte boundaries, best first.
fn heuristic(
    handle: sys::cublasLtHandle_t,
    problem: &Problem,
    workspace: usize,
) -> Result<Vec<sys::cublasLtMatmulHeuristicResult_t>> {
    let pref = Preference::new()?;
    let none = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
    pref.set(
        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
        &none,
    )?;
    pref.set(
        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        &(workspace as u64),
    )?;
    for attr in [
        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
    ] {
        pref.set(attr, &(ALIGNMENT as u32))?;
    }
    let mut answers = [empty_answer(); CANDIDATES];
    let mut count: c_int = 0;
    // SAFETY: the descriptors are live; `answers` holds `CANDIDATES` results, as many as asked.
    unsafe {
        sys::cublasLtMatmulAlgoGetHeuristic(
            handle,
            problem.desc.0,
            problem.a.0,
            problem.b.0,
            problem.c.0,
            problem.c.0,
            pref.0,
            CANDIDATES as c_int,
            answers.as_mut_ptr(),
            &mut count,
        )
    }
    .result()
    .map_err(|e| failed("cublasLtMatmulAlgoGetHeuristic", e))?;
    let count = usize::try_from(count).unwrap_or(0).min(CANDIDATES);
    Ok(answers[..count]
        .iter()
        .filter(|a| a.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        .copied()
        .collect())
}

/// The configuration pinned to `w`'s shape `(outputs, inputs)` in `dtype` on `device`, in words
/// (cuBLASLt's algorithm id, tile, stages, split-K, CTA swizzling, custom option, and the
/// workspace given), for a check to report which one serves the shape; `None` where none is
/// pinned yet or `device` is not CUDA.
pub fn pinned_config(
    device: &candle_core::Device,
    outputs: usize,
    inputs: usize,
    dtype: DType,
) -> Option<String> {
    let ordinal = device
        .as_cuda_device()
        .ok()?
        .cuda_stream()
        .context()
        .ordinal();
    let key = Key {
        ordinal,
        outputs,
        inputs,
        dtype,
    };
    let state = state().ok()?;
    let pinned = state.algos.get(&key)?;
    let read = |attr| -> String {
        let (mut value, mut written) = (0u32, 0usize);
        // SAFETY: the algorithm is initialised; the buffer is one uint32_t (each attribute read
        // here is an int32_t or uint32_t).
        let status = unsafe {
            sys::cublasLtMatmulAlgoConfigGetAttribute(
                &pinned.algo,
                attr,
                (&mut value) as *mut u32 as *mut c_void,
                std::mem::size_of::<u32>(),
                &mut written,
            )
        };
        match status.result() {
            Ok(()) => value.to_string(),
            Err(_) => "?".into(),
        }
    };
    use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
    Some(format!(
        "algo {} tile {} stages {} split-k {} swizzle {} custom {}, workspace {} B",
        read(A::CUBLASLT_ALGO_CONFIG_ID),
        read(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
        read(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        read(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
        read(A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
        read(A::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
        pinned.workspace
    ))
}

/// Sets `algo`'s split-K to 1 (and its reduction scheme to none) where it is not already: the
/// preference's reduction mask already rules split-K out, this makes it the algorithm's own.
fn pin_split_k(algo: &mut sys::cublasLtMatmulAlgo_t) -> Result<()> {
    let attr = sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM;
    let (mut splits, mut written) = (0u32, 0usize);
    // SAFETY: `algo` is an initialised algorithm; the buffer is the attribute's uint32_t.
    unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            attr,
            (&mut splits) as *mut u32 as *mut c_void,
            std::mem::size_of::<u32>(),
            &mut written,
        )
    }
    .result()
    .map_err(|e| failed("cublasLtMatmulAlgoConfigGetAttribute", e))?;
    if splits == 1 {
        return Ok(());
    }
    let none = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
    for (attr, value) in [
        (attr, 1u32),
        (
            sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
            none,
        ),
    ] {
        // SAFETY: `algo` is an initialised algorithm; the value is the attribute's uint32_t.
        unsafe {
            sys::cublasLtMatmulAlgoConfigSetAttribute(
                algo,
                attr,
                (&value) as *const u32 as *const c_void,
                std::mem::size_of::<u32>(),
            )
        }
        .result()
        .map_err(|e| failed("cublasLtMatmulAlgoConfigSetAttribute", e))?;
    }
    Ok(())
}

/// A heuristic result to be overwritten.
fn empty_answer() -> sys::cublasLtMatmulHeuristicResult_t {
    sys::cublasLtMatmulHeuristicResult_t {
        algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        workspaceSize: 0,
        state: sys::cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED,
        wavesCount: 0.0,
        reserved: [0; 4],
    }
}

/// The descriptors of one product `yᵀ = w · xᵀ` (column-major): compute and scale in f32, `w`
/// (A) transposed, `x` (B) not.
struct Problem {
    rows: usize,
    desc: Desc,
    a: MatrixLayout,
    b: MatrixLayout,
    c: MatrixLayout,
}

impl Problem {
    /// The descriptors for `rows` rows of `inputs` against `outputs` weight rows in `dtype`.
    fn new(dtype: DType, outputs: usize, inputs: usize, rows: usize) -> Result<Self> {
        let data = data_type(dtype)?;
        let desc = Desc(
            lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType_t::CUDA_R_32F,
            )
            .map_err(|e| failed("cublasLtMatmulDescCreate", e))?,
        );
        // cublasOperation_t: 1 is CUBLAS_OP_T, 0 CUBLAS_OP_N.
        for (attr, op) in [
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                1i32,
            ),
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                0i32,
            ),
        ] {
            // SAFETY: `desc` is live; the value is the attribute's int32_t.
            unsafe {
                lt::set_matmul_desc_attribute(
                    desc.0,
                    attr,
                    (&op) as *const i32 as *const c_void,
                    std::mem::size_of::<i32>(),
                )
            }
            .map_err(|e| failed("cublasLtMatmulDescSetAttribute", e))?;
        }
        let layout = |r: usize, c: usize, ld: usize| -> Result<MatrixLayout> {
            lt::create_matrix_layout(data, r as u64, c as u64, ld as i64)
                .map(MatrixLayout)
                .map_err(|e| failed("cublasLtMatrixLayoutCreate", e))
        };
        Ok(Self {
            rows,
            desc,
            // w, row-major (outputs, inputs): column-major inputs × outputs, read transposed.
            a: layout(inputs, outputs, inputs)?,
            // x, row-major (rows, inputs): column-major inputs × rows.
            b: layout(inputs, rows, inputs)?,
            // y, row-major (rows, outputs): column-major outputs × rows.
            c: layout(outputs, rows, outputs)?,
        })
    }

    /// Whether `algo` serves this product with at most `workspace` bytes of workspace
    /// (`cublasLtMatmulAlgoCheck`).
    fn check(
        &self,
        handle: sys::cublasLtHandle_t,
        algo: &sys::cublasLtMatmulAlgo_t,
        workspace: usize,
    ) -> std::result::Result<(), String> {
        let mut answer = empty_answer();
        // SAFETY: the descriptors are live; `answer` is one result to write.
        unsafe {
            sys::cublasLtMatmulAlgoCheck(
                handle,
                self.desc.0,
                self.a.0,
                self.b.0,
                self.c.0,
                self.c.0,
                algo,
                &mut answer,
            )
        }
        .result()
        .map_err(|e| format!("{} rows: cublasLtMatmulAlgoCheck: {e}", self.rows))?;
        answer
            .state
            .result()
            .map_err(|e| format!("{} rows: cublasLtMatmulAlgoCheck: {e}", self.rows))?;
        if answer.workspaceSize > workspace {
            return Err(format!(
                "{} rows: it needs {} bytes of workspace",
                self.rows, answer.workspaceSize
            ));
        }
        Ok(())
    }
}

/// A matmul descriptor, destroyed when dropped.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: made by `create_matmul_desc`, destroyed once, here.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

/// A matrix layout, destroyed when dropped.
struct MatrixLayout(sys::cublasLtMatrixLayout_t);

impl Drop for MatrixLayout {
    fn drop(&mut self) {
        // SAFETY: made by `create_matrix_layout`, destroyed once, here.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

/// A heuristic's preferences, destroyed when dropped.
struct Preference(sys::cublasLtMatmulPreference_t);

impl Preference {
    /// Fresh preferences (cuBLASLt's defaults).
    fn new() -> Result<Self> {
        lt::create_matmul_pref()
            .map(Self)
            .map_err(|e| failed("cublasLtMatmulPreferenceCreate", e))
    }

    /// Sets `attr` to `value`, whose type must be the attribute's.
    fn set<T: Copy>(
        &self,
        attr: sys::cublasLtMatmulPreferenceAttributes_t,
        value: &T,
    ) -> Result<()> {
        // SAFETY: the preferences are live; `value` is `size_of::<T>()` readable bytes, and the
        // callers pass each attribute's own type (uint32_t, or uint64_t for the workspace).
        unsafe {
            lt::set_matmul_pref_attribute(
                self.0,
                attr,
                value as *const T as *const c_void,
                std::mem::size_of::<T>(),
            )
        }
        .map_err(|e| failed("cublasLtMatmulPreferenceSetAttribute", e))
    }
}

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: made by `create_matmul_pref`, destroyed once, here.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}
