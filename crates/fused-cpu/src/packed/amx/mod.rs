//! The dense layers in bf16 with f32 sums, on AMX tiles (Intel Sapphire Rapids and later:
//! Google Cloud's C3, C4 and N4); attention's two products on the same tiles in [`attention`].
//!
//! One `tdpbf16ps` multiplies a 16 × 32 bf16 tile of rows by a 32 × 16 tile of weights into
//! 16 × 16 f32 sums: 16,384 multiply-adds, against `vdpbf16ps`'s 32. The weights are packed
//! exactly as for the AVX-512 BF16 kernel ([`super::bf16`]): in a panel, each step's 16 columns
//! of input pairs side by side, 64 bytes a step, which is the layout a weight tile is loaded in;
//! only their steps are padded to a multiple of 16 (one tile's depth) with zeros. The rows are
//! rounded to bf16 by the same conversion, so AMX and AVX-512 BF16 compute the same products;
//! only the order in which the f32 sums are added differs.
//!
//! Rust's AMX intrinsics are nightly-only, so the instructions are written as inline assembly;
//! the tile registers are never touched by compiled code, so they hold their values between the
//! `asm!` blocks of one kernel call. Linux hands a process the tile state only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`): [`supported`] asks once.

use super::{Tile, PANEL};

use super::{AMX_DEPTH as DEPTH, AMX_TILE_ROWS as TILE_ROWS};

/// Whether this CPU and kernel run AMX bf16 products: the CPU reports AMX-TILE and AMX-BF16,
/// the AVX-512 BF16 conversion the rows go through is there, and Linux granted the process the
/// tile state ([`granted`]).
pub fn supported() -> bool {
    static BF16: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *BF16.get_or_init(|| cpu_has_amx(22) && super::bf16::supported() && granted())
}

/// Whether this CPU and kernel run AMX int8 products (`tdpbssd`, for the GGUF block products in
/// `crate::quant`): the CPU reports AMX-TILE and AMX-INT8, and Linux granted the tile state.
pub(crate) fn int8_supported() -> bool {
    // Asked before every block product: CPUID exits a virtual machine to its host, microseconds
    // each (at one answer a step, SmolLM2 ran at half its speed asking it each time).
    static INT8: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INT8.get_or_init(|| cpu_has_amx(25) && granted())
}

/// Whether Linux granted this process the tile state (asked once, on the first call).
fn granted() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *GRANTED.get_or_init(|| cpu_has_amx(24) && request_tiles())
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        false
    }
}

/// CPUID leaf 7's EDX bit `bit`: AMX-BF16 22, AMX-TILE 24, AMX-INT8 25.
fn cpu_has_amx(bit: u32) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::x86_64::__cpuid(0).eax < 7 {
            return false;
        }
        std::arch::x86_64::__cpuid_count(7, 0).edx & (1 << bit) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = bit;
        false
    }
}

/// Asks Linux for the AMX tile data state; false where the kernel refuses it (a kernel before
/// 5.16, or one that disabled AMX).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tiles() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let result: i64;
    // SAFETY: the arch_prctl system call with these arguments changes only which register
    // state this process may use; it reads and writes no memory of ours.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => result,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    result == 0
}

/// A tile configuration (palette 1): each tile's rows and bytes per row.
#[repr(C, align(64))]
pub(crate) struct Config([u8; 64]);

impl Config {
    /// Palette 1 with tile `t` of `shapes[t].0` rows of `shapes[t].1` bytes (unlisted tiles
    /// unused).
    pub(crate) const fn new(shapes: &[(u8, u16)]) -> Self {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < shapes.len() {
            let bytes = shapes[t].1.to_le_bytes();
            c[16 + 2 * t] = bytes[0];
            c[17 + 2 * t] = bytes[1];
            c[48 + t] = shapes[t].0;
            t += 1;
        }
        Self(c)
    }
}

/// The bf16 kernels' configuration: tmm0–3 the sums (16 rows of 16 f32), tmm4–5 two row tiles
/// (16 rows of 32 bf16), tmm6–7 two weight tiles (16 steps of 16 columns' pairs). Every tile is
/// 16 rows of 64 bytes.
static CONFIG: Config = Config::new(&[(16, 64); 8]);

thread_local! {
    /// The configuration this thread's tiles hold: it stays until another is loaded (this
    /// crate never issues `tilerelease`), so a thread loads one again only when it switches
    /// between the bf16 and the int8 kernels.
    static CONFIGURED: std::cell::Cell<*const Config> = const { std::cell::Cell::new(std::ptr::null()) };
}

/// Loads [`CONFIG`] into this thread's tile configuration unless it is loaded.
///
/// # Safety
/// [`supported`].
#[cfg(target_arch = "x86_64")]
unsafe fn configure() {
    configure_with(&CONFIG)
}

/// Loads `config` into this thread's tile configuration unless it is the one loaded.
///
/// # Safety
/// The CPU has AMX-TILE and the process was granted the tile state ([`int8_supported`] or
/// [`supported`]); `config` is a valid palette-1 configuration.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn configure_with(config: &'static Config) {
    if !std::ptr::eq(CONFIGURED.get(), config) {
        std::arch::asm!("ldtilecfg [{0}]", in(reg) config.0.as_ptr(), options(nostack, readonly));
        CONFIGURED.set(config);
    }
}

