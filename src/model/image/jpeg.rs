//! JPEG decoded by libjpeg-turbo, the decoder Pillow's wheels carry, with Pillow's settings: the
//! accurate integer IDCT and fancy (smooth) upsampling, libjpeg's defaults, which Pillow keeps
//! unless asked for a draft. Gray is replicated to RGB by libjpeg (Pillow's `L` to `RGB`); CMYK
//! and YCCK come out as CMYK, read inverted as Pillow reads them (it assumes Adobe's convention
//! for every 4-channel JPEG) and converted with Pillow's `cmyk2rgb`. So every JPEG decodes to
//! Pillow's very bytes, as every other format already did.
//!
//! Through `turbojpeg-sys`, the `turbojpeg` crate's own bindings, rather than that crate's safe
//! `Decompressor`: its `decompress` turns libjpeg's warnings ("Corrupt JPEG data: 2 extraneous
//! bytes before marker") into errors, where Pillow decodes through them, and it does not set
//! libjpeg's memory limit, which is what bounds a multi-scan JPEG's coefficient buffers here.

use super::Undecodable;
use image::metadata::Orientation;
use std::ffi::CStr;
use turbojpeg_sys as tj;

/// What the frame header says, read before anything is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub width: u32,
    pub height: u32,
    /// Colour channels as stored: 1 (grey), 3 (YCbCr or RGB), 4 (CMYK or YCCK).
    pub channels: u8,
    /// Scans in the file: more than one (progressive, or sequential with a scan per component)
    /// and libjpeg holds every coefficient of the picture until the last.
    pub scans: usize,
}

impl Header {
    /// The bytes of coefficients libjpeg holds for a multi-scan picture: two a coefficient, a
    /// full-resolution plane per channel at most (subsampled channels hold less), rounded up to
    /// whole 16-pixel blocks.
    pub fn coefficient_bytes(&self) -> u64 {
        if self.scans <= 1 {
            return 0;
        }
        let up = |n: u32| u64::from(n).div_ceil(16) * 16;
        up(self.width) * up(self.height) * 2 * u64::from(self.channels)
    }
}

/// What libjpeg may allocate for itself beyond the coefficient planes: row buffers, Huffman
/// tables, the upsampler's context rows. Its memory limit is set to the planes plus this, so a
/// file that needs more is refused by libjpeg rather than decoded past its charge.
pub(super) const OWN_BYTES: u64 = 16 << 20;

/// One TurboJPEG decompressor, destroyed when dropped.
struct Decompressor(tj::tjhandle);

impl Decompressor {
    fn new() -> Result<Self, Undecodable> {
        // SAFETY: tj3Init has no preconditions; a null handle is its failure.
        let handle = unsafe { tj::tj3Init(tj::TJINIT_TJINIT_DECOMPRESS as libc::c_int) };
        if handle.is_null() {
            return Err(Undecodable(
                "libjpeg-turbo could not start a decoder".into(),
            ));
        }
        Ok(Self(handle))
    }

    /// The error of the last call, `None` where it was only a warning (libjpeg decoded the
    /// picture, as Pillow would).
    fn fatal(&self, what: &str) -> Option<Undecodable> {
        // SAFETY: the handle is live; the string is libjpeg-turbo's, valid until its next call.
        let (code, message) = unsafe {
            let code = tj::tj3GetErrorCode(self.0);
            let text = CStr::from_ptr(tj::tj3GetErrorStr(self.0));
            (code, text.to_string_lossy().into_owned())
        };
        (code != tj::TJERR_TJERR_WARNING as libc::c_int)
            .then(|| Undecodable(format!("{what}: {message}")))
    }

    fn get(&self, param: tj::TJPARAM) -> libc::c_int {
        // SAFETY: the handle is live; an unknown parameter answers -1.
        unsafe { tj::tj3Get(self.0, param as libc::c_int) }
    }

    fn set(&self, param: tj::TJPARAM, value: u64) -> Result<(), Undecodable> {
        let value = libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX);
        // SAFETY: the handle is live.
        if unsafe { tj::tj3Set(self.0, param as libc::c_int, value) } != 0 {
            return Err(self
                .fatal("libjpeg-turbo refused a setting")
                .unwrap_or_else(|| Undecodable("libjpeg-turbo refused a setting".into())));
        }
        Ok(())
    }

    fn read_header(&self, bytes: &[u8]) -> Result<(), Undecodable> {
        // SAFETY: the handle is live and `bytes` outlives the call.
        let status = unsafe { tj::tj3DecompressHeader(self.0, bytes.as_ptr(), bytes.len() as _) };
        match status {
            0 => Ok(()),
            _ => match self.fatal("not a readable JPEG") {
                Some(error) => Err(error),
                None => Ok(()),
            },
        }
    }
}

impl Drop for Decompressor {
    fn drop(&mut self) {
        // SAFETY: the handle came from tj3Init and is destroyed once.
        unsafe { tj::tj3Destroy(self.0) }
    }
}

/// A JPEG opened by libjpeg-turbo: its decoder, and what its header says.
pub(super) struct Jpeg<'b> {
    decoder: Decompressor,
    bytes: &'b [u8],
    /// Size, channels, scans.
    pub header: Header,
}

