//! Weights repacked at load for the SIMD kernels — layout version [`PACK_FORMAT`].
//!
//! A quantized matrix (Q4_0, Q4_1 or Q8_0, blocks of 32 values) is cut into groups of
//! [`GROUP_ROWS`] = 16 rows (the last group padded with zero rows). A group's blocks follow
//! each other in column order; block `b` of group `g` starts at byte
//! `(g · blocks_per_row + b) · block_bytes` of a page-aligned buffer and holds:
//!
//! | bytes | content |
//! |---|---|
//! | 0..32 | `d`: the 16 rows' block scales, f16 |
//! | 32..64 | `c`: the 16 rows' offset coefficients, f16: Q4_1 `m`, Q4_0 `−8·d`, Q8_0 `−128·d` |
//! | 64.. | the quants as 16-row "lanes" of 4 bytes, in chunks of 64 bytes |
//!
//! * **Nibble** kind (Q4_0, Q4_1; 320 bytes a block): 4 chunks. Lane `r` of chunk `k` is row
//!   `r`'s packed bytes `4k..4k+4`, as in GGUF, so its low nibbles are values `4k..4k+4` and
//!   its high nibbles values `16+4k..16+4k+4` (unsigned 0..15).
//! * **Byte** kind (Q8_0; 576 bytes a block): 8 chunks; lane `r` of chunk `k` is row `r`'s
//!   signed values `4k..4k+4`.
//!
//! With activations quantized per block (`dₓ`, `sₓ = dₓ·Σx`, 8-bit `x`), row `r`'s block
//! contributes `d·dₓ·Σ q·x + c·sₓ`. A 32-bit lane holds one row, so one `vpdpbusd` (or
//! `vpmaddubsw` + `vpmaddwd`) advances 16 (8 on 256-bit registers) rows by 4 values against
//! one broadcast 4-byte piece of activations, with no horizontal sums; the byte kind is
//! made unsigned for `vpdpbusd` by flipping the sign bit in the register (`q + 128`), which
//! `c = −128·d` corrects. Scales stay f16, so the packed matrix is exactly as large as the
//! GGUF tensor (the nibble kind) or 6% larger (the byte kind, whose `c` is new).
//!
//! The format depends on nothing but the GGUF tensor, so it can be cached on disk keyed by
//! the file's hash and this version; the version changes with any change to the layout.

use rayon::prelude::*;

use super::{WeightView, QK};
use crate::gguf::GgmlType;

/// Version of the layout described above.
pub const PACK_FORMAT: u32 = 1;
/// Weight rows per group (one 32-bit lane each in a 512-bit register).
pub const GROUP_ROWS: usize = 16;
/// Bytes of scales before the quants of each block.
pub const SCALE_BYTES: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackKind {
    /// 4-bit unsigned quants (Q4_0, Q4_1).
    Nibble,
    /// 8-bit signed quants (Q8_0).
    Byte,
}

impl PackKind {
    /// The layout a GGUF type packs into, if it has one.
    pub fn of(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => Some(PackKind::Nibble),
            GgmlType::Q8_0 => Some(PackKind::Byte),
            _ => None,
        }
    }

    /// Bytes of one block of a 16-row group.
    pub const fn block_bytes(self) -> usize {
        match self {
            PackKind::Nibble => SCALE_BYTES + GROUP_ROWS * QK / 2,
            PackKind::Byte => SCALE_BYTES + GROUP_ROWS * QK,
        }
    }
}

/// A quantized matrix in the layout above.
pub struct PackedMatrix {
    pub kind: PackKind,
    pub rows: usize,
    pub cols: usize,
    /// Blocks of 32 values per row.
    pub blocks: usize,
    data: Storage,
}

