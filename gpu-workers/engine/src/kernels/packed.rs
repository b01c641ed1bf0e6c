//! Weights repacked at load for the SIMD kernels — layout version [`PACK_FORMAT`].
//!
//! A quantized matrix is cut into groups of [`GROUP_ROWS`] = 16 rows (the last group padded
//! with zero rows). A group is a run of *super-blocks* in column order, each covering 32
//! columns ([`Nibble`](PackKind::Nibble), [`Byte`](PackKind::Byte),
//! [`Nibble5`](PackKind::Nibble5)) or 256 ([`K4`](PackKind::K4), [`K5`](PackKind::K5),
//! [`K6`](PackKind::K6)) of the 16 rows: a header of scales, then for each of its 32-column
//! blocks the quants. Super-block `s` of group `g` starts at byte
//! `(g · supers_per_row + s) · super_bytes` of a page-aligned buffer; everything is 64-byte
//! aligned.
//!
//! The quants of a 32-column block are the 16 rows' values as "lanes" of 4 bytes, in
//! chunks of 64 bytes:
//!
//! * **Nibbles** (every kind but `Byte`): 4 chunks. Lane `r` of chunk `k` is row `r`'s
//!   values `4k..4k+4` in its low nibbles and `16+4k..16+4k+4` in its high nibbles (GGUF's
//!   Q4_0 order; K-quants are reordered into it).
//! * **High bits** (Nibble5, K5: one 64-byte plane; K6: two, bit 4 then bit 5): lane `r` is a
//!   32-bit word of row `r` whose byte `i`, bit `k` is the high bit of value `4k+i` and bit
//!   `4+k` that of value `16+4k+i`, so chunk `k`'s bits are `(h >> k) << 4` (low nibbles)
//!   and `h >> k` (high nibbles) masked with `0x10`.
//! * **Bytes** (Q8_0): 8 chunks; lane `r` of chunk `k` is row `r`'s signed values `4k..4k+4`.
//!
//! Headers (f16 as GGUF stores them; K-quant sub-scales as integers, so nothing is rounded):
//!
//! | kind | types | header | per 32-column block |
//! |---|---|---|---|
//! | Nibble | Q4_0, Q4_1 | 0..32 `d` ×16, 32..64 `c` ×16 (Q4_1 `m`, Q4_0 `−8d`) | 256 B nibbles |
//! | Byte | Q8_0 | `d`, `c = −128d` | 512 B bytes |
//! | Nibble5 | Q5_0, Q5_1 | `d`, `c` (Q5_1 `m`, Q5_0 `−16d`) | 256 B nibbles + 64 B high bits |
//! | K4 | Q4_K | 0..32 `d` ×16, 32..64 `−dmin` ×16, 64..192 `sc` u8 [8 blocks][16 rows], 192..320 `m` u8 [8][16] | 256 B |
//! | K5 | Q5_K | as K4 | 256 B + 64 B |
//! | K6 | Q6_K | 0..32 `d` ×16, 32..64 zero, 64..320 `sc` i8 [8 blocks][2 halves][16 rows] | 256 B + 2 × 64 B |
//!
//! With activations quantized per block of 32 (`dₓ`, `sₓ = dₓ·Σx`, 8-bit `x`), row `r`'s
//! block contributes `D·dₓ·Σ v·x + C·sₓ` with unsigned quants `v`, where `D, C` are `d, c`
//! (K4/K5: `d·sc, −dmin·m`); K6's contributes `dₓ·(d·sa·(Σ₀..₁₆ v·x − 32·X₀) + d·sb·(Σ₁₆..₃₂ v·x −
//! 32·X₁))` with the activations' half sums `X`. A 32-bit lane holds one row, so one
//! `vpdpbusd` (or `vpmaddubsw` + `vpmaddwd`) advances 16 (8 on 256-bit registers) rows by 4
//! values against one broadcast 4-byte piece of activations, with no horizontal sums; the
//! byte kind is made unsigned for `vpdpbusd` by flipping the sign bit in the register
//! (`q + 128`), which `c = −128·d` corrects. The packed matrix is about as large as the
//! GGUF tensor: Q4_1 and Q5_1 exactly, Q4_K/Q5_K/Q6_K 1–3 % larger, Q4_0/Q5_0/Q8_0 6–11 %.
//!
//! The format depends on nothing but the GGUF tensor, so it can be prepared once and mapped
//! ([`crate::kernels::pack_cache`], tied to the model file's size and time); the version
//! changes with any change to this layout or to the pack file's (3: a checksum per matrix).