/// `bytes` opened, its frame header read: size, channels, scans. Refuses what Pillow refuses
/// (samples of other than 8 bits; channel counts other than 1, 3 and 4).
pub(super) fn open(bytes: &[u8]) -> Result<Jpeg<'_>, Undecodable> {
    let decoder = Decompressor::new()?;
    decoder.read_header(bytes)?;
    let precision = decoder.get(tj::TJPARAM_TJPARAM_PRECISION);
    if precision != 8 {
        return Err(Undecodable(format!(
            "a JPEG of {precision}-bit samples: only 8-bit JPEGs are read (as Pillow reads them)"
        )));
    }
    let channels = match decoder.get(tj::TJPARAM_TJPARAM_COLORSPACE) as tj::TJCS {
        tj::TJCS_TJCS_GRAY => 1,
        tj::TJCS_TJCS_RGB | tj::TJCS_TJCS_YCbCr => 3,
        tj::TJCS_TJCS_CMYK | tj::TJCS_TJCS_YCCK => 4,
        other => {
            return Err(Undecodable(format!(
                "a JPEG in colour space {other}, which is not read"
            )))
        }
    };
    let dimension = |param| u32::try_from(decoder.get(param)).unwrap_or(0);
    let header = Header {
        width: dimension(tj::TJPARAM_TJPARAM_JPEGWIDTH),
        height: dimension(tj::TJPARAM_TJPARAM_JPEGHEIGHT),
        channels,
        scans: scans(bytes),
    };
    Ok(Jpeg {
        decoder,
        bytes,
        header,
    })
}

impl Jpeg<'_> {
    /// The picture decoded to 8-bit RGB, Pillow's bytes: CMYK through a buffer of four bytes a
    /// pixel converted in place, the rest straight to RGB. libjpeg (which reads the header
    /// again as it decodes) is held to the header's size and to the coefficient planes it
    /// accounts for plus [`OWN_BYTES`].
    pub fn decode_rgb(self) -> Result<Vec<u8>, Undecodable> {
        let Self {
            decoder,
            bytes,
            header,
        } = self;
        let pixels = u64::from(header.width) * u64::from(header.height);
        decoder.set(tj::TJPARAM_TJPARAM_MAXPIXELS, pixels)?;
        let limit = header.coefficient_bytes() + OWN_BYTES;
        decoder.set(tj::TJPARAM_TJPARAM_MAXMEMORY, limit.div_ceil(1 << 20))?;
        let cmyk = header.channels == 4;
        let (format, size) = if cmyk {
            (tj::TJPF_TJPF_CMYK, 4)
        } else {
            (tj::TJPF_TJPF_RGB, 3)
        };
        let too_big = || Undecodable(format!("{pixels} pixels do not fit in memory"));
        let pitch = usize::try_from(header.width).map_err(|_| too_big())? * size;
        let total = usize::try_from(pixels)
            .ok()
            .and_then(|n| n.checked_mul(size))
            .ok_or_else(too_big)?;
        let mut data = vec![0u8; total];
        // SAFETY: the handle is live; `data` holds `height` rows of `pitch` bytes, what tj3Decompress8
        // writes for the header's size in this pixel format (MAXPIXELS refuses any other size).
        let status = unsafe {
            tj::tj3Decompress8(
                decoder.0,
                bytes.as_ptr(),
                bytes.len() as _,
                data.as_mut_ptr(),
                libc::c_int::try_from(pitch).map_err(|_| too_big())?,
                format,
            )
        };
        if status != 0 {
            if let Some(error) = decoder.fatal("a broken JPEG") {
                return Err(error);
            }
        }
        if cmyk {
            cmyk_to_rgb_in_place(&mut data);
        }
        Ok(data)
    }
}

/// Pillow's reading of libjpeg's CMYK: inverted (`CMYK;I`, Adobe's convention, assumed for every
/// 4-channel JPEG), then `cmyk2rgb` (libImaging/Convert.c): each channel `255 − k` less its
/// product with the inverted channel, in Pillow's rounding division by 255. Forward and in place
/// (a pixel shrinks from four bytes to three), then the tail dropped.
fn cmyk_to_rgb_in_place(data: &mut Vec<u8>) {
    let muldiv255 = |a: u32, b: u32| {
        let t = a * b + 128;
        ((t >> 8) + t) >> 8
    };
    let pixels = data.len() / 4;
    for i in 0..pixels {
        let [c, m, y, k] = [0, 1, 2, 3].map(|j| 255 - u32::from(data[4 * i + j]));
        let nk = 255 - k;
        for (j, v) in [c, m, y].into_iter().enumerate() {
            data[3 * i + j] = nk.saturating_sub(muldiv255(v, nk)) as u8;
        }
    }
    data.truncate(3 * pixels);
    data.shrink_to_fit();
}

/// Whether a JPEG's last scan (`FF DA`) is followed by the end-of-image marker (`FF D9`): a
/// thumbnail in the EXIF header has its own markers, but they come before the image's scans.
pub(super) fn complete(bytes: &[u8]) -> bool {
    let last = |marker: u8| bytes.windows(2).rposition(|w| w == [0xFF, marker]);
    matches!((last(0xDA), last(0xD9)), (Some(scan), Some(end)) if end > scan)
}

