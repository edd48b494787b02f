//! Pillow's `Image.resize` for 8-bit RGB, computed as Pillow computes it.
//!
//! An image model was trained, and its reference outputs are computed, on what its processor
//! (transformers' PIL backend) hands it, and that is Pillow's resampling: a separable
//! convolution whose filter widens with the scale factor (antialiasing when shrinking), with
//! coefficients rounded to 22-bit integers and the intermediate image (after the horizontal pass)
//! rounded to 8 bits. Any other resampler, however good, gives other pixels.
//!
//! Written here rather than taken from a crate because neither maintained resizer gives Pillow's
//! bytes: on four fixture photographs scaled as SigLIP's processor scales them (bicubic to
//! 64 × 64), `fast_image_resize` (a convolution like Pillow's, with 16-bit coefficients) differs
//! in 6,159 of 49,152 bytes and the `image` crate's `resize` in 4,665 (by up to 3 and 4 levels);
//! `tests/images.rs` measures both on every run.

/// A resampling filter, by the number transformers' `PILImageResampling` gives it in a
/// processor's `resample`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// 1: Lanczos, three lobes.
    Lanczos,
    /// 2: bilinear (a triangle).
    Bilinear,
    /// 3: bicubic, Keys' with a = -0.5.
    Bicubic,
    /// 4: box.
    Box,
    /// 5: Hamming-windowed sinc.
    Hamming,
}

impl Filter {
    /// The filter of `PILImageResampling` value `n`, or why it is not computed here (0, nearest,
    /// runs through another Pillow path that no image model's processor uses).
    pub fn from_pil(n: i64) -> Result<Self, String> {
        match n {
            1 => Ok(Self::Lanczos),
            2 => Ok(Self::Bilinear),
            3 => Ok(Self::Bicubic),
            4 => Ok(Self::Box),
            5 => Ok(Self::Hamming),
            0 => Err("resample 0 (nearest) is not supported".into()),
            n => Err(format!("resample {n} is not one of Pillow's filters")),
        }
    }

    /// How far the filter reaches, in source pixels at scale 1.
    fn support(self) -> f64 {
        match self {
            Self::Box => 0.5,
            Self::Bilinear | Self::Hamming => 1.0,
            Self::Bicubic => 2.0,
            Self::Lanczos => 3.0,
        }
    }