use rayon::prelude::*;

use super::blocks::{self, RawScale};
use super::{WeightView, QK};
use crate::formats::gguf::GgmlType;
use crate::kernels::pack_cache::Verifier;

/// Version of the layout described above and of the cache file holding it
/// ([`crate::kernels::pack_cache`]; 3: a checksum per matrix).
pub const PACK_FORMAT: u32 = 3;
/// Weight rows per group (one 32-bit lane each in a 512-bit register).
pub const GROUP_ROWS: usize = 16;
/// Bytes of a 32-column kind's scales before its quants.
pub const SCALE_BYTES: usize = 64;
/// Bytes of a K-quant super-block's header.
pub const K_HEADER_BYTES: usize = 320;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackKind {
    /// 4-bit unsigned quants (Q4_0, Q4_1).
    Nibble,
    /// 8-bit signed quants (Q8_0).
    Byte,
    /// 5-bit unsigned quants, scale per 32 (Q5_0, Q5_1).
    Nibble5,
    /// Q4_K: 4-bit quants, 6-bit scales and mins per 32 under f16 super-scales.
    K4,
    /// Q5_K: as K4 with 5-bit quants.
    K5,
    /// Q6_K: 6-bit quants around 32, signed 8-bit scales per 16.
    K6,
}

impl PackKind {
    /// The layout a GGUF type packs into, if it has one.
    pub fn of(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => Some(PackKind::Nibble),
            GgmlType::Q8_0 => Some(PackKind::Byte),
            GgmlType::Q5_0 | GgmlType::Q5_1 => Some(PackKind::Nibble5),
            GgmlType::Q4_K => Some(PackKind::K4),
            GgmlType::Q5_K => Some(PackKind::K5),
            GgmlType::Q6_K => Some(PackKind::K6),
            _ => None,
        }
    }

    /// The number the pack cache stores for the kind.
    pub const fn code(self) -> u8 {
        match self {
            PackKind::Nibble => 0,
            PackKind::Byte => 1,
            PackKind::Nibble5 => 2,
            PackKind::K4 => 3,
            PackKind::K5 => 4,
            PackKind::K6 => 5,
        }
    }

    /// Whether the kind has K-quant super-blocks of 256 columns.
    pub const fn is_k(self) -> bool {
        matches!(self, PackKind::K4 | PackKind::K5 | PackKind::K6)
    }

    /// 32-column blocks per super-block.
    pub const fn blocks_per_super(self) -> usize {
        if self.is_k() {
            8
        } else {
            1
        }
    }

    /// Bytes of a super-block's header.
    pub const fn header_bytes(self) -> usize {
        if self.is_k() {
            K_HEADER_BYTES
        } else {
            SCALE_BYTES
        }
    }

    /// 64-byte planes of high bits per 32-column block.
    pub const fn high_planes(self) -> usize {
        match self {
            PackKind::Nibble5 | PackKind::K5 => 1,
            PackKind::K6 => 2,
            _ => 0,
        }
    }

    /// Bytes of one 32-column block's quants (16 rows).
    pub const fn quant_bytes(self) -> usize {
        match self {
            PackKind::Byte => GROUP_ROWS * QK,
            _ => GROUP_ROWS * QK / 2 + 64 * self.high_planes(),
        }
    }

    /// Bytes of one super-block of a 16-row group.
    pub const fn super_bytes(self) -> usize {
        self.header_bytes() + self.blocks_per_super() * self.quant_bytes()
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
    /// A page-aligned range of a mapped pack cache file (see [`crate::kernels::pack_cache`]): page
    /// cache, shared, nothing copied; computed with only once its check passed.
    Mapped(std::sync::Arc<memmap2::Mmap>, usize, usize, Check),
}