/// The EXIF orientation, as Pillow's `exif_transpose` reads it: from the first `APP1` segment
/// holding Exif before the first scan; none where there is none or it cannot be read.
pub(super) fn orientation(bytes: &[u8]) -> Orientation {
    Segments::new(bytes)
        .take_while(|(marker, _)| !matches!(marker, 0xDA | 0xD9))
        .find_map(|(marker, payload)| {
            (marker == 0xE1)
                .then(|| payload.strip_prefix(b"Exif\0\0"))
                .flatten()
        })
        .and_then(Orientation::from_exif_chunk)
        .unwrap_or(Orientation::NoTransforms)
}

/// The number of scans (`SOS` segments) before the end-of-image marker.
fn scans(bytes: &[u8]) -> usize {
    Segments::new(bytes)
        .take_while(|(marker, _)| *marker != 0xD9)
        .filter(|(marker, _)| *marker == 0xDA)
        .count()
}

/// A JPEG's segments in order, each its marker and payload, walked by their lengths with each
/// scan's entropy-coded bytes skipped to the next marker (so a thumbnail inside an `APP1`
/// segment is never seen); ends where the bytes do or stop making sense.
struct Segments<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Segments<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, at: 2 } // past SOI
    }
}

impl<'a> Iterator for Segments<'a> {
    type Item = (u8, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let bytes = self.bytes;
        loop {
            let (Some(&0xFF), Some(&marker)) = (bytes.get(self.at), bytes.get(self.at + 1)) else {
                return None;
            };
            match marker {
                // A fill byte before a marker.
                0xFF => self.at += 1,
                // Markers without a length: restarts, SOI, TEM, EOI.
                0xD0..=0xD9 | 0x01 => {
                    self.at += 2;
                    return Some((marker, &[]));
                }
                _ => {
                    let length = bytes.get(self.at + 2..self.at + 4)?;
                    let length = usize::from(u16::from_be_bytes([length[0], length[1]]));
                    let end = self.at + 2 + length.max(2);
                    let payload = bytes.get(self.at + 4..end.min(bytes.len()))?;
                    self.at = if marker == 0xDA {
                        entropy_end(bytes, end)
                    } else {
                        end
                    };
                    return Some((marker, payload));
                }
            }
        }
    }
}

/// Where a scan's entropy-coded bytes from `at` end: the next `FF` that starts a marker (not a
/// stuffed `FF 00`, a restart marker or a fill byte).
fn entropy_end(bytes: &[u8], mut at: usize) -> usize {
    while at + 1 < bytes.len() {
        if bytes[at] == 0xFF && !matches!(bytes[at + 1], 0x00 | 0xD0..=0xD7 | 0xFF) {
            return at;
        }
        at += 1;
    }
    bytes.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn photo(name: &str) -> Vec<u8> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/images/photos/");
        std::fs::read(format!("{dir}{name}")).unwrap()
    }

    /// Issue 53: a multi-scan JPEG's coefficient planes are charged to the decode budget, so the
    /// header tells a progressive file (ten scans as Pillow writes it) from a baseline one.
    #[test]
    fn scans_are_counted_past_a_thumbnail_and_stuffed_bytes() {
        let header = |bytes: &[u8]| open(bytes).map(|jpeg| jpeg.header);
        assert!(header(&photo("chelsea-progressive.jpg")).unwrap().scans > 1);
        for baseline in ["astronaut.jpg", "camera-gray.jpg", "coffee-cmyk.jpg"] {
            let h = header(&photo(baseline)).unwrap();
            assert_eq!(h.scans, 1, "{baseline}");
            assert_eq!(h.coefficient_bytes(), 0, "{baseline}");
        }
        // The rotated photo's EXIF block: an APP1 segment holding markers of its own.
        let mut app1 = vec![0xFF, 0xD8, 0xFF, 0xE1, 0x00, 0x06, 0xFF, 0xDA, 0xFF, 0xD9];
        app1.extend_from_slice(&[0xFF, 0xDA, 0x00, 0x02, 0x12, 0xFF, 0x00, 0xFF, 0xD0]);
        app1.extend_from_slice(&[0x34, 0xFF, 0xDA, 0x00, 0x02, 0xFF, 0xD9]);
        assert_eq!(scans(&app1), 2);
        assert_eq!(scans(&app1[..8]), 0);
    }

    /// Pillow's `cmyk2rgb` at its corners: no ink is white, full black is black whatever else,
    /// and the rounding of its division by 255.
    #[test]
    fn cmyk_reads_inverted_as_pillow_converts_it() {
        // libjpeg's (inverted) samples: 255 is no ink.
        let mut data = vec![
            255, 255, 255, 255, 0, 0, 0, 0, 127, 255, 255, 255, 255, 255, 255, 0,
        ];
        cmyk_to_rgb_in_place(&mut data);
        assert_eq!(data, vec![255, 255, 255, 0, 0, 0, 127, 255, 255, 0, 0, 0]);
    }
}