/// Where packed bytes live.
enum Storage {
    /// Anonymous pages of their own (page-aligned, so 64-byte aligned), returned to the OS
    /// when the matrix is dropped: an unloaded model's RSS really goes.
    Owned(memmap2::MmapMut),
    /// A page-aligned range of a mapped pack cache file (see [`crate::pack_cache`]): page
    /// cache, shared, nothing copied.
    Mapped(std::sync::Arc<memmap2::Mmap>, usize, usize),
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("kind", &self.kind)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

fn f16_bits(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

impl PackedMatrix {
    /// Repacks a quantized matrix; `None` for types the packed kernels do not take.
    pub fn pack(w: &WeightView<'_>) -> Option<Self> {
        let kind = PackKind::of(w.ty)?;
        if !w.cols.is_multiple_of(QK) || w.rows == 0 || w.cols == 0 {
            return None;
        }
        let blocks = w.cols / QK;
        let groups = w.rows.div_ceil(GROUP_ROWS);
        let bb = kind.block_bytes();
        let group_bytes = blocks * bb;
        let Ok(mut data) = memmap2::MmapMut::map_anon(groups * group_bytes) else {
            return None;
        };
        let (src_block, q_off) = match w.ty {
            GgmlType::Q4_0 => (18, 2),
            GgmlType::Q4_1 => (20, 4),
            _ => (34, 2),
        };
        let bytes: &mut [u8] = &mut data;
        // A scale whose `c` overflows f16 (|d| > 511 for Q8_0): such a matrix is not packed
        // and takes the unpacked path instead.
        let overflow = std::sync::atomic::AtomicBool::new(false);
        bytes.par_chunks_mut(group_bytes).enumerate().for_each(|(g, dst)| {
            for r in 0..GROUP_ROWS {
                let row = g * GROUP_ROWS + r;
                if row >= w.rows {
                    break; // padding rows stay zero: d = c = 0
                }
                let src = w.row(row);
                for b in 0..blocks {
                    let s = &src[b * src_block..(b + 1) * src_block];
                    let o = &mut dst[b * bb..(b + 1) * bb];
                    let d = f16_bits(s, 0);
                    let c = match w.ty {
                        GgmlType::Q4_1 => f16_bits(s, 2),
                        GgmlType::Q4_0 => scaled_f16(d, -8.0),
                        _ => scaled_f16(d, -128.0),
                    };
                    if !half::f16::from_bits(c).is_finite() {
                        overflow.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    o[2 * r..2 * r + 2].copy_from_slice(&d.to_le_bytes());
                    o[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&c.to_le_bytes());
                    let q = &s[q_off..];
                    let chunks = q.len() / 4;
                    for k in 0..chunks {
                        let at = SCALE_BYTES + 64 * k + 4 * r;
                        o[at..at + 4].copy_from_slice(&q[4 * k..4 * k + 4]);
                    }
                }
            }
        });
        if overflow.into_inner() {
            return None;
        }
        Some(Self {
            kind,
            rows: w.rows,
            cols: w.cols,
            blocks,
            data: Storage::Owned(data),
        })
    }

    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP_ROWS)
    }

    /// Bytes of one group (all its blocks).
    pub fn group_bytes(&self) -> usize {
        self.blocks * self.kind.block_bytes()
    }

    /// The packed bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            Storage::Owned(m) => m,
            Storage::Mapped(m, at, len) => &m[*at..*at + *len],
        }
    }

    /// Bytes the layout takes for a matrix of this shape.
    pub fn size_for(kind: PackKind, rows: usize, cols: usize) -> usize {
        rows.div_ceil(GROUP_ROWS) * (cols / QK) * kind.block_bytes()
    }

    /// A packed matrix over `len` bytes at `at` of a mapped cache file (`at` 64-byte
    /// aligned; `len` = [`Self::size_for`]).
    pub fn mapped(
        kind: PackKind,
        rows: usize,
        cols: usize,
        map: std::sync::Arc<memmap2::Mmap>,
        at: usize,
    ) -> Option<Self> {
        let len = Self::size_for(kind, rows, cols);
        if !at.is_multiple_of(64) || at + len > map.len() || !cols.is_multiple_of(QK) || rows == 0 {
            return None;
        }
        Some(Self {
            kind,
            rows,
            cols,
            blocks: cols / QK,
            data: Storage::Mapped(map, at, len),
        })
    }

    /// Whether the bytes come from a cache file (not repacked in this process).
    pub fn is_mapped(&self) -> bool {
        matches!(self.data, Storage::Mapped(..))
    }

    /// Group `g`'s bytes (64-byte aligned).
    pub fn group(&self, g: usize) -> &[u8] {
        let n = self.group_bytes();
        &self.bytes()[g * n..(g + 1) * n]
    }

    /// Scalar reference over the packed layout: row `r` against one activation row.
    pub fn dot_scalar(&self, r: usize, x: &[super::BlockQ8]) -> f32 {
        let bb = self.kind.block_bytes();
        let (g, lane) = (r / GROUP_ROWS, r % GROUP_ROWS);
        let grp = self.group(g);
        let mut acc = 0f32;
        for (b, xb) in x.iter().enumerate().take(self.blocks) {
            let o = &grp[b * bb..(b + 1) * bb];
            let d = half::f16::from_bits(f16_bits(o, 2 * lane)).to_f32();
            let c = half::f16::from_bits(f16_bits(o, 32 + 2 * lane)).to_f32();
            let mut s = 0i32;
            match self.kind {
                PackKind::Nibble => {
                    for k in 0..4 {
                        for i in 0..4 {
                            let byte = o[SCALE_BYTES + 64 * k + 4 * lane + i];
                            s += (byte & 0x0F) as i32 * xb.qs[4 * k + i] as i32;
                            s += (byte >> 4) as i32 * xb.qs[16 + 4 * k + i] as i32;
                        }
                    }
                    acc += d * xb.d * s as f32 + c * xb.s;
                }
                PackKind::Byte => {
                    for k in 0..8 {
                        for i in 0..4 {
                            let q = o[SCALE_BYTES + 64 * k + 4 * lane + i] as i8;
                            s += q as i32 * xb.qs[4 * k + i] as i32;
                        }
                    }
                    acc += d * xb.d * s as f32;
                }
            }
        }
        acc
    }
}

/// `d · k` in f16 (exact, `k` being a power of two, unless it overflows: checked by the
/// caller).
fn scaled_f16(d: u16, k: f32) -> u16 {
    half::f16::from_f32(half::f16::from_bits(d).to_f32() * k).to_bits()
}
