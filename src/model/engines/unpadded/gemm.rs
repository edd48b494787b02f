//! The one matrix-product call the unpadded encoder makes for each dense layer, written down once
//! as cuBLASLt takes it, and a plain product that takes the same description.
//!
//! cuBLASLt is column-major and is handed lengths, leading dimensions and transposes, so a layout
//! mistake is a wrong number, not a crash, and it shows only on a GPU. [`GemmCall::linear`] is the
//! description the CUDA path hands to cuBLASLt (`super::cuda`), and [`GemmCall::reference`] is a
//! plain product that reads its operands through the same description: the CPU path computes
//! every dense layer with it, and its tests compare it with candle's CPU matmul, so a description
//! that does not mean `x·Wᵀ + b` fails on the CPU.

/// One column-major product `C = op(A)·op(B) + bias` as cuBLASLt describes it: `C` is `m × n`
/// with leading dimension `ldc`, `op(A)` is `m × k`, `op(B)` is `k × n`; the bias (length `m`) is
/// added to every column (cuBLASLt's `BIAS` epilogue).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmCall {
    /// A is stored `k × m` and read transposed.
    pub transa: bool,
    /// B is stored `n × k` and read transposed.
    pub transb: bool,
    /// Rows of C (and of op(A)).
    pub m: usize,
    /// Columns of C (and of op(B)).
    pub n: usize,
    /// The summed dimension.
    pub k: usize,
    /// Leading dimension of A as stored.
    pub lda: usize,
    /// Leading dimension of B as stored.
    pub ldb: usize,
    /// Leading dimension of C.
    pub ldc: usize,
}

impl GemmCall {
    /// `y = x·Wᵀ + b` for `x` row-major `(tokens, inputs)`, `W` row-major `(outputs, inputs)` as
    /// a transformers `Linear` stores it, and `y` row-major `(tokens, outputs)`. Read as
    /// column-major, row-major `y` is `yᵀ (outputs × tokens)`, so `yᵀ = W·xᵀ`: A is `W` (stored
    /// column-major as `inputs × outputs`, read transposed), B is `x` (stored column-major as
    /// `inputs × tokens`, read as it is), and the bias runs along C's rows, one per output.
    pub fn linear(tokens: usize, inputs: usize, outputs: usize) -> Self {
        Self {
            transa: true,
            transb: false,
            m: outputs,
            n: tokens,
            k: inputs,
            lda: inputs,
            ldb: inputs,
            ldc: outputs,
        }
    }

    /// Elements each operand must hold for this call to stay in bounds: `(a, b, c)`.
    pub fn extents(&self) -> (usize, usize, usize) {
        let (a_cols, b_cols) = (
            if self.transa { self.m } else { self.k },
            if self.transb { self.k } else { self.n },
        );
        (self.lda * a_cols, self.ldb * b_cols, self.ldc * self.n)
    }

    /// The product this call describes, in f32: `c` gets `op(A)·op(B) (+ bias)`. Where both
    /// operands' `k` runs along a stored column (the dense layers' case) each sum is a dot product
    /// of two contiguous slices in eight interleaved partial sums, as a GPU's or a SIMD CPU's
    /// product splits it (one running sum over a wide `k` drifts further from either); otherwise
    /// the sum runs over `k` in order.
    pub fn reference(&self, a: &[f32], b: &[f32], bias: Option<&[f32]>, c: &mut [f32]) {
        let (ea, eb, ec) = self.extents();
        assert!(
            a.len() >= ea && b.len() >= eb && c.len() >= ec,
            "{self:?}: operands too short"
        );
        for j in 0..self.n {
            for i in 0..self.m {
                let sum = if self.transa && !self.transb {
                    let row = &a[i * self.lda..i * self.lda + self.k];
                    let col = &b[j * self.ldb..j * self.ldb + self.k];
                    dot(row, col)
                } else {
                    (0..self.k).map(|l| self.a(a, i, l) * self.b(b, l, j)).sum()
                };
                c[i + j * self.ldc] = sum + bias.map_or(0.0, |b| b[i]);
            }
        }
    }

