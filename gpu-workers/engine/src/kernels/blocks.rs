//! GGUF's quantized block formats, read one 32-value block at a time into one canonical
//! form — unsigned quants and how they scale — that the dequantizer, the scalar dot
//! product over GGUF bytes and the repacker ([`super::packed`]) share.
//!
//! | type | block | a 32-value block's quants | scale |
//! |---|---|---|---|
//! | Q4_0 | 32 values, 18 B | 4 bits | `d·v − 8d` |
//! | Q4_1 | 32, 20 B | 4 bits | `d·v + m` |
//! | Q5_0 | 32, 22 B | 4 + 1 high bit | `d·v − 16d` |
//! | Q5_1 | 32, 24 B | 4 + 1 | `d·v + m` |
//! | Q8_0 | 32, 34 B | signed 8 bits | `d·v` |
//! | Q4_K | 256, 144 B | 4 bits | `(d·sc)·v − dmin·m`, 6-bit `sc`, `m` per 32 |
//! | Q5_K | 256, 176 B | 4 + 1 | as Q4_K |
//! | Q6_K | 256, 210 B | 4 + 2 | `(d·sc)·(v − 32)`, signed 8-bit `sc` per 16 |
//!
//! The arithmetic is ggml's own (`dequantize_row_*` in `ggml-quants.c`), operation for
//! operation, so dequantized values are bit-exact with llama.cpp and the `gguf` package.

use super::{BlockQ8, QK};
use crate::formats::gguf::GgmlType;

/// The raw scale fields of one 32-value block, as the file stores them (f16 as bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawScale {
    /// Q4_0 / Q5_0 (`m` is `None`: the offset is −8d / −16d), Q4_1 / Q5_1, Q8_0.
    Direct { d: u16, m: Option<u16> },
    /// Q4_K / Q5_K: the super-block's `d` and `dmin`, this block's 6-bit scale and min.
    K { d: u16, dmin: u16, sc: u8, m: u8 },
    /// Q6_K: the super-block's `d` and the two 16-value sub-blocks' signed scales.
    K6 { d: u16, sa: i8, sb: i8 },
}

/// How a block's unsigned quants `v` become values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scale {
    /// `d·v + c`.
    Affine { d: f32, c: f32 },
    /// Q6_K: `a·(v − 32)` for values 0..16, `b·(v − 32)` for 16..32.
    Split { a: f32, b: f32 },
    /// Q8_0: `d·v`, `v` signed (the quants are the bytes' bits).
    Signed { d: f32 },
}

/// One 32-value block in the canonical form.
#[derive(Debug, Clone, Copy)]
pub struct Block {
    pub v: [u8; QK],
    pub scale: Scale,
}

#[inline]
fn f16(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

#[inline]
fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// Q4_K / Q5_K: the 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes
/// (ggml's `get_scale_min_k4`).
#[inline]
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Where block `b` of a row lies: (the bytes of its GGUF block or super-block, the index of
/// the 32-value block inside it).
#[inline]
fn locate(ty: GgmlType, row: &[u8], b: usize) -> (&[u8], usize) {
    let (per, bytes) = ty.block_layout().unwrap_or((QK, 0));
    let sub = per / QK;
    let at = b / sub * bytes;
    (&row[at..at + bytes], b % sub)
}

/// Block `b`'s raw scale fields.
pub fn raw_scale(ty: GgmlType, row: &[u8], b: usize) -> RawScale {
    let (s, j) = locate(ty, row, b);
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => RawScale::Direct {
            d: u16_at(s, 0),
            m: None,
        },
        GgmlType::Q4_1 | GgmlType::Q5_1 => RawScale::Direct {
            d: u16_at(s, 0),
            m: Some(u16_at(s, 2)),
        },
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (sc, m) = scale_min_k4(j, &s[4..16]);
            RawScale::K {
                d: u16_at(s, 0),
                dmin: u16_at(s, 2),
                sc,
                m,
            }
        }
        GgmlType::Q6_K => {
            let (n, i) = (j / 4, j % 4);
            let sc = &s[192..208];
            RawScale::K6 {
                d: u16_at(s, 208),
                sa: sc[8 * n + 2 * i] as i8,
                sb: sc[8 * n + 2 * i + 1] as i8,
            }
        }
        _ => RawScale::Direct { d: 0, m: None },
    }
}

/// The float form of a block's scale fields (ggml's products, in f32).
pub fn scale_of(ty: GgmlType, raw: RawScale) -> Scale {
    match raw {
        RawScale::Direct { d, m } => {
            let d = f16(d);
            match (ty, m) {
                (GgmlType::Q8_0, _) => Scale::Signed { d },
                (_, Some(m)) => Scale::Affine { d, c: f16(m) },
                (GgmlType::Q5_0, None) => Scale::Affine { d, c: -16.0 * d },
                _ => Scale::Affine { d, c: -8.0 * d },
            }
        }
        RawScale::K { d, dmin, sc, m } => Scale::Affine {
            d: f16(d) * sc as f32,
            c: -(f16(dmin) * m as f32),
        },
        RawScale::K6 { d, sa, sb } => {
            let d = f16(d);
            Scale::Split {
                a: d * sa as f32,
                b: d * sb as f32,
            }
        }
    }
}

