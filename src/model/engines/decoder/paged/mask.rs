//! Constrained rows masked on the device (issue 52): a constrained sequence's logits outside
//! what its grammar allows next are set to −∞ where they are, from a bitmask of the allowed ids,
//! and its token is then chosen there as any other's (`argmax`, `sample`). So a constrained
//! step copies one bitmask a row up (≈19 KB for Qwen2's 151,936 ids) and one id back, instead
//! of copying the row's logits back (≈600 KB) and choosing on the host. [`MaskRows`]' `cpu_fwd`
//! is `constrain::apply`'s rule, bit for bit; the kernel (`kernels/paged.cu`, `mask_rows`) is
//! the same test per element.

use crate::model::engines::host::{f32s, u32s};
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape};
use llguidance::toktrie::SimpleVob;

/// A step's masks, one a constrained row, in the rows' order.
#[derive(Debug, Clone, PartialEq)]
pub struct Masks {
    /// Ids the masks speak for (the grammar's vocabulary).
    pub allowed: usize,
    /// Words a row.
    pub words: usize,
    /// `rows × words`: bit `i % 32` of word `i / 32` set where id `i` is allowed.
    pub bits: Vec<u32>,
}

impl Masks {
    /// The masks of rows each given by its constraint's mask, or `None` for a row whose
    /// constraint failed (its token will not be used: every id allowed, so a choice is made as
    /// for any row), for a model of `vocab` ids.
    pub fn new(rows: &[Option<&SimpleVob>], vocab: usize) -> Result<Self> {
        let (allowed, words) = match rows.iter().flatten().next() {
            Some(first) => (first.len(), first.as_slice().len()),
            None => (vocab, vocab.div_ceil(32)),
        };
        let mut bits = Vec::with_capacity(rows.len() * words);
        for row in rows {
            match row {
                Some(v) if v.len() == allowed && v.as_slice().len() == words => {
                    bits.extend_from_slice(v.as_slice())
                }
                Some(v) => candle_core::bail!("masks of {} and {allowed} ids in one step", v.len()),
                None => bits.extend(std::iter::repeat_n(u32::MAX, words)),
            }
        }
        Ok(Self {
            allowed,
            words,
            bits,
        })
    }
}

/// `(rows, vocab)` logits (f32, f16 or bf16) and `(rows, words)` u32 masks to `(rows, vocab)`
/// f32 logits where every id a row's mask does not allow is −∞: id `i` is allowed where it is
/// below `allowed` (the masks' vocabulary, which a model's padded output rows may exceed) and
/// bit `i % 32` of word `i / 32` of its row is set. The values kept are widened exactly, so the
/// choice after it is the choice the host made from the same row.
#[derive(Debug, Clone, Copy)]
pub struct MaskRows {
    /// Ids the masks speak for; those past it are never allowed.
    pub allowed: usize,
}

impl MaskRows {
    /// Whether `id` is allowed by a row's `words`.
    fn allows(&self, words: &[u32], id: usize) -> bool {
        id < self.allowed && words.get(id / 32).is_some_and(|w| w >> (id % 32) & 1 == 1)
    }

    /// The masks' shape against the logits': `(rows, words)`.
    fn words(&self, logits: &Layout, masks: &Layout) -> Result<(usize, usize, usize)> {
        let (rows, vocab) = logits.shape().dims2()?;
        let (mask_rows, words) = masks.shape().dims2()?;
        if mask_rows != rows || words * 32 < self.allowed.min(vocab) {
            candle_core::bail!(
                "masks of {mask_rows} × {words} words for {rows} rows of {} allowed ids",
                self.allowed.min(vocab)
            );
        }
        Ok((rows, vocab, words))
    }
}

impl CustomOp2 for MaskRows {
    fn name(&self) -> &'static str {
        "mask-rows"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        logits_layout: &Layout,
        masks: &CpuStorage,
        masks_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab, words) = self.words(logits_layout, masks_layout)?;
        let mut values = f32s(logits, logits_layout)?;
        let masks = u32s(masks, masks_layout)?;
        for (row, mask) in values.chunks_mut(vocab).zip(masks.chunks(words)) {
            for (id, v) in row.iter_mut().enumerate() {
                if !self.allows(mask, id) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        Ok((CpuStorage::F32(values), Shape::from((rows, vocab))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        logits_layout: &Layout,
        masks: &candle_core::CudaStorage,
        masks_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, vocab, words) = self.words(logits_layout, masks_layout)?;
        let shape = (rows, vocab, words, self.allowed.min(vocab));
        super::cuda::mask_rows((logits, logits_layout), (masks, masks_layout), shape)
    }
}

#[cfg(test)]
mod tests {
    use super::MaskRows;
    use crate::model::engines::decoder::constrain;
    use candle_core::{DType, Device, Tensor};
    use llguidance::toktrie::SimpleVob;

    /// On rows of every dtype, with masks whose vocabulary is shorter than the rows (a padded
    /// output layer) and whose last word has bits set past it: what `constrain::apply` makes of
    /// the same row on the host, bit for bit.
    #[test]
    fn a_masked_row_is_the_hosts_masked_row() {
        let (rows, vocab, allowed) = (3, 100, 90);
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 8.0)
            .collect();
        let vobs: Vec<SimpleVob> = (0..rows)
            .map(|r| {
                let mut vob = SimpleVob::alloc(allowed);
                for id in (r..allowed).step_by(r + 2) {
                    vob.allow_token(id as u32);
                }
                vob
            })
            .collect();
        let words = vobs[0].as_slice().len();
        let mut flat: Vec<u32> = vobs.iter().flat_map(|v| v.as_slice().to_vec()).collect();
        // Bits past the vocabulary the masks speak for allow nothing.
        flat[words - 1] |= 1 << 31;
        let masks = Tensor::from_vec(flat, (rows, words), &Device::Cpu).unwrap();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let t = Tensor::from_vec(logits.clone(), (rows, vocab), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let got = t
                .apply_op2(&masks, MaskRows { allowed })
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let widened = t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
            for (r, (mut want, got)) in widened.into_iter().zip(got).enumerate() {
                constrain::apply(&vobs[r], &mut want);
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{dtype:?} row {r}");
                assert!(want.iter().any(|v| v.is_finite()), "row {r} keeps some ids");
            }
        }
    }
}
