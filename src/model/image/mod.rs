//! Images in: bytes to the pixel values an image model takes, as the model's own processor
//! (transformers' `CLIPImageProcessor`, `SiglipImageProcessor`, `ViTImageProcessor`, with the PIL
//! backend) computes them from the folder's `preprocessor_config.json`.
//!
//! * `decode`: bytes to upright 8-bit RGB, as the processor gets them from Pillow, within a pixel
//!   limit checked before anything is allocated;
//! * `budget`: the bytes all decodes in the process may hold at once;
//! * `resample`: Pillow's resize, byte for byte;
//! * [`Processor`]: the processor's steps in its order: resize by its size rule, center crop,
//!   rescale, normalise, to channels-first f32;
//!
//! The networks that read those pixels are engines (`super::engines::towers` on candle,
//! `super::engines::fused_images` on the CPU).

pub mod budget;
pub mod decode;
mod jpeg;
pub mod resample;

use super::spec::read_json;
use super::ModelError;
use resample::{Filter, Rgb8};
use serde_json::Value;
use std::path::Path;

/// Why bytes are not an image this service reads: the record's fault, recorded as its failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Undecodable(pub String);

/// The image processors whose steps [`Processor`] reproduces, by `image_processor_type`.
const KNOWN: [&str; 3] = [
    "CLIPImageProcessor",
    "SiglipImageProcessor",
    "ViTImageProcessor",
];

/// How the processor sizes an image before any crop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Size {
    /// `{"height", "width"}`: exactly this, whatever the aspect.
    Exact { height: usize, width: usize },
    /// `{"shortest_edge"}`: the shorter side to this, the longer in proportion (truncated).
    ShortestEdge(usize),
}

/// A model's image processor: what `preprocessor_config.json` asks for, checked at load.
#[derive(Debug, Clone, PartialEq)]
pub struct Processor {
    resize: Option<(Size, Filter)>,
    /// (height, width).
    crop: Option<(usize, usize)>,
    rescale: Option<f64>,
    /// Per channel (mean, std).
    normalize: Option<([f32; 3], [f32; 3])>,
}

impl Processor {
    /// Reads `preprocessor_config.json` from `dir`; refuses, with the reason, a processor or a
    /// setting whose result this would not reproduce exactly.
    pub fn read(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("preprocessor_config.json");
        let v: Value = read_json(&path)?;
        Self::from_config(&v).map_err(|message| ModelError::Unsupported { path, message })
    }

    /// As [`Processor::read`], from the parsed file.
    pub fn from_config(v: &Value) -> Result<Self, String> {
        let kind = v["image_processor_type"].as_str().unwrap_or("none");
        let kind = kind.strip_suffix("Fast").unwrap_or(kind);
        let kind = kind.strip_suffix("Pil").unwrap_or(kind);
        if !KNOWN.contains(&kind) {
            return Err(format!(
                "image_processor_type {kind} is not one spotinfer reproduces ({})",
                KNOWN.join(", ")
            ));
        }
        let on = |key: &str| v[key].as_bool().unwrap_or(false);
        if on("do_pad") {
            return Err("do_pad is not supported".into());
        }
        let resize = if on("do_resize") {
            let filter = Filter::from_pil(v["resample"].as_i64().unwrap_or(2))?;
            Some((size(&v["size"])?, filter))
        } else {
            None
        };
        let crop = if on("do_center_crop") {
            let c = &v["crop_size"];
            let (h, w) = (dim(&c["height"])?, dim(&c["width"])?);
            if let Some((Size::ShortestEdge(s), _)) = resize {
                if h > s || w > s {
                    return Err(format!(
                        "a {h}x{w} crop of images resized to a shortest edge of {s} pads them, \
                         which is not supported"
                    ));
                }
            }
            Some((h, w))
        } else {
            None
        };
        let rescale = if on("do_rescale") {
            Some(v["rescale_factor"].as_f64().unwrap_or(1.0 / 255.0))
        } else {
            None
        };
        let normalize = if on("do_normalize") {
            let std = triple(&v["image_std"])?;
            if std.contains(&0.0) {
                return Err(format!("image_std {std:?} divides by zero"));
            }
            Some((triple(&v["image_mean"])?, std))
        } else {
            None
        };
        if resize.is_none() && crop.is_none() {
            return Err(
                "a processor that neither resizes nor crops gives tensors of any size, \
                        which the model cannot take"
                    .into(),
            );
        }
        Ok(Self {
            resize,
            crop,
            rescale,
            normalize,
        })
    }

    /// A record's image bytes to the model's input: decoded ([`decode::decode`], refusing more
    /// than `max_pixels`), resized, cropped, rescaled and normalised. A resize that would itself
    /// make more than `max_pixels` (a 1 × 40,000 strip whose short side goes to 224) is refused
    /// before it allocates, as is an image smaller than a crop the processor never pads.
    ///
    /// The decode's bytes are taken from the process's decode budget ([`budget::global`]) and
    /// held until the picture has been resized, so decodes on every core together hold at most
    /// that budget.
    pub fn prepare(&self, bytes: &[u8], max_pixels: u64) -> Result<Vec<f32>, Undecodable> {
        self.prepare_within(bytes, max_pixels, budget::global())
    }

    /// As [`Processor::prepare`], with the decode's bytes taken from `memory`.
    pub fn prepare_within(
        &self,
        bytes: &[u8],
        max_pixels: u64,
        memory: &budget::DecodeMemory,
    ) -> Result<Vec<f32>, Undecodable> {
        let (image, held) = decode::decode_held(bytes, max_pixels, memory)?;
        let values = self.prepare_decoded(image, max_pixels);
        // The picture is gone: its bytes go back to the budget only now.
        drop(held);
        values
    }

