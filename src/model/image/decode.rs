//! Bytes to upright 8-bit RGB, as a model's processor sees a picture handed to it: Pillow's
//! decoding, the EXIF orientation applied (as `load_image` does), then transformers'
//! `convert_to_rgb`, which composites any transparency onto white (`Image.alpha_composite` over a
//! white `RGBA` image, then `convert("RGB")`): what CLIP's processor, sentence-transformers' CLIP
//! and a person looking at the picture all see.
//!
//! Decoding is the `image` crate's; what Pillow holds in 8 bits, and where its alpha comes from,
//! is reproduced here ([`Pillow`]): 16-bit colour samples keep their high byte, 16-bit grey is
//! clipped to 255 (Pillow's `I;16`), a PNG colour key (tRNS) is compared, by its low byte, with
//! the 8-bit samples Pillow keeps. The composite is Pillow's 7-bit fixed point, byte for byte.
//!
//! A file declaring more pixels than the limit is refused from its header, before anything is
//! allocated; the decoder's own allocations are capped too, so a decompression bomb costs
//! nothing but the bytes already read. The bytes a decode holds at its peak, also known from the
//! header, are taken from the process's decode budget ([`budget`]) before it allocates; the
//! conversion to RGB is done in place and only a quarter turn copies the picture.

use super::budget::{self, DecodeMemory, Held};
use super::jpeg;
use super::resample::Rgb8;
use super::Undecodable;
use image::metadata::Orientation;
use image::{ColorType, DynamicImage, ImageDecoder, ImageFormat, ImageReader};
use std::io::Cursor;

/// The formats read; anything else is refused with its name.
const FORMATS: [ImageFormat; 5] = [
    ImageFormat::Jpeg,
    ImageFormat::Png,
    ImageFormat::WebP,
    ImageFormat::Gif,
    ImageFormat::Bmp,
];

/// What a PNG's decoder may allocate for itself, whatever the picture's size: its ancillary
/// chunks (the ICC profile above all) and row buffers; the picture is charged to the budget
/// apart. The image crate hands the PNG decoder the reader's limit once, before the header, and
/// cannot change it after (its `set_limits` does not reach the PNG decoder): with the default
/// 512 MiB, a 1×1 PNG whose `iCCP` chunk inflated to 500 MiB took 547 MB against a 32 MB
/// budget. Real ICC profiles are kilobytes to a few hundred; one past the bound is dropped (the
/// PNG decoder's choice), and the pixels never depended on it (Pillow does not apply it either).
const PNG_OWN_BYTES: u64 = 16 << 20;

/// Decodes `bytes` (JPEG, PNG, WebP, GIF's first frame, BMP) to upright RGB, refusing an image
/// of more than `max_pixels` pixels before decoding it.
pub fn decode(bytes: &[u8], max_pixels: u64) -> Result<Rgb8, Undecodable> {
    decode_held(bytes, max_pixels, budget::global()).map(|(image, _held)| image)
}

