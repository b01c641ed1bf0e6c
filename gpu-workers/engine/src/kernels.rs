//! CPU kernels: dequantization, activation quantization, dot products and the matrix
//! product over weight rows. They know nothing about models.
//!
//! Quantized weights (Q4_0, Q4_1, Q8_0) are multiplied against activations quantized to
//! 8 bits in blocks of 32 (as llama.cpp does), with integer dot products. The SIMD path
//! (AVX2 + FMA + F16C) is chosen at run time; the scalar path is the reference the tests
//! compare it with. Float weights (F32, F16, BF16) take a float path.

use std::sync::OnceLock;

use rayon::prelude::*;

use crate::gguf::GgmlType;

pub const QK: usize = 32;

/// A row-major weight matrix borrowed from the model file: `rows` rows of `cols` elements.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> WeightView<'a> {
    pub fn row_bytes(&self) -> usize {
        let (per, bytes) = self.ty.block_layout().unwrap_or((1, 0));
        self.cols / per * bytes
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let n = self.row_bytes();
        &self.data[r * n..(r + 1) * n]
    }

    fn is_quantized(&self) -> bool {
        matches!(self.ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantizes one row of `ty` into `out` (whose length is the row's element count).
pub fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f16_at(src, 2 * i);
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            }
        }
        GgmlType::Q4_0 => {
            for (blk, o) in src.chunks_exact(18).zip(out.chunks_exact_mut(QK)) {
                let d = f16_at(blk, 0);
                for j in 0..16 {
                    o[j] = ((blk[2 + j] & 0x0F) as f32 - 8.0) * d;
                    o[j + 16] = ((blk[2 + j] >> 4) as f32 - 8.0) * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (blk, o) in src.chunks_exact(20).zip(out.chunks_exact_mut(QK)) {
                let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
                for j in 0..16 {
                    o[j] = (blk[4 + j] & 0x0F) as f32 * d + m;
                    o[j + 16] = (blk[4 + j] >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (blk, o) in src.chunks_exact(34).zip(out.chunks_exact_mut(QK)) {
                let d = f16_at(blk, 0);
                for j in 0..QK {
                    o[j] = blk[2 + j] as i8 as f32 * d;
                }
            }
        }
        GgmlType::Other(_) => out.fill(0.0),
    }
}

/// One block of 32 activations quantized to 8 bits: scale, scale × sum of the quants (for
/// the Q4_0/Q4_1 offset terms) and the quants, interleaved so a dot product reads one
/// stream.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockQ8 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK],
}

/// Activations quantized to 8 bits in blocks of 32, row after row.
#[derive(Debug, Default)]
pub struct QuantizedActs {
    pub blocks_per_row: usize,
    pub blocks: Vec<BlockQ8>,
}

fn quantize_block_scalar(xb: &[f32], out: &mut BlockQ8) {
    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, v) in out.qs.iter_mut().zip(xb) {
        let qi = (v * id).round() as i32;
        *q = qi as i8;
        sum += qi;
    }
    out.d = d;
    out.s = d * sum as f32;
}

impl QuantizedActs {
    /// Quantizes rows of `cols` (a multiple of 32) floats.
    pub fn quantize(&mut self, x: &[f32], cols: usize) {
        self.blocks_per_row = cols / QK;
        self.blocks.resize(x.len() / QK, BlockQ8::default());
        let blocks = &mut self.blocks;
        let work = |xs: &[f32], bs: &mut [BlockQ8]| {
            #[cfg(target_arch = "x86_64")]
            if isa() == Isa::Avx2 {
                for (xb, b) in xs.chunks_exact(QK).zip(bs.iter_mut()) {
                    // SAFETY: features checked by `isa()`; `xb` has 32 floats.
                    unsafe { avx2::quantize_block(xb, b) };
                }
                return;
            }
            for (xb, b) in xs.chunks_exact(QK).zip(bs.iter_mut()) {
                quantize_block_scalar(xb, b);
            }
        };
        // Large inputs (prefill) are split across threads.
        if x.len() >= 64 * 1024 {
            let per = 256;
            x.par_chunks(per * QK)
                .zip(blocks.par_chunks_mut(per))
                .for_each(|(xs, bs)| work(xs, bs));
        } else {
            work(x, blocks);
        }
    }

    fn row(&self, r: usize) -> &[BlockQ8] {
        let nb = self.blocks_per_row;
        &self.blocks[r * nb..(r + 1) * nb]
    }
}

/// Scalar reference dot product of one quantized weight row with one activation row.
pub fn dot_q_scalar(ty: GgmlType, w: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in x.iter().enumerate() {
        let xq = &xb.qs;
        match ty {
            GgmlType::Q4_0 => {
                let blk = &w[b * 18..(b + 1) * 18];
                let mut s = 0i32;
                for j in 0..16 {
                    s += ((blk[2 + j] & 0x0F) as i32 - 8) * xq[j] as i32;
                    s += ((blk[2 + j] >> 4) as i32 - 8) * xq[j + 16] as i32;
                }
                acc += f16_at(blk, 0) * xb.d * s as f32;
            }
            GgmlType::Q4_1 => {
                let blk = &w[b * 20..(b + 1) * 20];
                let mut s = 0i32;
                for j in 0..16 {
                    s += (blk[4 + j] & 0x0F) as i32 * xq[j] as i32;
                    s += (blk[4 + j] >> 4) as i32 * xq[j + 16] as i32;
                }
                acc += f16_at(blk, 0) * xb.d * s as f32 + f16_at(blk, 2) * xb.s;
            }
            GgmlType::Q8_0 => {
                let blk = &w[b * 34..(b + 1) * 34];
                let s: i32 = (0..QK).map(|j| blk[2 + j] as i8 as i32 * xq[j] as i32).sum();
                acc += f16_at(blk, 0) * xb.d * s as f32;
            }
            _ => {}
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BlockQ8, GgmlType};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Two f16 values at `p` as f32 (one conversion for a block's d and m).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16x2(p: *const u8) -> (f32, f32) {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16x1(p: *const u8) -> f32 {
        let bits = std::ptr::read_unaligned(p as *const u16);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// # Safety
    /// AVX2/FMA/F16C available; `x` has 32 floats.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_block(x: &[f32], out: &mut BlockQ8) {
        let p = x.as_ptr();
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_andnot_ps(sign, v[0]);
        for vi in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vi));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        let amax = _mm_cvtss_f32(m4);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
        let i: [__m256i; 4] = [
            _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id)),
        ];
        let sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        let s4 = _mm_hadd_epi32(s4, s4);
        let s4 = _mm_hadd_epi32(s4, s4);
        let total = _mm_cvtsi128_si32(s4);
        // Pack i32 → i16 → i8; the packs interleave 128-bit lanes, so restore the order.
        let a = _mm256_packs_epi32(i[0], i[1]);
        let b = _mm256_packs_epi32(i[2], i[3]);
        let q = _mm256_packs_epi16(a, b);
        let q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(out.qs.as_mut_ptr() as *mut __m256i, q);
        out.d = d;
        out.s = d * total as f32;
    }

    /// One weight row against `N` activation rows: the weight block is unpacked once per
    /// block and each row keeps its own accumulators.
    ///
    /// # Safety
    /// AVX2/FMA/F16C available; `w` holds `xs[j].len()` blocks of `ty` for every j.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_rows<const N: usize>(ty: GgmlType, w: &[u8], xs: [&[BlockQ8]; N], out: &mut [f32]) {
        let nb = xs[0].len();
        let ones = _mm256_set1_epi16(1);
        let mask = _mm_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut extra = [0f32; N];
        let wp = w.as_ptr();
        match ty {
            GgmlType::Q4_1 => {
                for b in 0..nb {
                    let blk = wp.add(b * 20);
                    let (d, m) = f16x2(blk);
                    let qs = _mm_loadu_si128(blk.add(4) as *const __m128i);
                    let wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), _mm_and_si128(qs, mask));
                    for j in 0..N {
                        let xb = xs[j].get_unchecked(b);
                        let xv = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
                        acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(p), acc[j]);
                        extra[j] += m * xb.s;
                    }
                }
            }
            GgmlType::Q4_0 => {
                for b in 0..nb {
                    let blk = wp.add(b * 18);
                    let d = f16x1(blk);
                    let qs = _mm_loadu_si128(blk.add(2) as *const __m128i);
                    let wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), _mm_and_si128(qs, mask));
                    for j in 0..N {
                        let xb = xs[j].get_unchecked(b);
                        let xv = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
                        acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(p), acc[j]);
                        // Σ(q−8)·x = Σq·x − 8·Σx
                        extra[j] -= 8.0 * d * xb.s;
                    }
                }
            }
            GgmlType::Q8_0 => {
                for b in 0..nb {
                    let blk = wp.add(b * 34);
                    let d = f16x1(blk);
                    let wv = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                    // maddubs needs an unsigned operand: |w| · (x with w's sign).
                    let aw = _mm256_sign_epi8(wv, wv);
                    for j in 0..N {
                        let xb = xs[j].get_unchecked(b);
                        let xv = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones);
                        acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(p), acc[j]);
                    }
                }
            }
            _ => {}
        }
        for j in 0..N {
            *out.get_unchecked_mut(j) = hsum(acc[j]) + extra[j];
        }
    }

    /// # Safety
    /// AVX2/FMA available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                acc1,
            );
            i += 16;
        }
        let mut s = hsum(_mm256_add_ps(acc0, acc1));
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    /// `out += w · v` (attention's value accumulation).
    ///
    /// # Safety
    /// AVX2/FMA available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy(w: f32, v: &[f32], out: &mut [f32]) {
        let n = v.len().min(out.len());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            let o = out.as_mut_ptr().add(i);
            _mm256_storeu_ps(
                o,
                _mm256_fmadd_ps(wv, _mm256_loadu_ps(v.as_ptr().add(i)), _mm256_loadu_ps(o)),
            );
            i += 8;
        }
        while i < n {
            out[i] += w * v[i];
            i += 1;
        }
    }
}