/// `tileloadd tmmN, [ptr + stride]`, and the other tile instructions, by register number.
macro_rules! tile {
    (zero $n:literal) => {
        std::arch::asm!(concat!("tilezero tmm", $n), options(nostack))
    };
    (load $n:literal, $ptr:expr, $stride:expr) => {
        std::arch::asm!(
            concat!("tileloadd tmm", $n, ", [{p} + {s}*1]"),
            p = in(reg) $ptr,
            s = in(reg) $stride,
            options(nostack, readonly),
        )
    };
    (dot $c:literal, $a:literal, $b:literal) => {
        std::arch::asm!(
            concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem),
        )
    };
    // Signed bytes of tile `a` by signed bytes of tile `b`, four at a time, into i32 sums.
    (dot_ss $c:literal, $a:literal, $b:literal) => {
        std::arch::asm!(
            concat!("tdpbssd tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem),
        )
    };
    (store $n:literal, $ptr:expr) => {
        tile!(store $n, $ptr, 64usize)
    };
    (store $n:literal, $ptr:expr, $stride:expr) => {
        std::arch::asm!(
            concat!("tilestored [{p} + {s}*1], tmm", $n),
            p = in(reg) $ptr,
            s = in(reg) $stride,
            options(nostack),
        )
    };
}

// After the macro: the attention kernels and the GGUF block products use it.
pub(crate) use tile;
pub(crate) mod attention;

/// Up to 32 rows (two row tiles; the second only when `height` > 16) by `P` (1 or 2) panels of
/// the product, the sums over every step in tiles; then bias and store the `height` rows.
///
/// # Safety
/// [`supported`]; the tile's rows cover 32 rows of `steps` lanes (rows past `height` are read
/// but not stored), `steps` is a multiple of [`DEPTH`], and its weights cover `P` panels.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn kernel<const P: usize>(t: &Tile, height: usize) {
    let two = height > TILE_ROWS;
    let row_stride = t.steps * 4;
    let panel = t.steps * PANEL;
    configure();
    tile!(zero 0);
    tile!(zero 1);
    tile!(zero 2);
    tile!(zero 3);
    for c in (0..t.steps).step_by(DEPTH) {
        let a = t.rows.add(c);
        let w = t.weights.add(c * PANEL);
        tile!(load 4, a, row_stride);
        tile!(load 6, w, 64usize);
        tile!(dot 0, 4, 6);
        if P == 2 {
            tile!(load 7, w.add(panel), 64usize);
            tile!(dot 1, 4, 7);
        }
        if two {
            tile!(load 5, a.add(TILE_ROWS * t.steps), row_stride);
            tile!(dot 2, 5, 6);
            if P == 2 {
                tile!(dot 3, 5, 7);
            }
        }
    }
    // Without a bias, whole tiles of sums (16 rows, every panel full) go straight to the output.
    if t.bias.is_none() && t.cols >= P * PANEL && height.is_multiple_of(TILE_ROWS) {
        let stride = t.n * 4;
        tile!(store 0, t.out, stride);
        if P == 2 {
            tile!(store 1, t.out.add(PANEL), stride);
        }
        if two {
            let lower = t.out.add(TILE_ROWS * t.n);
            tile!(store 2, lower, stride);
            if P == 2 {
                tile!(store 3, lower.add(PANEL), stride);
            }
        }
        return;
    }
    let mut sums = [[[0f32; PANEL]; TILE_ROWS]; 4];
    tile!(store 0, sums[0].as_mut_ptr());
    tile!(store 1, sums[1].as_mut_ptr());
    tile!(store 2, sums[2].as_mut_ptr());
    tile!(store 3, sums[3].as_mut_ptr());
    store(t, &sums, height, P);
}

/// Adds the bias to the tile sums and writes the `height` rows' columns that exist, 16 at a
/// time (the last panel masked), so the store costs a few instructions per row, not one per sum.
///
/// # Safety
/// AVX-512 F (implied by [`supported`]); the tile's output covers `height` rows and `cols`
/// columns from its first, and its bias (if any) as many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn store(t: &Tile, sums: &[[[f32; PANEL]; TILE_ROWS]; 4], height: usize, panels: usize) {
    use std::arch::x86_64::*;
    let cols = t.cols.min(panels * PANEL);
    for p in 0..panels {
        let first = p * PANEL;
        if first >= cols {
            break;
        }
        let left = (cols - first).min(PANEL);
        let mask: __mmask16 = if left == PANEL {
            0xffff
        } else {
            (1u16 << left) - 1
        };
        let bias = match t.bias {
            Some(b) => _mm512_maskz_loadu_ps(mask, b.add(first)),
            None => _mm512_setzero_ps(),
        };
        for r in 0..height {
            let (half, row) = (r / TILE_ROWS, r % TILE_ROWS);
            let v = _mm512_loadu_ps(sums[half * 2 + p][row].as_ptr());
            let out = t.out.add(r * t.n + first);
            _mm512_mask_storeu_ps(out, mask, _mm512_add_ps(v, bias));
        }
    }
}