/// As [`decode`], the bytes its decoding holds at its peak taken from `memory` first (waiting for
/// them; refused where they are more than all of it) and held, with the picture, by the caller
/// until it has done with it.
pub fn decode_held<'m>(
    bytes: &[u8],
    max_pixels: u64,
    memory: &'m DecodeMemory,
) -> Result<(Rgb8, Held<'m>), Undecodable> {
    let fail = |what: &str, e: image::ImageError| Undecodable(format!("{what}: {e}"));
    let mut reader = ImageReader::new(Cursor::new(bytes))
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
    if format == ImageFormat::Jpeg {
        return decode_jpeg(bytes, max_pixels, memory);
    }
    if format == ImageFormat::Png {
        let mut own = image::Limits::default();
        own.max_alloc = Some(PNG_OWN_BYTES);
        reader.limits(own);
    }
    let mut decoder = reader
        .into_decoder()
        .map_err(|e| fail(&format!("not a readable {format:?}"), e))?;
    let (width, height) = decoder.dimensions();
    let pixels = within_limit(format, width, height, max_pixels)?;
    if format == ImageFormat::Gif {
        gif_frame_within_screen(bytes, width, height)?;
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
    let color = decoder.color_type();
    let mut need = peak_bytes(decoder.total_bytes(), pixels, color, orientation);
    if format == ImageFormat::Gif {
        // A first frame that does not fill the screen is read into a buffer of its own (RGBA, at
        // most the screen's size: see `gif_frame_within_screen`) before it is placed.
        need = need.saturating_add(pixels.saturating_mul(4));
    }
    let held = memory.take(need).map_err(|why| {
        Undecodable(format!(
            "the {format:?} declares {width}x{height} pixels of {color:?}: {why}"
        ))
    })?;
    let mut data = vec![0u8; to_usize(decoder.total_bytes())?];
    decoder
        .read_image(&mut data)
        .map_err(|e| fail(&format!("a broken or truncated {format:?}"), e))?;
    let pillow = Pillow::new(format, bytes, color)?;
    pillow.write_rgb_in_place(&mut data);
    Ok((upright(format, width, height, data, orientation)?, held))
}

/// A JPEG through libjpeg-turbo ([`jpeg`]), Pillow's decoder: its header read first (size,
/// channels, scans), then the bytes its decode holds at its peak taken from `memory` (the
/// picture, CMYK's fourth byte, a multi-scan file's coefficient planes), then the picture
/// decoded and turned upright by its EXIF orientation.
fn decode_jpeg<'m>(
    bytes: &[u8],
    max_pixels: u64,
    memory: &'m DecodeMemory,
) -> Result<(Rgb8, Held<'m>), Undecodable> {
    let format = ImageFormat::Jpeg;
    if !jpeg::complete(bytes) {
        // libjpeg fills a truncated scan with gray and warns; Pillow refuses it ("image file is
        // truncated"), and a half-gray photo is not the record's image.
        return Err(Undecodable(
            "a truncated JPEG: no end-of-image marker after its last scan".into(),
        ));
    }
    let jpeg = jpeg::open(bytes)?;
    let header = jpeg.header;
    let (width, height) = (header.width, header.height);
    let pixels = within_limit(format, width, height, max_pixels)?;
    let orientation = jpeg::orientation(bytes);
    let color = if header.channels == 4 {
        ColorType::Rgba8
    } else {
        ColorType::Rgb8
    };
    let decoded = pixels.saturating_mul(color.bytes_per_pixel().into());
    let need =
        peak_bytes(decoded, pixels, color, orientation).saturating_add(header.coefficient_bytes());
    let held = memory.take(need).map_err(|why| {
        Undecodable(format!(
            "the JPEG declares {width}x{height} pixels of {} channels: {why}",
            header.channels
        ))
    })?;
    let data = jpeg.decode_rgb()?;
    Ok((upright(format, width, height, data, orientation)?, held))
}

/// The pixel count of a `width`×`height` picture, refused where it is empty or over `max_pixels`.
fn within_limit(
    format: ImageFormat,
    width: u32,
    height: u32,
    max_pixels: u64,
) -> Result<u64, Undecodable> {
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
    Ok(pixels)
}

/// 8-bit RGB `data` of `width`×`height` turned upright: flips and half turns in place, a quarter
/// turn copying the (3-byte) picture once.
fn upright(
    format: ImageFormat,
    width: u32,
    height: u32,
    data: Vec<u8>,
    orientation: Orientation,
) -> Result<Rgb8, Undecodable> {
    let rgb = image::RgbImage::from_raw(width, height, data).ok_or_else(|| {
        Undecodable(format!(
            "the {format:?} decoded to fewer bytes than declared"
        ))
    })?;
    let mut image = DynamicImage::ImageRgb8(rgb);
    image.apply_orientation(orientation);
    Ok(Rgb8 {
        width: image.width() as usize,
        height: image.height() as usize,
        data: image.into_bytes(),
    })
}

/// Refuses a GIF whose first frame reaches past its logical screen: Pillow grows the picture to
/// hold such a frame, the image crate crops it (after a frame buffer of the frame's own size: a
/// 3000² screen with a 6000² frame took 242 MB against an 85 MB budget), so neither the pixels
/// nor the memory would be what was declared.
fn gif_frame_within_screen(bytes: &[u8], width: u32, height: u32) -> Result<(), Undecodable> {
    let Some((left, top, w, h)) = gif_first_frame(bytes) else {
        return Ok(()); // No frame: the decoder says what is wrong.
    };
    if left + w > width || top + h > height {
        return Err(Undecodable(format!(
            "the GIF's first frame ({w}x{h} at {left},{top}) reaches past its {width}x{height} \
             screen: Pillow grows the picture to hold it and this decoder would crop it, so it \
             is not read"
        )));
    }
    Ok(())
}