    /// op(A)[i, l].
    fn a(&self, a: &[f32], i: usize, l: usize) -> f32 {
        if self.transa {
            a[l + i * self.lda]
        } else {
            a[i + l * self.lda]
        }
    }

    /// op(B)[l, j].
    fn b(&self, b: &[f32], l: usize, j: usize) -> f32 {
        if self.transb {
            b[j + l * self.ldb]
        } else {
            b[l + j * self.ldb]
        }
    }
}

/// `Σ a_l·b_l` in eight partial sums (element `l` into sum `l mod 8`), added pairwise.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut partial = [0f32; 8];
    for (l, (x, y)) in a.iter().zip(b).enumerate() {
        partial[l % 8] += x * y;
    }
    let [p0, p1, p2, p3, p4, p5, p6, p7] = partial;
    ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))
}

#[cfg(test)]
mod tests {
    use super::GemmCall;
    use candle_core::{Device, Tensor};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// The call the dense layers hand to cuBLASLt computes `x·Wᵀ + b` as candle does, for shapes
    /// whose sides differ (a swapped m/n or lda/ldb would index out of place or out of bounds).
    #[test]
    fn the_linear_call_is_x_times_w_transposed_plus_bias() {
        for (tokens, inputs, outputs) in [(1, 3, 5), (7, 16, 48), (53, 32, 96), (5, 64, 8)] {
            let (x, w, bias) = (
                random(tokens * inputs, 1),
                random(outputs * inputs, 2),
                random(outputs, 3),
            );
            let call = GemmCall::linear(tokens, inputs, outputs);
            let mut got = vec![f32::NAN; tokens * outputs];
            call.reference(&w, &x, Some(&bias), &mut got);
            let t = |v: &[f32], r, c| Tensor::from_slice(v, (r, c), &Device::Cpu).unwrap();
            let want = t(&x, tokens, inputs)
                .matmul(&t(&w, outputs, inputs).t().unwrap())
                .unwrap()
                .broadcast_add(&Tensor::from_slice(&bias, outputs, &Device::Cpu).unwrap())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-5, "{tokens}x{inputs}->{outputs}: {worst}");
        }
    }

    /// The general path (any transposes) agrees with the contiguous one, so a call with other
    /// transposes is checked by the same arithmetic.
    #[test]
    fn every_transpose_reads_the_same_matrices() {
        let (m, n, k) = (6, 4, 5);
        let a_mk = random(m * k, 4); // op(A) row-major m × k
        let b_kn = random(k * n, 5); // op(B) row-major k × n
        let want: Vec<f32> = (0..n)
            .flat_map(|j| (0..m).map(move |i| (i, j)))
            .map(|(i, j)| (0..k).map(|l| a_mk[i * k + l] * b_kn[l * n + j]).sum())
            .collect();
        for (transa, transb) in [(false, false), (true, false), (false, true), (true, true)] {
            // Store each operand so that op() of it is the matrix above.
            let a: Vec<f32> = if transa {
                a_mk.clone() // column-major k × m with ld k: element (l, i) at l + i*k
            } else {
                (0..k)
                    .flat_map(|l| (0..m).map(move |i| (i, l)))
                    .map(|(i, l)| a_mk[i * k + l])
                    .collect()
            };
            let b: Vec<f32> = if transb {
                b_kn.clone() // column-major n × k with ld n: element (j, l) at j + l*n
            } else {
                (0..n)
                    .flat_map(|j| (0..k).map(move |l| (l, j)))
                    .map(|(l, j)| b_kn[l * n + j])
                    .collect()
            };
            let call = GemmCall {
                transa,
                transb,
                m,
                n,
                k,
                lda: if transa { k } else { m },
                ldb: if transb { n } else { k },
                ldc: m,
            };
            let mut got = vec![f32::NAN; m * n];
            call.reference(&a, &b, None, &mut got);
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() < 1e-6,
                    "transa {transa} transb {transb}: {g} vs {w}"
                );
            }
        }
    }
}
