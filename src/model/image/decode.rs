//! Bytes to upright 8-bit RGB, as transformers' `load_image` gets them from Pillow: the EXIF
//! orientation applied, then `convert("RGB")`.
//!
//! Decoding is the `image` crate's. Where Pillow's conversion to RGB is not the obvious one it is
//! reproduced here: 16-bit samples keep their high byte (Pillow reads 16-bit PNGs that way),
//! alpha is dropped, not composited (`convert("RGB")` drops it; only a processor handed an RGBA
//! image composites onto white, and `load_image`, which pipelines use, never hands it one).
//!
//! A file declaring more pixels than the limit is refused from its header, before anything is
//! allocated; the decoder's own allocations are capped too, so a decompression bomb costs
//! nothing but the bytes already read.

use super::resample::Rgb8;
use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader};
use std::io::Cursor;

/// The formats read; anything else is refused with its name.
const FORMATS: [ImageFormat; 5] = [
    ImageFormat::Jpeg,
    ImageFormat::Png,
    ImageFormat::WebP,
    ImageFormat::Gif,
    ImageFormat::Bmp,
];

/// Why bytes are not an image this service reads: the record's fault, recorded as its failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Undecodable(pub String);

/// Decodes `bytes` (JPEG, PNG, WebP, GIF's first frame, BMP) to upright RGB, refusing an image
/// of more than `max_pixels` pixels before decoding it.
pub fn decode(bytes: &[u8], max_pixels: u64) -> Result<Rgb8, Undecodable> {
    let fail = |what: &str, e: image::ImageError| Undecodable(format!("{what}: {e}"));
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| Undecodable(format!("cannot read the image: {e}")))?;
    let format = reader.format().ok_or_else(|| {
        Undecodable(format!(
            "not an image: {} bytes without the signature of JPEG, PNG, WebP, GIF or BMP",
            bytes.len()
        ))
    })?;
    if !FORMATS.contains(&format) {
        return Err(Undecodable(format!(
            "{format:?} images are not read (JPEG, PNG, WebP, GIF and BMP are)"
        )));
    }
    if format == ImageFormat::Jpeg && !jpeg_complete(bytes) {
        // zune-jpeg fills a truncated scan with gray and succeeds; Pillow refuses it ("image
        // file is truncated"), and a half-gray photo is not the record's image.
        return Err(Undecodable(
            "a truncated JPEG: no end-of-image marker after its last scan".into(),
        ));
    }
    let mut decoder = reader
        .into_decoder()
        .map_err(|e| fail(&format!("not a readable {format:?}"), e))?;
    let (width, height) = decoder.dimensions();
    let pixels = u64::from(width) * u64::from(height);
    if pixels == 0 {
        return Err(Undecodable(format!(
            "the {format:?} declares {width}x{height} pixels: an empty image"
        )));
    }
    if pixels > max_pixels {
        return Err(Undecodable(format!(
            "the {format:?} declares {width}x{height} = {pixels} pixels, over the limit of \
             {max_pixels} (--max-image-pixels)"
        )));
    }
    let mut limits = image::Limits::default();
    // The pixels at 16 bits and four channels, and as much again for the decoder's own buffers.
    limits.max_alloc = Some(pixels.saturating_mul(16));
    decoder
        .set_limits(limits)
        .map_err(|e| fail("the image is over its memory limit", e))?;
    let orientation = decoder
        .orientation()
        .map_err(|e| fail(&format!("a broken {format:?}"), e))?;
    let mut image = DynamicImage::from_decoder(decoder)
        .map_err(|e| fail(&format!("a broken or truncated {format:?}"), e))?;
    image.apply_orientation(orientation);
    Ok(to_rgb8(image))
}

/// Whether a JPEG's last scan (`FF DA`) is followed by the end-of-image marker (`FF D9`): a
/// thumbnail in the EXIF header has its own markers, but they come before the image's scans.
fn jpeg_complete(bytes: &[u8]) -> bool {
    let last = |marker: u8| bytes.windows(2).rposition(|w| w == [0xFF, marker]);
    matches!((last(0xDA), last(0xD9)), (Some(scan), Some(end)) if end > scan)
}

/// Pillow's `convert("RGB")` of what the decoder gave: gray repeated, alpha dropped, 16-bit
/// samples to their high byte.
fn to_rgb8(image: DynamicImage) -> Rgb8 {
    let (width, height) = (image.width() as usize, image.height() as usize);
    let data = match image {
        DynamicImage::ImageRgb8(b) => b.into_raw(),
        DynamicImage::ImageRgba8(b) => b.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect(),
        DynamicImage::ImageLuma8(b) => b.iter().flat_map(|&v| [v; 3]).collect(),
        DynamicImage::ImageLumaA8(b) => b.chunks_exact(2).flat_map(|p| [p[0]; 3]).collect(),
        DynamicImage::ImageRgb16(b) => b.iter().map(|&v| (v >> 8) as u8).collect(),
        DynamicImage::ImageRgba16(b) => b
            .chunks_exact(4)
            .flat_map(|p| [p[0], p[1], p[2]].map(|v| (v >> 8) as u8))
            .collect(),
        DynamicImage::ImageLuma16(b) => b.iter().flat_map(|&v| [(v >> 8) as u8; 3]).collect(),
        DynamicImage::ImageLumaA16(b) => b
            .chunks_exact(2)
            .flat_map(|p| [(p[0] >> 8) as u8; 3])
            .collect(),
        other => other.to_rgb8().into_raw(),
    };
    Rgb8 {
        width,
        height,
        data,
    }
}