/// A GIF's first frame as its image descriptor places it (left, top, width, height), past the
/// global colour table and any extension blocks; `None` where the bytes end first.
fn gif_first_frame(bytes: &[u8]) -> Option<(u32, u32, u32, u32)> {
    let u16_at = |at: usize| -> Option<u32> {
        Some(u32::from(u16::from_le_bytes([
            *bytes.get(at)?,
            *bytes.get(at + 1)?,
        ])))
    };
    let flags = *bytes.get(10)?;
    let mut at = 13
        + if flags & 0x80 != 0 {
            3 << ((flags & 7) + 1)
        } else {
            0
        };
    loop {
        match *bytes.get(at)? {
            0x2C => {
                return Some((
                    u16_at(at + 1)?,
                    u16_at(at + 3)?,
                    u16_at(at + 5)?,
                    u16_at(at + 7)?,
                ))
            }
            // An extension: its label, then sub-blocks until an empty one.
            0x21 => {
                at += 2;
                loop {
                    let len = usize::from(*bytes.get(at)?);
                    at += 1 + len;
                    if len == 0 {
                        break;
                    }
                }
            }
            _ => return None,
        }
    }
}

/// The most bytes a decode holds at once, from its header: the decoder's output (8 bytes a pixel
/// for 16-bit RGBA), converted to RGB in place; where a pixel grows (grey), the 3-byte picture
/// beside it while the buffer grows; a quarter turn, the turned copy beside the picture.
fn peak_bytes(total: u64, pixels: u64, color: ColorType, orientation: Orientation) -> u64 {
    let rgb = pixels.saturating_mul(3);
    let read = if color.bytes_per_pixel() < 3 {
        total.saturating_add(rgb)
    } else {
        total
    };
    let turned = match orientation {
        Orientation::Rotate90
        | Orientation::Rotate270
        | Orientation::Rotate90FlipH
        | Orientation::Rotate270FlipH => rgb.saturating_mul(2),
        _ => rgb,
    };
    read.max(turned)
}

fn to_usize(n: u64) -> Result<usize, Undecodable> {
    usize::try_from(n).map_err(|_| Undecodable(format!("{n} bytes do not fit in memory")))
}

/// How Pillow holds what the decoder gave, in 8 bits a sample, and where its alpha comes from.
#[derive(Debug, Clone, Copy)]
struct Pillow {
    /// Samples per pixel of the decoder's output, and bytes per sample (1 or 2).
    channels: usize,
    sample: usize,
    /// 16-bit grey read as Pillow's `I;16`: clipped to 255, not its high byte.
    clip: bool,
    /// A PNG colour key: the alpha is Pillow's comparison of the key's low bytes with the 8-bit
    /// samples it holds (the decoder compares raw samples, which differs at 2, 4 and 16 bits).
    key: Option<[u8; 3]>,
    /// BMP's fourth byte: Pillow reads a 32-bit BMP as RGB, so it is no alpha.
    ignore_alpha: bool,
}

impl Pillow {
    fn new(format: ImageFormat, bytes: &[u8], color: ColorType) -> Result<Self, Undecodable> {
        let (channels, sample) = match color {
            ColorType::L8 => (1, 1),
            ColorType::La8 => (2, 1),
            ColorType::Rgb8 => (3, 1),
            ColorType::Rgba8 => (4, 1),
            ColorType::L16 => (1, 2),
            ColorType::La16 => (2, 2),
            ColorType::Rgb16 => (3, 2),
            ColorType::Rgba16 => (4, 2),
            other => {
                return Err(Undecodable(format!(
                    "the {format:?} decodes to {other:?} samples, which are not read"
                )))
            }
        };
        let png = (format == ImageFormat::Png)
            .then(|| png_facts(bytes))
            .flatten();
        let grey = matches!(png, Some(p) if p.color_type == 0);
        Ok(Self {
            channels,
            sample,
            clip: grey && sample == 2,
            key: png.and_then(|p| p.key()),
            ignore_alpha: format == ImageFormat::Bmp,
        })
    }

    /// One pixel's samples (at most four, of `sample` bytes each) to Pillow's 8-bit RGBA.
    fn rgba(&self, px: &[u8]) -> [u8; 4] {
        let s = |i: usize| -> u8 {
            if self.sample == 1 {
                px[i]
            } else {
                let v = u16::from_ne_bytes([px[2 * i], px[2 * i + 1]]);
                if self.clip {
                    v.min(255) as u8
                } else {
                    (v >> 8) as u8
                }
            }
        };
        let (rgb, alpha) = match self.channels {
            1 => ([s(0); 3], 255),
            2 => ([s(0); 3], s(1)),
            3 => ([s(0), s(1), s(2)], 255),
            _ => ([s(0), s(1), s(2)], s(3)),
        };
        let alpha = match self.key {
            Some(key) => {
                if rgb == key {
                    0
                } else {
                    255
                }
            }
            None if self.ignore_alpha => 255,
            None => alpha,
        };
        [rgb[0], rgb[1], rgb[2], alpha]
    }