/// A mapped matrix's check: its index in the cache's [`Verifier`], and the copy repacked
/// from the model in its place if the check fails.
struct Check {
    verifier: std::sync::Arc<Verifier>,
    index: usize,
    repaired: std::sync::OnceLock<Option<Box<PackedMatrix>>>,
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
        Self::pack_as(w, PackKind::of(w.ty)?, w.ty)
    }

    /// Float weights (F32, F16, BF16) quantized to Q8_0 as llama.cpp's quantizer does it,
    /// then packed: float checkpoints at the integer kernels' speed, at 8.5 bits a weight.
    pub fn pack_float_as_q8_0(w: &WeightView<'_>) -> Option<Self> {
        if !matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return None;
        }
        Self::pack_as(w, PackKind::Byte, GgmlType::Q8_0)
    }

    /// Packs `w` into `kind`, its rows read as `ty` (converted from float first when `w` is
    /// float and `ty` is Q8_0).
    fn pack_as(w: &WeightView<'_>, kind: PackKind, ty: GgmlType) -> Option<Self> {
        let super_cols = QK * kind.blocks_per_super();
        if !w.cols.is_multiple_of(super_cols) || w.rows == 0 || w.cols == 0 {
            return None;
        }
        let blocks = w.cols / QK;
        let groups = w.rows.div_ceil(GROUP_ROWS);
        let group_bytes = blocks / kind.blocks_per_super() * kind.super_bytes();
        let Ok(mut data) = memmap2::MmapMut::map_anon(groups * group_bytes) else {
            return None;
        };
        let bytes: &mut [u8] = &mut data;
        // A scale whose `c` overflows f16 (|d| > 511 for Q8_0): such a matrix is not packed
        // and takes the unpacked path instead.
        let overflow = std::sync::atomic::AtomicBool::new(false);
        let convert = ty != w.ty;
        bytes.par_chunks_mut(group_bytes).enumerate().for_each(|(g, dst)| {
            let (mut floats, mut q8) = (Vec::new(), Vec::new());
            for r in 0..GROUP_ROWS {
                let row = g * GROUP_ROWS + r;
                if row >= w.rows {
                    break; // padding rows stay zero: every scale is 0
                }
                let src = if convert {
                    floats.resize(w.cols, 0f32);
                    super::dequantize_row(w.ty, w.row(row), &mut floats);
                    quantize_row_q8_0(&floats, &mut q8);
                    &q8[..]
                } else {
                    w.row(row)
                };
                if !pack_row(ty, kind, src, r, blocks, dst) {
                    overflow.store(true, std::sync::atomic::Ordering::Relaxed);
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

    /// Bytes of one group (all its super-blocks).
    pub fn group_bytes(&self) -> usize {
        self.blocks / self.kind.blocks_per_super() * self.kind.super_bytes()
    }

    /// The packed bytes. A mapped matrix's are as read, checked or not: compute with
    /// [`Self::checked`]'s matrix.
    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            Storage::Owned(m) => m,
            Storage::Mapped(m, at, len, _) => &m[*at..*at + *len],
        }
    }

    /// The matrix to compute with: this one, once a mapped matrix's check has passed (the
    /// first call waits for it); where it failed, the copy `repack` makes from the model
    /// (kept for later calls; owned memory beside the map, not counted in the model's
    /// packed bytes), or `None` (the caller computes from the model's own weights).
    pub fn checked(&self, repack: impl FnOnce() -> Option<PackedMatrix>) -> Option<&PackedMatrix> {
        match &self.data {
            Storage::Owned(_) => Some(self),
            Storage::Mapped(.., c) if c.verifier.wait(c.index) => Some(self),
            Storage::Mapped(.., c) => {
                // The repack runs on the compute pool, so not inside the cell's
                // initialisation, where a pool thread stealing work that reaches this same
                // cell would block on itself; two racing repacks make the same bytes, and
                // the first one set is kept.
                if c.repaired.get().is_none() {
                    let _ = c.repaired.set(repack().map(Box::new));
                }
                c.repaired.get().and_then(|r| r.as_deref())
            }
        }
    }

    /// Bytes the layout takes for a matrix of this shape.
    pub fn size_for(kind: PackKind, rows: usize, cols: usize) -> usize {
        rows.div_ceil(GROUP_ROWS) * (cols / (QK * kind.blocks_per_super())) * kind.super_bytes()
    }

    /// A packed matrix over `len` bytes at `at` of a mapped cache file (`at` 64-byte
    /// aligned; `len` = [`Self::size_for`]), checked by `verifier`'s `index`th check.
    pub(crate) fn mapped(
        kind: PackKind,
        rows: usize,
        cols: usize,
        map: std::sync::Arc<memmap2::Mmap>,
        at: usize,
        (verifier, index): (std::sync::Arc<Verifier>, usize),
    ) -> Option<Self> {
        let len = Self::size_for(kind, rows, cols);
        if !at.is_multiple_of(64)
            || at + len > map.len()
            || !cols.is_multiple_of(QK * kind.blocks_per_super())
            || rows == 0
        {
            return None;
        }
        Some(Self {
            kind,
            rows,
            cols,
            blocks: cols / QK,
            data: Storage::Mapped(
                map,
                at,
                len,
                Check {
                    verifier,
                    index,
                    repaired: std::sync::OnceLock::new(),
                },
            ),
        })
    }

    /// Group `g`'s bytes (64-byte aligned).
    pub fn group(&self, g: usize) -> &[u8] {
        let n = self.group_bytes();
        &self.bytes()[g * n..(g + 1) * n]
    }

    /// Row `r`'s block `b` read back from the packed layout into the canonical form.
    pub fn block(&self, r: usize, b: usize) -> blocks::Block {
        let kind = self.kind;
        let (g, lane) = (r / GROUP_ROWS, r % GROUP_ROWS);
        let per = kind.blocks_per_super();
        let sup = &self.group(g)[b / per * kind.super_bytes()..];
        let j = b % per;
        let q = &sup[kind.header_bytes() + j * kind.quant_bytes()..];
        let f = |at: usize| half::f16::from_bits(f16_bits(sup, at)).to_f32();
        let mut v = [0u8; QK];
        if kind == PackKind::Byte {
            for (k, c) in v.chunks_exact_mut(4).enumerate() {
                c.copy_from_slice(&q[64 * k + 4 * lane..64 * k + 4 * lane + 4]);
            }
        } else {
            for k in 0..4 {
                for i in 0..4 {
                    let byte = q[64 * k + 4 * lane + i];
                    v[4 * k + i] = byte & 0x0F;
                    v[16 + 4 * k + i] = byte >> 4;
                }
            }
            for plane in 0..kind.high_planes() {
                let at = 256 + 64 * plane + 4 * lane;
                let h = u32::from_le_bytes([q[at], q[at + 1], q[at + 2], q[at + 3]]);
                for k in 0..4 {
                    for i in 0..4 {
                        v[4 * k + i] |= (((h >> (8 * i + k)) & 1) as u8) << (4 + plane);
                        v[16 + 4 * k + i] |= (((h >> (8 * i + 4 + k)) & 1) as u8) << (4 + plane);
                    }
                }
            }
        }
        let scale = match kind {
            PackKind::Nibble | PackKind::Nibble5 => blocks::Scale::Affine {
                d: f(2 * lane),
                c: f(32 + 2 * lane),
            },
            PackKind::Byte => blocks::Scale::Signed { d: f(2 * lane) },
            PackKind::K4 | PackKind::K5 => blocks::Scale::Affine {
                d: f(2 * lane) * sup[64 + 16 * j + lane] as f32,
                c: f(32 + 2 * lane) * sup[192 + 16 * j + lane] as f32,
            },
            PackKind::K6 => blocks::Scale::Split {
                a: f(2 * lane) * sup[64 + 32 * j + lane] as i8 as f32,
                b: f(2 * lane) * sup[64 + 32 * j + 16 + lane] as i8 as f32,
            },
        };
        blocks::Block { v, scale }
    }

    /// Scalar reference over the packed layout: row `r` against one activation row.
    pub fn dot_scalar(&self, r: usize, x: &[super::BlockQ8]) -> f32 {
        x.iter()
            .take(self.blocks)
            .enumerate()
            .map(|(b, xb)| blocks::dot(&self.block(r, b), xb))
            .sum()
    }
}

/// Writes row `r` of a group (its lane) into the group's bytes `dst`; false if a derived
/// f16 offset overflowed. Straight from the GGUF bytes, a 32-value block at a time with
/// 64-bit word operations: 16 packed bytes of nibbles as two words, the high bits as one
/// 32-bit word ([`high_plane`]), the scales copied — about 1 GB/s per core, where decoding
/// each block into 32 values first ([`pack_row_generic`], kept as the reference the tests
/// compare with) ran at a quarter of that.
fn pack_row(ty: GgmlType, kind: PackKind, src: &[u8], r: usize, blocks: usize, dst: &mut [u8]) -> bool {
    let (sb, hb, qb) = (kind.super_bytes(), kind.header_bytes(), kind.quant_bytes());
    let mut ok = true;
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (src_block, q_off, high) = match ty {
                GgmlType::Q4_0 => (18, 2, None),
                GgmlType::Q4_1 => (20, 4, None),
                GgmlType::Q5_0 => (22, 6, Some(2)),
                GgmlType::Q5_1 => (24, 8, Some(4)),
                _ => (34, 2, None),
            };
            for (s, o) in src.chunks_exact(src_block).zip(dst.chunks_exact_mut(sb)).take(blocks) {
                let d = f16_bits(s, 0);
                let c = match ty {
                    GgmlType::Q4_1 | GgmlType::Q5_1 => f16_bits(s, 2),
                    GgmlType::Q4_0 => scaled_f16(d, -8.0),
                    GgmlType::Q5_0 => scaled_f16(d, -16.0),
                    _ => scaled_f16(d, -128.0),
                };
                ok &= half::f16::from_bits(c).is_finite();
                o[2 * r..2 * r + 2].copy_from_slice(&d.to_le_bytes());
                o[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&c.to_le_bytes());
                // Q4_x/Q5_x nibbles are already value l low, value 16 + l high: lane order.
                let q = &s[q_off..];
                for k in 0..q.len() / 4 {
                    let at = SCALE_BYTES + 64 * k + 4 * r;
                    o[at..at + 4].copy_from_slice(&q[4 * k..4 * k + 4]);
                }
                if let Some(h) = high {
                    let qh = u32::from_le_bytes([s[h], s[h + 1], s[h + 2], s[h + 3]]);
                    let at = SCALE_BYTES + 256 + 4 * r;
                    o[at..at + 4].copy_from_slice(&lane_bits(qh).to_le_bytes());
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
            let (_, src_super) = ty.block_layout().unwrap_or((256, 0));
            for (s, sup) in src
                .chunks_exact(src_super)
                .zip(dst.chunks_exact_mut(sb))
                .take(blocks / 8)
            {
                let put16 = |sup: &mut [u8], at: usize, v: u16| {
                    sup[at + 2 * r..at + 2 * r + 2].copy_from_slice(&v.to_le_bytes())
                };
                if ty == GgmlType::Q6_K {
                    put16(sup, 0, f16_bits(s, 208));
                } else {
                    put16(sup, 0, f16_bits(s, 0));
                    put16(sup, 32, f16_bits(s, 2) ^ 0x8000); // −dmin: the sign bit
                }
                for j in 0..8 {
                    let q = &mut sup[hb + j * qb..hb + (j + 1) * qb];
                    match ty {
                        GgmlType::Q6_K => {
                            let (n, i) = (j / 4, j % 4);
                            let ql = &s[64 * n + 32 * (i % 2)..][..32];
                            put_nibbles(q, r, ql, 4 * (i / 2));
                            let qh = &s[128 + 32 * n..][..32];
                            put_plane(q, 256, r, high_plane(qh, 2 * i));
                            put_plane(q, 256 + 64, r, high_plane(qh, 2 * i + 1));
                        }
                        _ => {
                            let base = if ty == GgmlType::Q5_K { 48 } else { 16 };
                            put_nibbles(q, r, &s[base + 32 * (j / 2)..][..32], 4 * (j % 2));
                            if ty == GgmlType::Q5_K {
                                put_plane(q, 256, r, high_plane(&s[16..48], j));
                            }
                        }
                    }
                }
                if ty == GgmlType::Q6_K {
                    let sc = &s[192..208];
                    for j in 0..8 {
                        let (n, i) = (j / 4, j % 4);
                        sup[64 + 32 * j + r] = sc[8 * n + 2 * i];
                        sup[64 + 32 * j + 16 + r] = sc[8 * n + 2 * i + 1];
                    }
                } else {
                    for j in 0..8 {
                        let (sc, m) = blocks::scale_min_k4(j, &s[4..16]);
                        sup[64 + 16 * j + r] = sc;
                        sup[192 + 16 * j + r] = m;
                    }
                }
            }
        }
        _ => return pack_row_generic(ty, kind, src, r, blocks, dst),
    }
    ok
}

/// Eight little-endian bytes of `b` from `at`.
#[inline(always)]
fn word(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default())
}

/// The 32 values held as nibbles (at bit `shift`) of the 32 bytes `src`, packed for lane
/// `r` of the block's quants `q`: byte `m` of the lane order holds value `m` low and value
/// `16 + m` high, and bytes `4k..4k+4` go to chunk `k`.
#[inline(always)]
fn put_nibbles(q: &mut [u8], r: usize, src: &[u8], shift: usize) {
    const LOW: u64 = 0x0F0F_0F0F_0F0F_0F0F;
    for half in 0..2 {
        let (a, b) = (
            word(src, 8 * half) >> shift & LOW,
            word(src, 16 + 8 * half) >> shift & LOW,
        );
        let packed = (a | b << 4).to_le_bytes();
        for k in 0..2 {
            let at = 64 * (2 * half + k) + 4 * r;
            q[at..at + 4].copy_from_slice(&packed[4 * k..4 * k + 4]);
        }
    }
}

/// Bit `bit` of each of the 32 bytes `qh`, as the lane-order word of one high-bit plane
/// ([`lane_bits`] of the 32 bits in value order).
#[inline(always)]
fn high_plane(qh: &[u8], bit: usize) -> u32 {
    // Bit `bit` of 8 bytes gathered into one byte by a multiply (each byte's bit lands
    // alone in the top byte), four times.
    const ONES: u64 = 0x0101_0101_0101_0101;
    const GATHER: u64 = 0x0102_0408_1020_4080;
    let mut values = 0u32;
    for w in 0..4 {
        let bits = (word(qh, 8 * w) >> bit) & ONES;
        // Byte i's bit lands at bit 56 + i of the product, and nothing else reaches there.
        let gathered = (bits.wrapping_mul(GATHER) >> 56) as u32;
        values |= gathered << (8 * w);
    }
    lane_bits(values)
}

/// 32 bits in value order (bit `l` for value `l`) → the packed plane's order: byte `i`,
/// bit `k` for value `4k + i` and bit `4 + k` for value `16 + 4k + i` (bit `l = 16h + 4k +
/// i` moves to `8i + 4h + k`).
#[inline(always)]
fn lane_bits(v: u32) -> u32 {
    let mut out = 0u32;
    for l in 0..32 {
        let (h, k, i) = (l >> 4, (l >> 2) & 3, l & 3);
        out |= ((v >> l) & 1) << (8 * i + 4 * h + k);
    }
    out
}

/// Writes lane `r` of a 64-byte high-bit plane at `at` of a block's quants.
#[inline(always)]
fn put_plane(q: &mut [u8], at: usize, r: usize, h: u32) {
    q[at + 4 * r..at + 4 * r + 4].copy_from_slice(&h.to_le_bytes());
}

/// [`pack_row`] by way of the canonical block ([`blocks::quants`], [`blocks::raw_scale`]):
/// the layout's definition, for every type, which the fast path must equal.
fn pack_row_generic(ty: GgmlType, kind: PackKind, src: &[u8], r: usize, blocks: usize, dst: &mut [u8]) -> bool {
    let per = kind.blocks_per_super();
    let (sb, hb, qb) = (kind.super_bytes(), kind.header_bytes(), kind.quant_bytes());
    let mut ok = true;
    if ty == GgmlType::Q8_0 {
        for b in 0..blocks {
            let s = &src[b * 34..(b + 1) * 34];
            let o = &mut dst[b * sb..(b + 1) * sb];
            let d = f16_bits(s, 0);
            let c = scaled_f16(d, -128.0);
            ok &= half::f16::from_bits(c).is_finite();
            o[2 * r..2 * r + 2].copy_from_slice(&d.to_le_bytes());
            o[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&c.to_le_bytes());
            for k in 0..8 {
                let at = SCALE_BYTES + 64 * k + 4 * r;
                o[at..at + 4].copy_from_slice(&s[2 + 4 * k..2 + 4 * k + 4]);
            }
        }
        return ok;
    }
    for b in 0..blocks {
        let (s, j) = (b / per, b % per);
        let sup = &mut dst[s * sb..(s + 1) * sb];
        let put16 =
            |sup: &mut [u8], at: usize, v: u16| sup[at + 2 * r..at + 2 * r + 2].copy_from_slice(&v.to_le_bytes());
        match blocks::raw_scale(ty, src, b) {
            RawScale::Direct { d, m } => {
                // Q4_1/Q5_1 store `m`; Q4_0 and Q5_0 are centred at 8 and 16.
                let zero = if ty == GgmlType::Q4_0 { -8.0 } else { -16.0 };
                let c = m.unwrap_or_else(|| scaled_f16(d, zero));
                ok &= half::f16::from_bits(c).is_finite();
                put16(sup, 0, d);
                put16(sup, 32, c);
            }
            RawScale::K { d, dmin, sc, m } => {
                if j == 0 {
                    put16(sup, 0, d);
                    put16(sup, 32, dmin ^ 0x8000); // −dmin: the sign bit
                }
                sup[64 + 16 * j + r] = sc;
                sup[192 + 16 * j + r] = m;
            }
            RawScale::K6 { d, sa, sb } => {
                if j == 0 {
                    put16(sup, 0, d);
                }
                sup[64 + 32 * j + r] = sa as u8;
                sup[64 + 32 * j + 16 + r] = sb as u8;
            }
        }
        let v = blocks::quants(ty, src, b);
        let q = &mut sup[hb + j * qb..hb + (j + 1) * qb];
        for k in 0..4 {
            for i in 0..4 {
                q[64 * k + 4 * r + i] = (v[4 * k + i] & 0x0F) | (v[16 + 4 * k + i] << 4);
            }
        }
        for plane in 0..kind.high_planes() {
            let mut h = 0u32;
            for k in 0..4 {
                for i in 0..4 {
                    h |= (((v[4 * k + i] >> (4 + plane)) & 1) as u32) << (8 * i + k);
                    h |= (((v[16 + 4 * k + i] >> (4 + plane)) & 1) as u32) << (8 * i + 4 + k);
                }
            }
            let at = 256 + 64 * plane + 4 * r;
            q[at..at + 4].copy_from_slice(&h.to_le_bytes());
        }
    }
    ok
}

/// A row of floats as GGUF Q8_0 blocks, computed as ggml's `quantize_row_q8_0_ref`:
/// `d = amax / 127` (stored as f16), `q = round(x / d)` half away from zero.
pub fn quantize_row_q8_0(x: &[f32], out: &mut Vec<u8>) {
    out.clear();
    for xb in x.chunks_exact(QK) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_bits().to_le_bytes());
        out.extend(xb.iter().map(|v| round_away(v * id) as i8 as u8));
    }
}