    /// The filter's weight at distance `x`.
    fn weight(self, x: f64) -> f64 {
        fn sinc(x: f64) -> f64 {
            if x == 0.0 {
                1.0
            } else {
                let x = x * std::f64::consts::PI;
                x.sin() / x
            }
        }
        match self {
            Self::Box => {
                if x > -0.5 && x <= 0.5 {
                    1.0
                } else {
                    0.0
                }
            }
            Self::Bilinear => {
                let x = x.abs();
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Self::Bicubic => {
                const A: f64 = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Self::Hamming => {
                let x = x.abs();
                if x == 0.0 {
                    1.0
                } else if x >= 1.0 {
                    0.0
                } else {
                    let x = x * std::f64::consts::PI;
                    x.sin() / x * (0.54 + 0.46 * x.cos())
                }
            }
            Self::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

/// Bits of the integer coefficients: Pillow's `PRECISION_BITS` for 8-bit images (32 - 8 - 2).
const PRECISION_BITS: u32 = 22;

/// One output pixel's taps along an axis: the first source pixel and the integer weights.
struct Taps {
    first: usize,
    weights: Vec<i32>,
}

/// The taps of every output pixel when `input` pixels become `output` along one axis.
fn taps(input: usize, output: usize, filter: Filter) -> Vec<Taps> {
    let scale = input as f64 / output as f64;
    let filter_scale = scale.max(1.0);
    let support = filter.support() * filter_scale;
    // Multiplied by the reciprocal, as Pillow does: dividing can differ in the last bit.
    let reciprocal = 1.0 / filter_scale;
    (0..output)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            // C's (int) casts truncate toward zero, as `as` does.
            let first = ((center - support + 0.5) as i64).max(0) as usize;
            let end = ((center + support + 0.5) as i64).min(input as i64) as usize;
            let raw: Vec<f64> = (first..end)
                .map(|x| filter.weight((x as f64 - center + 0.5) * reciprocal))
                .collect();
            let sum: f64 = raw.iter().sum();
            let unit = f64::from(1u32 << PRECISION_BITS);
            let weights = raw
                .iter()
                .map(|&w| {
                    let w = if sum != 0.0 { w / sum } else { w };
                    if w < 0.0 {
                        (-0.5 + w * unit) as i32
                    } else {
                        (0.5 + w * unit) as i32
                    }
                })
                .collect();
            Taps { first, weights }
        })
        .collect()
}

/// A sum of integer-weighted pixels back to a byte: Pillow's `clip8`.
fn clip8(sum: i32) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// An 8-bit RGB image, row after row, three bytes a pixel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rgb8 {
    /// Pixels a row.
    pub width: usize,
    /// Rows.
    pub height: usize,
    /// `width * height * 3` bytes.
    pub data: Vec<u8>,
}

/// `image` resized to `width` × `height` with `filter`, byte for byte as Pillow's
/// `Image.resize((width, height), filter)` on an RGB image: the horizontal pass first (skipped
/// where the width does not change), rounded to bytes, then the vertical. Never copies `image`
/// first (a copy of a 6000² picture was 108 MB the decode budget did not know of); it is copied
/// only where neither side changes.
pub fn resize(image: &Rgb8, width: usize, height: usize, filter: Filter) -> Rgb8 {
    let across = (width != image.width).then(|| horizontal(image, width, filter));
    let source = across.as_ref().unwrap_or(image);
    if height != source.height {
        return vertical(source, height, filter);
    }
    across.unwrap_or_else(|| image.clone())
}

fn horizontal(image: &Rgb8, width: usize, filter: Filter) -> Rgb8 {
    let taps = taps(image.width, width, filter);
    let mut data = Vec::with_capacity(width * image.height * 3);
    let half = 1i32 << (PRECISION_BITS - 1);
    for row in image.data.chunks_exact(image.width * 3) {
        for t in &taps {
            let mut sums = [half; 3];
            for (i, &w) in t.weights.iter().enumerate() {
                let px = &row[(t.first + i) * 3..][..3];
                for (s, &v) in sums.iter_mut().zip(px) {
                    *s += i32::from(v) * w;
                }
            }
            data.extend(sums.map(clip8));
        }
    }
    Rgb8 {
        width,
        height: image.height,
        data,
    }
}

fn vertical(image: &Rgb8, height: usize, filter: Filter) -> Rgb8 {
    let taps = taps(image.height, height, filter);
    let stride = image.width * 3;
    let mut data = Vec::with_capacity(stride * height);
    let half = 1i32 << (PRECISION_BITS - 1);
    let mut sums = vec![0i32; stride];
    for t in &taps {
        sums.fill(half);
        for (i, &w) in t.weights.iter().enumerate() {
            let row = &image.data[(t.first + i) * stride..][..stride];
            for (s, &v) in sums.iter_mut().zip(row) {
                *s += i32::from(v) * w;
            }
        }
        data.extend(sums.iter().map(|&s| clip8(s)));
    }
    Rgb8 {
        width: image.width,
        height,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The coefficients of every output pixel sum to one (in 22-bit fixed point, within the
    /// rounding of each), so a flat image stays flat at any scale and with every filter.
    #[test]
    fn a_flat_image_stays_flat() {
        let flat = Rgb8 {
            width: 37,
            height: 23,
            data: [200u8, 17, 0].repeat(37 * 23),
        };
        for filter in [
            Filter::Lanczos,
            Filter::Bilinear,
            Filter::Bicubic,
            Filter::Box,
            Filter::Hamming,
        ] {
            for (w, h) in [(10, 7), (64, 64), (37, 5), (100, 23)] {
                let out = resize(&flat, w, h, filter);
                assert_eq!(out.data, [200u8, 17, 0].repeat(w * h), "{filter:?} {w}x{h}");
            }
        }
    }

    #[test]
    fn nearest_and_unknown_filters_are_refused() {
        assert!(Filter::from_pil(0).unwrap_err().contains("nearest"));
        assert!(Filter::from_pil(9).is_err());
        assert_eq!(Filter::from_pil(3), Ok(Filter::Bicubic));
    }
}