/// Which instruction set the kernels use on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx2,
    Scalar,
}

pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::env::var_os("HEARTH_FORCE_SCALAR").is_none()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    })
}

/// One quantized weight row against up to 4 activation rows; `out[j]` gets row j's dot.
#[inline]
fn dot_q_rows(ty: GgmlType, w: &[u8], xs: &[&[BlockQ8]], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 {
        // SAFETY: `isa()` verified the CPU features; every activation row has as many
        // blocks as the weight row (both come from the same matrix shape).
        unsafe {
            match xs.len() {
                4 => avx2::dot_rows::<4>(ty, w, [xs[0], xs[1], xs[2], xs[3]], out),
                3 => avx2::dot_rows::<3>(ty, w, [xs[0], xs[1], xs[2]], out),
                2 => avx2::dot_rows::<2>(ty, w, [xs[0], xs[1]], out),
                _ => avx2::dot_rows::<1>(ty, w, [xs[0]], out),
            }
        }
        return;
    }
    for (o, x) in out.iter_mut().zip(xs) {
        *o = dot_q_scalar(ty, w, x);
    }
}

/// Dot product of a quantized weight row with a quantized activation row.
#[inline]
pub fn dot_q(ty: GgmlType, w: &[u8], x: &[BlockQ8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 {
        let mut out = [0f32];
        // SAFETY: features checked by `isa()`; the weight row has as many blocks as `x`.
        unsafe { avx2::dot_rows::<1>(ty, w, [x], &mut out) };
        return out[0];
    }
    dot_q_scalar(ty, w, x)
}

/// Float dot product.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 {
        // SAFETY: features verified by `isa()`; the kernel reads min(len) elements.
        return unsafe { avx2::dot_f32(a, b) };
    }
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `out += w · v`.
#[inline]
pub fn axpy(w: f32, v: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 {
        // SAFETY: features verified by `isa()`; the kernel touches min(len) elements.
        unsafe { avx2::axpy(w, v, out) };
        return;
    }
    for (o, x) in out.iter_mut().zip(v) {
        *o += w * x;
    }
}