/// `roundf(t)` (half away from zero) for |t| ≤ 2²³, without a libm call: the integer
/// part by conversion, then the fraction (exact in f32) decides.
#[inline(always)]
fn round_away(t: f32) -> f32 {
    let i = t as i32 as f32;
    let frac = t - i;
    if frac >= 0.5 {
        i + 1.0
    } else if frac <= -0.5 {
        i - 1.0
    } else {
        i
    }
}

/// `d · k` in f16 (exact, `k` being a power of two, unless it overflows: checked by the
/// caller).
fn scaled_f16(d: u16, k: f32) -> u16 {
    half::f16::from_f32(half::f16::from_bits(d).to_f32() * k).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_roundf() {
        for t in [
            0.5f32,
            -0.5,
            1.5,
            -2.5,
            0.49999997,
            -0.49999997,
            126.5,
            -127.0,
            0.0,
            -0.0,
            3.3,
            -3.7,
        ] {
            assert_eq!(round_away(t), t.round(), "{t}");
        }
        let mut x = 0x1234_5678u32;
        for _ in 0..100_000 {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let t = (x as f32 / u32::MAX as f32 - 0.5) * 300.0;
            assert_eq!(round_away(t), t.round(), "{t}");
        }
    }

    /// The word-at-a-time packer writes exactly the bytes the definition does, for every
    /// type, in every lane, on random bytes (scales included: nothing is interpreted but
    /// the fields' positions).
    #[test]
    fn the_fast_packer_equals_the_definition() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        };
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ] {
            let kind = PackKind::of(ty).unwrap();
            let cols = 512;
            let (per, bytes) = ty.block_layout().unwrap();
            let blocks = cols / QK;
            let row_bytes = cols / per * bytes;
            let group_bytes = blocks / kind.blocks_per_super() * kind.super_bytes();
            let (mut fast, mut slow) = (vec![0u8; group_bytes], vec![0u8; group_bytes]);
            for r in 0..GROUP_ROWS {
                let src: Vec<u8> = (0..row_bytes).map(|_| next()).collect();
                let a = pack_row(ty, kind, &src, r, blocks, &mut fast);
                let b = pack_row_generic(ty, kind, &src, r, blocks, &mut slow);
                assert_eq!(a, b, "{ty}: overflow flag");
            }
            assert!(fast == slow, "{ty}: packed bytes differ");
        }
    }
}