    /// The rest of [`Processor::prepare`] once `image` is decoded; consumes it.
    fn prepare_decoded(&self, image: Rgb8, max_pixels: u64) -> Result<Vec<f32>, Undecodable> {
        if let Some((size, _)) = self.resize {
            let (h, w) = target(size, image.height, image.width);
            if (h as u64).saturating_mul(w as u64) > max_pixels {
                return Err(Undecodable(format!(
                    "{}x{} pixels would be resized to {w}x{h}, more than the {max_pixels} pixels \
                     allowed (--max-image-pixels)",
                    image.width, image.height
                )));
            }
        }
        self.pixel_values(&image).ok_or_else(|| {
            Undecodable(format!(
                "{}x{} pixels is smaller than the processor's crop, which it does not pad",
                image.width, image.height
            ))
        })
    }

    /// (height, width) of what [`Processor::pixel_values`] gives, whatever the picture: the
    /// size of a small probe after the resize and crop (`None`: the crop would pad it).
    pub fn output_size(&self) -> Option<(usize, usize)> {
        let probe = Rgb8 {
            width: 97,
            height: 61,
            data: vec![0; 97 * 61 * 3],
        };
        self.resized(&probe).map(|i| (i.height, i.width))
    }

    /// How many values [`Processor::pixel_values`] gives per image (3 × height × width).
    pub fn output_len(&self) -> Option<usize> {
        self.output_size().map(|(h, w)| 3 * h * w)
    }

    /// The 8-bit image after the processor's resize and crop: what the model sees, before
    /// rescaling; `None` where the processor's crop would need padding (an image smaller than
    /// the crop with no resize before it).
    pub fn resized(&self, image: &Rgb8) -> Option<Rgb8> {
        let mut image = match self.resize {
            Some((size, filter)) => {
                let (h, w) = target(size, image.height, image.width);
                resample::resize(image, w, h, filter)
            }
            None => image.clone(),
        };
        if let Some((h, w)) = self.crop {
            if h > image.height || w > image.width {
                return None;
            }
            let (top, left) = ((image.height - h) / 2, (image.width - w) / 2);
            let data = image
                .data
                .chunks_exact(image.width * 3)
                .skip(top)
                .take(h)
                .flat_map(|row| &row[left * 3..(left + w) * 3])
                .copied()
                .collect();
            image = Rgb8 {
                width: w,
                height: h,
                data,
            };
        }
        Some(image)
    }

    /// The model's input for `image`: channels first (3 × height × width), rescaled and
    /// normalised in f32 as transformers does (the rescale in f64, then each step in f32).
    pub fn pixel_values(&self, image: &Rgb8) -> Option<Vec<f32>> {
        let image = self.resized(image)?;
        let plane = image.width * image.height;
        let mut out = vec![0f32; 3 * plane];
        for (i, px) in image.data.chunks_exact(3).enumerate() {
            for (c, &v) in px.iter().enumerate() {
                let mut x = match self.rescale {
                    Some(f) => (f64::from(v) * f) as f32,
                    None => f32::from(v),
                };
                if let Some((mean, std)) = self.normalize {
                    x = (x - mean[c]) / std[c];
                }
                out[c * plane + i] = x;
            }
        }
        Some(out)
    }
}

/// (height, width) an image of `height` × `width` is resized to.
fn target(size: Size, height: usize, width: usize) -> (usize, usize) {
    match size {
        Size::Exact { height, width } => (height, width),
        Size::ShortestEdge(s) => {
            // transformers' get_resize_output_image_size: int(s * long / short), in floats.
            let (short, long) = if width <= height {
                (width, height)
            } else {
                (height, width)
            };
            let new_long = ((s * long) as f64 / short as f64) as usize;
            if width <= height {
                (new_long, s)
            } else {
                (s, new_long)
            }
        }
    }
}

fn size(v: &Value) -> Result<Size, String> {
    let has = |k: &str| !v[k].is_null();
    if has("longest_edge") || has("max_height") || has("max_width") {
        return Err(format!(
            "size {v} is not supported (exact or shortest_edge are)"
        ));
    }
    if has("shortest_edge") {
        return Ok(Size::ShortestEdge(dim(&v["shortest_edge"])?));
    }
    if let Some(n) = v.as_u64() {
        // An older config's bare number: a square.
        let n = n as usize;
        return Ok(Size::Exact {
            height: n,
            width: n,
        });
    }
    Ok(Size::Exact {
        height: dim(&v["height"])?,
        width: dim(&v["width"])?,
    })
}

fn dim(v: &Value) -> Result<usize, String> {
    match v.as_u64() {
        Some(n) if (1..=4096).contains(&n) => Ok(n as usize),
        _ => Err(format!("an image size of {v} (1 to 4096 pixels)")),
    }
}

fn triple(v: &Value) -> Result<[f32; 3], String> {
    let xs: Vec<f32> = match v {
        Value::Array(a) => a
            .iter()
            .filter_map(|x| x.as_f64().map(|x| x as f32))
            .collect(),
        Value::Number(n) => vec![n.as_f64().unwrap_or(0.0) as f32; 3],
        _ => Vec::new(),
    };
    match xs[..] {
        [a, b, c] if xs.iter().all(|x| x.is_finite()) => Ok([a, b, c]),
        _ => Err(format!("{v} is not one number per channel")),
    }
}