/// Reusable buffers for [`matmul`], and its precision choice.
#[derive(Debug, Default)]
pub struct MatmulScratch {
    acts: QuantizedActs,
    transposed: Vec<f32>,
    /// Multiply quantized weights with float activations (dequantizing each row) instead
    /// of 8-bit activations: several times slower, but equal to a float reference.
    pub precise: bool,
}

/// Activation rows per tile: the tile's quantized activations (~40 B per 32 values) stay
/// in L1 while a chunk of weight rows passes over them.
const TOKEN_TILE: usize = 16;

/// `out[t][r] = Σ_c w[r][c] · x[t][c]` for `t` in `0..x.len()/cols`: every weight row is
/// read once for all tokens of the step. Parallel over weight rows (rayon's current pool).
pub fn matmul(w: &WeightView<'_>, x: &[f32], out: &mut [f32], scratch: &mut MatmulScratch) {
    let cols = w.cols;
    let t = x.len() / cols;
    debug_assert_eq!(out.len(), t * w.rows);
    let chunk = (w.rows / (rayon::current_num_threads() * 8)).clamp(8, 256);
    if w.is_quantized() && !scratch.precise {
        scratch.acts.quantize(x, cols);
        let acts = &scratch.acts;
        let rows_of = |t0: usize, n: usize| -> [&[BlockQ8]; 4] {
            let mut r = [acts.row(t0); 4];
            for (j, slot) in r.iter_mut().enumerate().take(n) {
                *slot = acts.row(t0 + j);
            }
            r
        };
        let target: &mut [f32] = if t == 1 {
            out
        } else {
            scratch.transposed.resize(w.rows * t, 0.0);
            &mut scratch.transposed
        };
        if t == 1 {
            // Decode: few, large tasks; rows stream through sequentially.
            let chunk = (w.rows / (rayon::current_num_threads() * 4)).clamp(16, 4096) & !3;
            let x0 = acts.row(0);
            target.par_chunks_mut(chunk).enumerate().for_each(|(ci, o)| {
                for (i, v) in o.iter_mut().enumerate() {
                    *v = dot_q(w.ty, w.row(ci * chunk + i), x0);
                }
            });
            return;
        }
        // Layout: weight-row major (rows × t).
        target.par_chunks_mut(chunk * t).enumerate().for_each(|(ci, o)| {
            let rows = o.len() / t;
            for t0 in (0..t).step_by(TOKEN_TILE) {
                let t1 = (t0 + TOKEN_TILE).min(t);
                for i in 0..rows {
                    let wr = w.row(ci * chunk + i);
                    let mut tt = t0;
                    while tt < t1 {
                        let n = (t1 - tt).min(4);
                        let xs = rows_of(tt, n);
                        dot_q_rows(w.ty, wr, &xs[..n], &mut o[i * t + tt..i * t + tt + n]);
                        tt += n;
                    }
                }
            }
        });
        if t == 1 {
            return;
        }
    } else {
        scratch.transposed.resize(w.rows * t, 0.0);
        scratch.transposed.par_chunks_mut(chunk * t).enumerate().for_each_init(
            || vec![0f32; cols],
            |row, (ci, o)| {
                for (i, orow) in o.chunks_exact_mut(t).enumerate() {
                    dequantize_row(w.ty, w.row(ci * chunk + i), row);
                    for (ti, v) in orow.iter_mut().enumerate() {
                        *v = dot_f32(row, &x[ti * cols..(ti + 1) * cols]);
                    }
                }
            },
        );
    }
    for r in 0..w.rows {
        for ti in 0..t {
            out[ti * w.rows + r] = scratch.transposed[r * t + ti];
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A deterministic pseudo-random generator for test data.
    pub struct Lcg(pub u64);
    impl Lcg {
        pub fn next_f32(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        pub fn byte(&mut self) -> u8 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 56) as u8
        }
    }

    fn f16_bytes(v: f32) -> [u8; 2] {
        half::f16::from_f32(v).to_bits().to_le_bytes()
    }

    /// Random quantized weights of `ty` (valid blocks with small scales).
    pub fn random_weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Lcg) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..rows * cols / QK {
            match ty {
                GgmlType::Q4_0 => {
                    out.extend(f16_bytes(rng.next_f32() * 0.1));
                    out.extend((0..16).map(|_| rng.byte()));
                }
                GgmlType::Q4_1 => {
                    out.extend(f16_bytes(rng.next_f32().abs() * 0.1));
                    out.extend(f16_bytes(rng.next_f32() * 0.5));
                    out.extend((0..16).map(|_| rng.byte()));
                }
                GgmlType::Q8_0 => {
                    out.extend(f16_bytes(rng.next_f32() * 0.01));
                    out.extend((0..32).map(|_| (rng.byte() as i8).max(-127) as u8));
                }
                GgmlType::F32 => (0..QK).for_each(|_| out.extend(rng.next_f32().to_le_bytes())),
                GgmlType::F16 => (0..QK).for_each(|_| out.extend(f16_bytes(rng.next_f32()))),
                GgmlType::BF16 => {
                    (0..QK).for_each(|_| out.extend(((rng.next_f32().to_bits() >> 16) as u16).to_le_bytes()))
                }
                GgmlType::Other(_) => unreachable!(),
            }
        }
        out
    }

    /// The float reference: dequantize, multiply in f64.
    fn reference(w: &WeightView<'_>, x: &[f32]) -> Vec<f32> {
        let t = x.len() / w.cols;
        let mut row = vec![0f32; w.cols];
        let mut out = vec![0f32; t * w.rows];
        for r in 0..w.rows {
            dequantize_row(w.ty, w.row(r), &mut row);
            for ti in 0..t {
                let s: f64 = row
                    .iter()
                    .zip(&x[ti * w.cols..])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                out[ti * w.rows + r] = s as f32;
            }
        }
        out
    }

    #[test]
    fn simd_dot_matches_scalar_reference() {
        let mut rng = Lcg(7);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let cols = 576;
            let w = random_weights(ty, 1, cols, &mut rng);
            let x: Vec<f32> = (0..4 * cols).map(|_| rng.next_f32() * 3.0).collect();
            let mut a = QuantizedActs::default();
            a.quantize(&x, cols);
            // One weight row against 1..4 activation rows at once.
            for n in 1..=4 {
                let xs: Vec<&[BlockQ8]> = (0..n).map(|j| a.row(j)).collect();
                let mut got = vec![0f32; n];
                dot_q_rows(ty, &w, &xs, &mut got);
                for (j, g) in got.iter().enumerate() {
                    let s = dot_q_scalar(ty, &w, a.row(j));
                    assert!(
                        (s - g).abs() <= 1e-4 * s.abs().max(1.0),
                        "{ty:?} n={n} j={j}: scalar {s} simd {g}"
                    );
                }
            }
        }
    }

    #[test]
    fn single_row_dot_matches_scalar_reference() {
        let mut rng = Lcg(9);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            for cols in [32usize, 96, 576] {
                let w = random_weights(ty, 1, cols, &mut rng);
                let x: Vec<f32> = (0..cols).map(|_| rng.next_f32()).collect();
                let mut a = QuantizedActs::default();
                a.quantize(&x, cols);
                let (s, g) = (dot_q_scalar(ty, &w, a.row(0)), dot_q(ty, &w, a.row(0)));
                assert!(
                    (s - g).abs() <= 1e-4 * s.abs().max(1.0),
                    "{ty:?} cols {cols}: {s} vs {g}"
                );
            }
        }
    }

    #[test]
    fn simd_quantize_matches_scalar() {
        let mut rng = Lcg(5);
        let x: Vec<f32> = (0..32 * 64).map(|i| rng.next_f32() * (1 + i % 7) as f32).collect();
        let mut a = QuantizedActs::default();
        a.quantize(&x, 64);
        for (xb, got) in x.chunks_exact(QK).zip(&a.blocks) {
            let mut want = BlockQ8::default();
            quantize_block_scalar(xb, &mut want);
            assert!((got.d - want.d).abs() <= 1e-7);
            // Rounding of exact halves may differ by one step (ties-to-even vs away-from-zero).
            for (g, w) in got.qs.iter().zip(&want.qs) {
                assert!((*g as i32 - *w as i32).abs() <= 1);
            }
            let sum: i32 = got.qs.iter().map(|&q| q as i32).sum();
            assert!((got.s - got.d * sum as f32).abs() <= 1e-5 * got.s.abs().max(1.0));
        }
        // Zero blocks quantize to zero without NaNs.
        let mut z = QuantizedActs::default();
        z.quantize(&[0.0; 32], 32);
        assert_eq!((z.blocks[0].d, z.blocks[0].s), (0.0, 0.0));
    }

    #[test]
    fn matmul_matches_float_reference_for_every_type() {
        let mut rng = Lcg(42);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
        ] {
            for t in [1usize, 3, 21] {
                let (rows, cols) = (67, 128);
                let data = random_weights(ty, rows, cols, &mut rng);
                let w = WeightView {
                    ty,
                    rows,
                    cols,
                    data: &data,
                };
                let x: Vec<f32> = (0..t * cols).map(|_| rng.next_f32()).collect();
                let mut out = vec![0f32; t * rows];
                matmul(&w, &x, &mut out, &mut MatmulScratch::default());
                let want = reference(&w, &x);
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (g, r) in out.iter().zip(&want) {
                    // 8-bit activations: errors of about 1% of the output scale are expected.
                    assert!((g - r).abs() <= 0.02 * scale + 1e-4, "{ty:?} t={t}: {g} vs {r}");
                }
            }
        }
    }

    #[test]
    fn quantize_round_trips_within_half_a_step() {
        let mut rng = Lcg(3);
        let x: Vec<f32> = (0..64).map(|_| rng.next_f32() * 10.0).collect();
        let mut a = QuantizedActs::default();
        a.quantize(&x, 64);
        for (i, v) in x.iter().enumerate() {
            let b = &a.blocks[i / QK];
            assert!((b.qs[i % QK] as f32 * b.d - v).abs() <= b.d * 0.5 + 1e-6);
        }
    }
}