    /// Rewrites the decoder's output in `data` as 8-bit RGB composited onto white, in place:
    /// forward where a pixel shrinks (no sample is overwritten before it is read), backward from
    /// the end, after growing the buffer, where it grows (grey, grey and alpha).
    fn write_rgb_in_place(&self, data: &mut Vec<u8>) {
        let bpp = self.channels * self.sample;
        let pixels = data.len() / bpp;
        let put = |data: &mut [u8], i: usize, px: [u8; 4]| {
            let rgb = over_white(px);
            data[3 * i..3 * i + 3].copy_from_slice(&rgb);
        };
        if bpp >= 3 {
            for i in 0..pixels {
                let mut px = [0u8; 8];
                px[..bpp].copy_from_slice(&data[i * bpp..(i + 1) * bpp]);
                let rgba = self.rgba(&px[..bpp]);
                put(data, i, rgba);
            }
            data.truncate(3 * pixels);
            data.shrink_to_fit();
        } else {
            data.resize(3 * pixels, 0);
            for i in (0..pixels).rev() {
                let mut px = [0u8; 2];
                px[..bpp].copy_from_slice(&data[i * bpp..(i + 1) * bpp]);
                let rgba = self.rgba(&px[..bpp]);
                put(data, i, rgba);
            }
        }
    }
}

/// Pillow's `alpha_composite` of `px` over opaque white, then `convert("RGB")`: its integer
/// arithmetic with 7 bits of precision (libImaging/AlphaComposite.c), which over an opaque
/// background reduces to this; a fully transparent pixel is the background, an opaque one itself.
fn over_white([r, g, b, a]: [u8; 4]) -> [u8; 3] {
    if a == 0 {
        return [255; 3];
    }
    let a = u32::from(a);
    let one = |c: u8| {
        let t = 128 * (u32::from(c) * a + 255 * (255 - a)) + (0x80 << 7);
        ((((t >> 8) + t) >> 8) >> 7) as u8
    };
    [one(r), one(g), one(b)]
}

/// What a PNG's header says that the decoder's output no longer does.
#[derive(Debug, Clone, Copy)]
struct PngFacts {
    bit_depth: u8,
    color_type: u8,
    /// The tRNS colour key of a grey (one sample) or RGB (three) image, as stored (16-bit).
    trns: Option<[u16; 3]>,
}

impl PngFacts {
    /// The key as Pillow compares it: the low byte of each stored sample (1-bit grey: 0 or 255,
    /// as Pillow holds those pixels).
    fn key(&self) -> Option<[u8; 3]> {
        let low = |v: u16| (v & 0xFF) as u8;
        self.trns.map(|t| match self.color_type {
            0 if self.bit_depth == 1 => [if t[0] & 1 == 1 { 255 } else { 0 }; 3],
            0 => [low(t[0]); 3],
            _ => t.map(low),
        })
    }
}

/// Bit depth, colour type and colour key from the chunks before the image data; `None` for a
/// file too broken to say (the decoder then says why).
fn png_facts(bytes: &[u8]) -> Option<PngFacts> {
    let ihdr = bytes.get(8..33)?;
    let mut facts = PngFacts {
        bit_depth: ihdr[16],
        color_type: ihdr[17],
        trns: None,
    };
    let mut at = 8usize;
    while let Some(head) = bytes.get(at..at + 8) {
        let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let body = bytes.get(at + 8..(at + 8).checked_add(len)?)?;
        match &head[4..8] {
            b"IDAT" | b"IEND" => break,
            b"tRNS" => {
                let v = |i: usize| {
                    body.get(2 * i..2 * i + 2)
                        .map(|b| u16::from_be_bytes([b[0], b[1]]))
                };
                facts.trns = match facts.color_type {
                    0 => v(0).map(|g| [g; 3]),
                    2 => Some([v(0)?, v(1)?, v(2)?]),
                    _ => None,
                };
            }
            _ => {}
        }
        at = at + 12 + len;
    }
    Some(facts)
}