/// Block `b`'s unsigned quants (Q8_0: the signed bytes' bits).
pub fn quants(ty: GgmlType, row: &[u8], b: usize) -> [u8; QK] {
    let (s, j) = locate(ty, row, b);
    let mut v = [0u8; QK];
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let q = &s[s.len() - 16..];
            for l in 0..16 {
                v[l] = q[l] & 0x0F;
                v[l + 16] = q[l] >> 4;
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let o = if ty == GgmlType::Q5_0 { 2 } else { 4 };
            let qh = u32::from_le_bytes([s[o], s[o + 1], s[o + 2], s[o + 3]]);
            let q = &s[o + 4..o + 20];
            for l in 0..16 {
                v[l] = (q[l] & 0x0F) | ((((qh >> l) & 1) as u8) << 4);
                v[l + 16] = (q[l] >> 4) | ((((qh >> (l + 16)) & 1) as u8) << 4);
            }
        }
        GgmlType::Q8_0 => v.copy_from_slice(&s[2..34]),
        GgmlType::Q4_K => {
            let q = &s[16 + 32 * (j / 2)..16 + 32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            for l in 0..QK {
                v[l] = (q[l] >> shift) & 0x0F;
            }
        }
        GgmlType::Q5_K => {
            let qh = &s[16..48];
            let q = &s[48 + 32 * (j / 2)..48 + 32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            for l in 0..QK {
                v[l] = ((q[l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4);
            }
        }
        GgmlType::Q6_K => {
            let (n, i) = (j / 4, j % 4);
            let ql = &s[64 * n + 32 * (i % 2)..64 * n + 32 * (i % 2) + 32];
            let qh = &s[128 + 32 * n..128 + 32 * n + 32];
            let shift = 4 * (i / 2);
            for l in 0..QK {
                v[l] = ((ql[l] >> shift) & 0x0F) | (((qh[l] >> (2 * i)) & 3) << 4);
            }
        }
        _ => {}
    }
    v
}

/// Block `b` of a row in the canonical form.
pub fn read(ty: GgmlType, row: &[u8], b: usize) -> Block {
    Block {
        v: quants(ty, row, b),
        scale: scale_of(ty, raw_scale(ty, row, b)),
    }
}

/// A canonical block's 32 values, computed as ggml computes them.
pub fn dequantize(blk: &Block, out: &mut [f32]) {
    match blk.scale {
        Scale::Affine { d, c } => {
            for (o, &v) in out.iter_mut().zip(&blk.v) {
                *o = d * v as f32 + c;
            }
        }
        Scale::Split { a, b } => {
            for (l, (o, &v)) in out.iter_mut().zip(&blk.v).enumerate() {
                let s = if l < 16 { a } else { b };
                *o = s * (v as i32 - 32) as f32;
            }
        }
        Scale::Signed { d } => {
            for (o, &v) in out.iter_mut().zip(&blk.v) {
                *o = v as i8 as f32 * d;
            }
        }
    }
}

/// A canonical block against one block of 8-bit activations: the integer sums, then the
/// scales — the formula every SIMD kernel computes.
pub fn dot(blk: &Block, x: &BlockQ8) -> f32 {
    match blk.scale {
        Scale::Affine { d, c } => {
            let s: i32 = blk.v.iter().zip(&x.qs).map(|(&v, &q)| v as i32 * q as i32).sum();
            d * x.d * s as f32 + c * x.s
        }
        Scale::Split { a, b } => {
            let half = |r: std::ops::Range<usize>| -> i32 { r.map(|l| (blk.v[l] as i32 - 32) * x.qs[l] as i32).sum() };
            x.d * (a * half(0..16) as f32 + b * half(16..32) as f32)
        }
        Scale::Signed { d } => {
            let s: i32 = blk.v.iter().zip(&x.qs).map(|(&v, &q)| v as i8 as i32 * q as i32).sum();
            d * x.d * s as f32
        }
    }
}

/// Dequantizes a row of a block-quantized type (every type of the table above).
pub fn dequantize_row(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    for (b, o) in out.chunks_exact_mut(QK).enumerate() {
        let blk = read(ty, row, b);
        match (ty, raw_scale(ty, row, b)) {
            // ggml's `(v − 8)·d` and `(v − 16)·d`, equal to `d·v + c` but for the sign of
            // a zero.
            (GgmlType::Q4_0 | GgmlType::Q5_0, RawScale::Direct { d, .. }) => {
                let (d, off) = (f16(d), if ty == GgmlType::Q4_0 { 8 } else { 16 });
                for (o, &v) in o.iter_mut().zip(&blk.v) {
                    *o = (v as i32 - off) as f32 * d;
                }
            }
            _ => dequantize(&blk, o),
        }
    }
}
