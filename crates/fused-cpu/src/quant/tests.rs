use super::*;

/// Deterministic bytes and floats.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn float(&mut self) -> f32 {
        (self.next() % 20_001) as f32 / 10_000.0 - 1.0
    }
}

/// Where a format's f16 scales sit in a block.
fn f16_fields(format: BlockFormat) -> &'static [usize] {
    match format {
        BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => &[0],
        BlockFormat::Q4_1 | BlockFormat::Q5_1 | BlockFormat::Q4K | BlockFormat::Q5K => &[0, 2],
        BlockFormat::Q6K => &[208],
    }
}

/// A random matrix: random bytes, with every f16 scale a small finite value.
fn random_matrix(format: BlockFormat, rows: usize, k: usize, rng: &mut Rng) -> BlockMatrix {
    let blocks = rows * k / format.block_weights();
    let mut data: Vec<u8> = (0..blocks * format.block_bytes())
        .map(|_| rng.next() as u8)
        .collect();
    for block in data.chunks_exact_mut(format.block_bytes()) {
        for &at in f16_fields(format) {
            let v = half::f16::from_f32(0.002 + (rng.next() % 1000) as f32 * 2e-5);
            block[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    BlockMatrix::new(format, rows, k, data).expect("matrix")
}

/// `x · mᵀ` by `kernel`, `m` in the column layout (as the decoder lays it out on x86-64;
/// elsewhere the portable kernel computes it so here).
fn product(kernel: Kernel, x: &[f32], m: &BlockMatrix) -> Vec<f32> {
    product_in(kernel, x, m.clone().in_columns())
}

/// `x · mᵀ` by `kernel` with `m` as it is laid out.
fn product_in(kernel: Kernel, x: &[f32], m: BlockMatrix) -> Vec<f32> {
    let mut out = vec![0f32; x.len() / m.k() * m.rows()];
    linear(kernel, x, &[Arc::new(m)], None, &mut out);
    out
}

#[test]
fn each_format_multiplies_as_its_widened_weights_do_within_the_activations_rounding() {
    let mut rng = Rng(7);
    let (rows, k, m) = (24, 512, 3);
    for format in BlockFormat::ALL {
        let w = random_matrix(format, rows, k, &mut rng);
        let wide = w.dequantize();
        let x: Vec<f32> = (0..m * k).map(|_| rng.float()).collect();
        // The column layout (x86-64) and the row layout (every other CPU).
        let columns = product(Kernel::best(), &x, &w);
        let rows_layout = product_in(Kernel::Portable, &x, w.clone());
        for (t, got) in (0..m).flat_map(|t| [(t, &columns), (t, &rows_layout)]) {
            for r in 0..rows {
                let exact: f64 = (0..k)
                    .map(|i| f64::from(x[t * k + i]) * f64::from(wide[r * k + i]))
                    .sum();
                let scale: f64 = (0..k)
                    .map(|i| (f64::from(x[t * k + i]) * f64::from(wide[r * k + i])).abs())
                    .sum();
                let error = (f64::from(got[t * rows + r]) - exact).abs() / scale;
                assert!(error < 4e-3, "{format:?} row {t} output {r}: error {error}");
            }
        }
    }
}

#[test]
fn the_portable_kernel_is_every_kernels_algorithm_bit_for_bit() {
    let mut rng = Rng(11);
    let bits = |v: Vec<f32>| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for format in BlockFormat::ALL {
        // 21 outputs: two whole column groups and a partial one.
        let w = random_matrix(format, 21, 768, &mut rng);
        let x: Vec<f32> = (0..11 * 768).map(|_| rng.float() * 3.0).collect();
        let portable = product(Kernel::Portable, &x, &w);
        for &kernel in Kernel::ALL.iter().filter(|k| k.supported()) {
            // Eleven rows (tiles of eight and three, or four, four and three) and one alone.
            let got = product(kernel, &x, &w);
            let one = product(kernel, &x[..768], &w);
            assert_eq!(
                bits(one),
                bits(portable[..21].to_vec()),
                "{format:?} on {kernel:?}: one row"
            );
            assert_eq!(
                bits(got),
                bits(portable.clone()),
                "{format:?} on {kernel:?}"
            );
        }
    }
}

#[test]
fn every_kernel_agrees_bit_for_bit_at_every_number_of_rows() {
    // The AMX kernel takes row tiles of 16 rows and leaves the rest to VNNI's 512-bit tiles of 4
    // or 8: every count up to past a block of 64 rows.
    let mut rng = Rng(23);
    let bits = |v: Vec<f32>| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let k = 512;
    let x: Vec<f32> = (0..70 * k).map(|_| rng.float() * 2.0).collect();
    for format in BlockFormat::ALL {
        let w = random_matrix(format, 24, k, &mut rng);
        let portable = product(Kernel::Portable, &x, &w);
        for &kernel in Kernel::ALL.iter().filter(|k| k.supported()) {
            let laid = w.clone().laid_out_for(kernel);
            for m in 1..=70 {
                let got = product(kernel, &x[..m * k], &laid);
                assert_eq!(
                    bits(got),
                    bits(portable[..m * 24].to_vec()),
                    "{format:?} on {kernel:?}, {m} rows"
                );
            }
        }
    }
}

#[test]
fn the_column_layout_holds_the_files_bytes() {
    let mut rng = Rng(5);
    for format in BlockFormat::ALL {
        let w = random_matrix(format, 13, 512, &mut rng);
        assert_eq!(
            w.clone().laid_out_for(Kernel::best()).columns,
            Kernel::best().has_columns()
        );
        let columns = w.clone().in_columns();
        assert!(columns.columns, "{format:?}");
        // Padded to 16 rows; Q4_K's and Q5_K's scales take a byte each (32 more per group).
        let blocks = 512 / format.block_weights();
        let more = match format {
            BlockFormat::Q4K | BlockFormat::Q5K => 32,
            _ => 0,
        };
        assert_eq!(
            columns.data.len(),
            2 * blocks * (8 * format.block_bytes() + more),
            "{format:?}"
        );
        let mut buffer = Vec::new();
        for r in 0..13 {
            assert_eq!(
                columns.gguf_row(r, &mut buffer),
                w.row(r),
                "{format:?} row {r}"
            );
        }
        assert_eq!(columns.dequantize(), w.dequantize(), "{format:?}");
        let reversed = |r: usize| 12 - r;
        assert_eq!(
            columns.permute_rows(reversed).data,
            w.permute_rows(reversed).data
        );
    }
}

#[test]
fn a_rows_sums_are_the_same_alone_and_in_any_batch_and_a_stack_is_its_parts() {
    let mut rng = Rng(3);
    let (k, rows) = (256, 40);
    let q = random_matrix(BlockFormat::Q4K, rows, k, &mut rng);
    let v = random_matrix(BlockFormat::Q6K, 8, k, &mut rng);
    let o = random_matrix(BlockFormat::Q4_1, 12, k, &mut rng);
    let p = random_matrix(BlockFormat::Q8_0, 9, k, &mut rng);
    let parts: Vec<_> = [&q, &v, &o, &p]
        .map(|m| Arc::new(m.clone().in_columns()))
        .into();
    let n = rows + 8 + 12 + 9;
    let bias: Vec<f32> = (0..n).map(|_| rng.float()).collect();
    // 70 rows: past one block of 64 rows multiplied together.
    let x: Vec<f32> = (0..70 * k).map(|_| rng.float()).collect();
    let mut batch = vec![0f32; 70 * n];
    linear(Kernel::best(), &x, &parts, Some(&bias), &mut batch);
    for t in [0, 5, 36, 63, 64, 69] {
        let mut alone = vec![0f32; n];
        linear(
            Kernel::best(),
            &x[t * k..][..k],
            &parts,
            Some(&bias),
            &mut alone,
        );
        assert_eq!(alone, batch[t * n..][..n], "row {t}");
        let each = [&q, &v, &o, &p].map(|m| product(Kernel::best(), &x[t * k..][..k], m));
        let stacked: Vec<f32> = each
            .iter()
            .flatten()
            .zip(&bias)
            .map(|(a, b)| a + b)
            .collect();
        assert_eq!(alone, stacked, "row {t}: the stack against its parts");
    }
}

#[test]
fn activations_round_half_to_even_as_llama_cpp_rounds_them() {
    // 127 / 127 · (±2.5, ±1.5, 0.5, 126.5, …): ties go to the even neighbour.
    let mut x = vec![0f32; 32];
    x[..8].copy_from_slice(&[127.0, 2.5, -2.5, 1.5, -1.5, 0.5, 126.5, -0.49]);
    let rows = QuantRows::new(&x, 32, false);
    assert_eq!(rows.q[..8], [127, 2, -2, 2, -2, 0, 126, 0]);
    for v in [0.3f32, 3.7, -100.5, 64.5, 33.49999] {
        let mut x = vec![0f32; 32];
        x[0] = 127.0;
        x[1] = v;
        assert_eq!(
            f32::from(QuantRows::new(&x, 32, false).q[1]),
            v.round_ties_even(),
            "{v}"
        );
    }
}

/// A product's rows rounded into the buffers of a larger one before (this thread's spare) are
/// those rounded into fresh ones, field for field over the rows held.
#[test]
fn rows_rounded_into_a_spare_buffer_are_those_rounded_fresh() {
    let mut rng = Rng(21);
    let x: Vec<f32> = (0..3 * 512).map(|_| rng.float() * 4.0).collect();
    for per_256 in [false, true] {
        let round = |x: &[f32]| match per_256 {
            false => QuantRows::new(x, 256, false),
            true => QuantRows::per_256(x, 256, false),
        };
        super::SPARE_ROWS.with(|spare| spare.borrow_mut().clear());
        let fresh = round(&x[..512]);
        let larger: Vec<f32> = (0..4 * 1024).map(|_| rng.float() * 9.0).collect();
        QuantRows::new(&larger, 1024, false).recycle();
        let reused = round(&x[..512]);
        assert!(reused.q.len() > 512, "the spare was taken");
        let blocks = 512 / 32;
        assert_eq!((reused.m, reused.k), (2, 256));
        assert_eq!(reused.q[..512], fresh.q[..]);
        assert_eq!(reused.scales[..blocks], fresh.scales[..]);
        assert_eq!(reused.sums[..blocks], fresh.sums[..]);
        assert_eq!(reused.halves[..blocks], fresh.halves[..]);
        assert_eq!(reused.less_offsets[..blocks], fresh.less_offsets[..]);
    }
}

#[test]
fn k_format_activations_round_per_256_as_llama_cpp_rounds_them() {
    // llama.cpp's Q8_K: `iscale = -127 / max` for the value of largest magnitude (its sign
    // kept, so a positive maximum flips every sign), values `iscale · x` half to even, scale
    // `1 / iscale`.
    for max in [3.0f32, -3.0] {
        let mut x: Vec<f32> = (0..512)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        x[5] = max;
        x[300] = 2.5;
        let rows = QuantRows::per_256(&x, 512, false);
        let iscale = -127.0 / max;
        assert_eq!(rows.q[5], -127);
        assert_eq!(rows.scales[0], [1.0 / iscale, 0.0]);
        assert_eq!(rows.scales[7], rows.scales[0], "one scale for the 256");
        for (i, (&q, &v)) in rows.q[..256].iter().zip(&x).enumerate() {
            assert_eq!(f32::from(q), (v * iscale).round_ties_even(), "{max}: {i}");
        }
        // The second 256 has its own maximum, 2.5: -127 / 2.5 = -50.8.
        assert_eq!(rows.q[300], -127);
        assert_eq!(rows.scales[8][0], 1.0 / (-127.0 / 2.5));
        let sum: i32 = rows.q[32..64].iter().map(|&q| i32::from(q)).sum();
        let first: i32 = rows.q[32..48].iter().map(|&q| i32::from(q)).sum();
        assert_eq!((rows.sums[1], rows.halves[1]), (sum, first));
    }
}

/// The vectorised conversion to bytes is `as i8`'s (saturating, NaN to 0) for every value the
/// rounding can give it and for those it cannot; and a block holding NaN or infinities rounds
/// as it did through `as i8`: per 32, the infinity makes the scale's inverse 0, so its block is
/// all 0 (NaN too); per 256, the infinity is the maximum, `iscale` is −0, every finite value
/// rounds to 0 and NaN (and ∞ · −0) to 127 by `min`.
#[test]
fn the_rounded_bytes_are_as_i8s_and_odd_blocks_round_as_before() {
    let odd = [
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        127.0,
        -127.0,
        128.0,
        -128.0,
        129.0,
        -129.0,
        1e30,
        -1e30,
        -0.0,
        0.0,
    ];
    for v in odd.into_iter().chain((-300..=300).map(|i| i as f32)) {
        assert_eq!(super::to_i8(v), v as i8, "{v}");
    }
    let mut x = vec![0.5f32; 256];
    x[3] = f32::NAN;
    x[40] = f32::INFINITY;
    x[41] = 2.0;
    let rows = QuantRows::new(&x, 256, false);
    assert_eq!((rows.q[3], rows.q[40], rows.q[41]), (0, 0, 0));
    assert_eq!((rows.q[0], rows.q[64]), (127, 127));
    let rows = QuantRows::per_256(&x, 256, false);
    assert_eq!(
        (rows.q[3], rows.q[40], rows.q[41], rows.q[0]),
        (127, 127, 0, 0)
    );
}

#[test]
fn a_shape_that_is_not_whole_blocks_is_refused() {
    assert!(BlockMatrix::new(BlockFormat::Q4K, 2, 128, vec![0; 144]).is_err());
    assert!(BlockMatrix::new(BlockFormat::Q4_0, 2, 64, vec![0; 18 * 3]).is_err());
    assert!(BlockMatrix::new(BlockFormat::Q4_0, 2, 64, vec![0; 18 * 4]).is_ok());
}

#[test]
fn the_largest_values_sum_without_overflow_in_every_kernel() {
    // Every value byte 0xFF (each format's largest stored value), 0x80 (Q8_0's -128), 0x7F (its
    // 127) or 0x00 (the others' smallest), activations at ±127: the integer sums' extremes,
    // where a 16-bit partial sum would wrap.
    let bits = |v: Vec<f32>| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for format in BlockFormat::ALL {
        for byte in [0xFF, 0x80, 0x7F, 0x00] {
            let mut w = random_matrix(format, 9, 512, &mut Rng(1));
            for block in w.data.chunks_exact_mut(format.block_bytes()) {
                let fields = f16_fields(format);
                for (i, b) in block.iter_mut().enumerate() {
                    if !fields.iter().any(|&at| i == at || i == at + 1) {
                        *b = byte;
                    }
                }
            }
            // Two rows (the register kernels) and six (AVX2's many-rows kernels), of ±1, and of
            // ±1 with each block's first value the other sign: the K formats' rounding takes
            // the value of largest magnitude to -127, so only then do the others reach +127.
            let rows = [
                (1.0f32, 2, false),
                (-1.0, 2, false),
                (1.0, 6, false),
                (-1.0, 6, false),
                (1.0, 6, true),
                (-1.0, 6, true),
            ];
            for (sign, m, mixed) in rows {
                let x: Vec<f32> = (0..m * 512)
                    .map(|i| if mixed && i % 32 == 0 { -sign } else { sign })
                    .collect();
                let portable = product(Kernel::Portable, &x, &w);
                let wide = w.dequantize();
                for (r, got) in portable.iter().take(9).enumerate() {
                    let row = &wide[r * 512..][..512];
                    let exact: f32 = row.iter().zip(&x).map(|(v, x)| v * x).sum();
                    assert!(
                        (got - exact).abs() <= 1e-3 * exact.abs().max(1.0),
                        "{format:?} {byte:#x} {sign}: output {r} {got} against {exact}"
                    );
                }
                for &kernel in Kernel::ALL.iter().filter(|k| k.supported()) {
                    let got = product(kernel, &x, &w);
                    assert_eq!(
                        bits(got),
                        bits(portable.clone()),
                        "{format:?} on {kernel:?}, {m} rows"
                    );
                }
            }
        }
    }
}

/// The greedy choice as one scan of a whole row keeps it: the first strictly larger value.
fn scan(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn a_row_chosen_share_by_share_is_the_one_scan_of_the_whole_row_chooses() {
    let mut rng = Rng(11);
    for case in 0..400 {
        let n = 1 + (rng.next() % 300) as usize;
        // Few distinct values, so equal largest values are common; some NaNs, and in some
        // rows a NaN first (nothing is larger than it: the scan keeps output 0).
        let mut row: Vec<f32> = (0..n).map(|_| (rng.next() % 7) as f32).collect();
        for _ in 0..rng.next() % 4 {
            let at = (rng.next() % n as u64) as usize;
            row[at] = f32::NAN;
        }
        if case % 10 == 0 {
            row[0] = f32::NAN;
        }
        if case % 13 == 0 {
            row.iter_mut().for_each(|v| *v = f32::NAN);
        }
        let chunk = 1 + (rng.next() % 40) as usize;
        let found = (0..n)
            .step_by(chunk)
            .filter_map(|lo| first_largest(&row[lo..(lo + chunk).min(n)], lo));
        assert_eq!(
            first_of(found),
            scan(&row),
            "case {case}: {row:?} by {chunk}"
        );
        assert_eq!(argmax(&row), scan(&row), "case {case}: {row:?} whole");
    }
}

#[test]
fn a_product_choosing_keeps_rows_bit_for_bit_and_finds_the_largest_of_the_others() {
    let mut rng = Rng(5);
    // Past two shares of outputs, the last group partial; 37 rows, past one column kernel call.
    let (rows, k, m) = (1_300, 256, 37);
    let x: Vec<f32> = (0..m * k).map(|_| rng.float()).collect();
    for format in [
        BlockFormat::Q4_1,
        BlockFormat::Q8_0,
        BlockFormat::Q4K,
        BlockFormat::Q6K,
    ] {
        let matrix = Arc::new(random_matrix(format, rows, k, &mut rng).in_columns());
        let mut whole = vec![0f32; m * rows];
        linear(
            Kernel::best(),
            &x,
            std::slice::from_ref(&matrix),
            None,
            &mut whole,
        );
        let patterns: [Vec<bool>; 3] = [
            (0..m).map(|t| t % 3 == 1).collect(),
            vec![false; m],
            vec![true; m],
        ];
        for keep in patterns {
            let mut kept = vec![0f32; keep.iter().filter(|&&k| k).count() * rows];
            let chosen = linear_choosing(
                Kernel::best(),
                &x,
                std::slice::from_ref(&matrix),
                &keep,
                &mut kept,
            );
            let mut kept_rows = kept.chunks_exact(rows);
            for (t, row) in whole.chunks_exact(rows).enumerate() {
                if keep[t] {
                    assert_eq!(chosen[t], None, "{format:?} row {t}");
                    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(kept_rows.next().expect("kept")), bits(row));
                } else {
                    assert_eq!(chosen[t], Some(scan(row)), "{format:?} row {t}");
                }
            }
        }
    }
}

#[test]
fn the_largest_magnitude_in_lanes_is_the_one_a_fold_finds() {
    let mut rng = Rng(13);
    for case in 0..200 {
        let mut block: Vec<f32> = (0..256).map(|_| rng.float() * 3.0).collect();
        for _ in 0..case % 5 {
            let at = (rng.next() % 256) as usize;
            block[at] = [f32::NAN, -0.0, f32::INFINITY, -7.5][case % 4];
        }
        for len in [32, 256] {
            let folded = block[..len].iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(
                largest_magnitude(&block[..len]).to_bits(),
                folded.to_bits(),
                "case {case}, {len}"
            );
        }
    }
}
