//! Self-attention straight out of the fused QKV product, for every text and head at once: its
//! two products in f32 (the `gemm` crate, softmax from [`crate::kernels`]) or, beside dense
//! layers on AMX tiles, in bf16 there ([`crate::packed::amx::attention`]). Above both the
//! kernels and the packed formats, so neither imports the other for it.

use crate::kernels::softmax;
use gemm::Parallelism;
use rayon::prelude::*;
use std::cell::RefCell;

/// A raw pointer that rayon tasks may share because each writes a disjoint region.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: see `attention`: tasks write disjoint (rows, head columns) blocks.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The element `offset` places in. (A method, so closures capture the whole Sync wrapper
    /// rather than its raw pointer field.)
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    #[cfg(target_arch = "x86_64")]
    static TILE_BUFFERS: RefCell<crate::packed::amx::attention::Buffers> =
        RefCell::new(Default::default());
}

/// Where attention's two products run: f32 (the `gemm` crate), or bf16 on AMX tiles beside
/// dense layers that run there ([`crate::packed::amx::attention`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AttentionProducts {
    F32,
    Bf16Amx,
}

impl AttentionProducts {
    /// The products beside dense layers computed in `format`: on AMX tiles where they are.
    pub(crate) fn beside(format: Option<crate::packed::Format>) -> Self {
        match format {
            Some(crate::packed::Format::Bf16Amx) => Self::Bf16Amx,
            _ => Self::F32,
        }
    }
}

/// Self-attention for every text and head, reading Q, K and V in place from the fused
/// `(rows, 3 * hidden)` projection and writing each head's context into its columns of `ctx`.
///
/// Panics if `products` is [`AttentionProducts::Bf16Amx`] on a CPU without AMX.
pub(crate) fn attention(
    qkv: &[f32],
    ctx: &mut [f32],
    spans: &[(usize, usize)],
    h: usize,
    heads: usize,
    products: AttentionProducts,
) {
    // The products below read and write through raw pointers: these checks, in release builds
    // too, are what keeps every span's rows inside qkv and ctx.
    assert!(
        heads > 0 && h.is_multiple_of(heads),
        "attention: {h} columns in {heads} heads"
    );
    let rows = ctx.len() / h;
    assert!(
        ctx.len() == rows * h && qkv.len() == rows * 3 * h,
        "attention: shapes"
    );
    assert!(
        spans
            .iter()
            .all(|&(o, len)| o.checked_add(len).is_some_and(|end| end <= rows)),
        "attention: a span past the last of {rows} rows"
    );
    // AMX exists on x86-64 only.
    let tiles = cfg!(target_arch = "x86_64") && products == AttentionProducts::Bf16Amx;
    assert!(
        !tiles || crate::packed::Format::Bf16Amx.supported(),
        "attention: no AMX on this CPU"
    );
    let dh = h / heads;
    let out = SharedOut(ctx.as_mut_ptr());
    // Longest texts first: they are the biggest tasks, so the pool ends evenly.
    let mut tasks: Vec<(usize, usize)> = (0..spans.len())
        .flat_map(|s| (0..heads).map(move |hd| (s, hd)))
        .collect();
    tasks.sort_by_key(|&(s, _)| std::cmp::Reverse(spans[s].1));
    tasks.par_iter().for_each(|&(s, hd)| {
        let (o, len) = spans[s];
        // The context block (rows o..o+len, columns of head hd) lies inside ctx (checked above)
        // and no other task writes it.
        let block = out.at(o * h + hd * dh);
        if tiles {
            #[cfg(target_arch = "x86_64")]
            TILE_BUFFERS.with(|buf| {
                let head = crate::packed::amx::attention::Head {
                    qkv: &qkv[o * 3 * h..(o + len) * 3 * h],
                    stride: 3 * h,
                    len,
                    q: hd * dh,
                    k: h + hd * dh,
                    v: 2 * h + hd * dh,
                    dh,
                    scale: 1.0 / (dh as f32).sqrt(),
                };
                // SAFETY: AMX is supported (checked above); the block is as said.
                unsafe {
                    crate::packed::amx::attention::head(&head, block, h, &mut buf.borrow_mut())
                }
            });
        } else {
            SCORES.with(|buf| head_f32(qkv, (o, len), hd, h, heads, block, &mut buf.borrow_mut()));
        }
    });
}

/// One head of one text in f32: `scores = scale · Q·Kᵀ`, softmax, then `scores · V` into
/// `block` (`len` rows `h` apart).
fn head_f32(
    qkv: &[f32],
    (o, len): (usize, usize),
    hd: usize,
    h: usize,
    heads: usize,
    block: *mut f32,
    buf: &mut Vec<f32>,
) {
    let dh = h / heads;
    let scale = 1.0 / (dh as f32).sqrt();
    let stride = 3 * h;
    if buf.len() < len * len {
        buf.resize(len * len, 0.0);
    }
    let scores = &mut buf[..len * len];
    let q = qkv[o * stride + hd * dh..].as_ptr();
    let k = qkv[o * stride + h + hd * dh..].as_ptr();
    let v = qkv[o * stride + 2 * h + hd * dh..].as_ptr();
    // SAFETY: q, k and v address `len` rows of `dh` columns with row stride 3h inside qkv
    // (attention checked the span); scores is len × len.
    unsafe {
        gemm::gemm(
            len,
            len,
            dh,
            scores.as_mut_ptr(),
            1,
            len as isize,
            false,
            q,
            1,
            stride as isize,
            k,
            stride as isize,
            1,
            0.0,
            scale,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
    for row in scores.chunks_exact_mut(len) {
        softmax(row);
    }
    // SAFETY: as above: scores (len × len) times v's `len` rows into the block, which
    // attention gives this head alone.
    unsafe {
        gemm::gemm(
            len,
            dh,
            len,
            block,
            1,
            h as isize,
            false,
            scores.as_ptr(),
            1,
            len as isize,
            v,
            1,
            stride as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}
