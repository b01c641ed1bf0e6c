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

/// Activations quantized to 8 bits in blocks of 32: per block a scale, the sum of its
/// quants (for the Q4_0/Q4_1 offset terms) and 32 quants.
#[derive(Debug, Default)]
pub struct QuantizedActs {
    pub blocks_per_row: usize,
    pub d: Vec<f32>,
    pub sum: Vec<i32>,
    pub qs: Vec<i8>,
}

impl QuantizedActs {
    /// Quantizes `rows` rows of `cols` (a multiple of 32) floats.
    pub fn quantize(&mut self, x: &[f32], cols: usize) {
        let nb = cols / QK;
        let n_blocks = x.len() / QK;
        self.blocks_per_row = nb;
        self.d.resize(n_blocks, 0.0);
        self.sum.resize(n_blocks, 0);
        self.qs.resize(n_blocks * QK, 0);
        for (b, xb) in x.chunks_exact(QK).enumerate() {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut s = 0i32;
            for (q, v) in self.qs[b * QK..(b + 1) * QK].iter_mut().zip(xb) {
                let qi = (v * id).round() as i32;
                *q = qi as i8;
                s += qi;
            }
            self.d[b] = d;
            self.sum[b] = s;
        }
    }

    fn row(&self, r: usize) -> ActRow<'_> {
        let nb = self.blocks_per_row;
        ActRow {
            d: &self.d[r * nb..(r + 1) * nb],
            sum: &self.sum[r * nb..(r + 1) * nb],
            qs: &self.qs[r * nb * QK..(r + 1) * nb * QK],
        }
    }
}

/// One quantized activation row.
#[derive(Clone, Copy)]
pub struct ActRow<'a> {
    pub d: &'a [f32],
    pub sum: &'a [i32],
    pub qs: &'a [i8],
}

/// Scalar reference dot product of one quantized weight row with one activation row.
pub fn dot_q_scalar(ty: GgmlType, w: &[u8], x: ActRow<'_>) -> f32 {
    let mut acc = 0f32;
    for b in 0..x.d.len() {
        let xq = &x.qs[b * QK..(b + 1) * QK];
        match ty {
            GgmlType::Q4_0 => {
                let blk = &w[b * 18..(b + 1) * 18];
                let mut s = 0i32;
                for j in 0..16 {
                    s += ((blk[2 + j] & 0x0F) as i32 - 8) * xq[j] as i32;
                    s += ((blk[2 + j] >> 4) as i32 - 8) * xq[j + 16] as i32;
                }
                acc += f16_at(blk, 0) * x.d[b] * s as f32;
            }
            GgmlType::Q4_1 => {
                let blk = &w[b * 20..(b + 1) * 20];
                let mut s = 0i32;
                for j in 0..16 {
                    s += (blk[4 + j] & 0x0F) as i32 * xq[j] as i32;
                    s += (blk[4 + j] >> 4) as i32 * xq[j + 16] as i32;
                }
                acc += f16_at(blk, 0) * x.d[b] * s as f32 + f16_at(blk, 2) * x.d[b] * x.sum[b] as f32;
            }
            GgmlType::Q8_0 => {
                let blk = &w[b * 34..(b + 1) * 34];
                let s: i32 = (0..QK).map(|j| blk[2 + j] as i8 as i32 * xq[j] as i32).sum();
                acc += f16_at(blk, 0) * x.d[b] * s as f32;
            }
            _ => {}
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{ActRow, GgmlType, QK};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16(p: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `w` must hold `x.d.len()` blocks of `ty`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q(ty: GgmlType, w: &[u8], x: ActRow<'_>) -> f32 {
        let nb = x.d.len();
        let ones = _mm256_set1_epi16(1);
        let mask = _mm_set1_epi8(0x0F);
        let mut acc = _mm256_setzero_ps();
        let mut extra = 0f32;
        let xp = x.qs.as_ptr();
        match ty {
            GgmlType::Q4_1 => {
                debug_assert!(w.len() >= nb * 20);
                for b in 0..nb {
                    let blk = w.as_ptr().add(b * 20);
                    let qs = _mm_loadu_si128(blk.add(4) as *const __m128i);
                    let lo = _mm_and_si128(qs, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                    let wv = _mm256_set_m128i(hi, lo);
                    let xv = _mm256_loadu_si256(xp.add(b * QK) as *const __m256i);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
                    let xd = *x.d.get_unchecked(b);
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * xd), _mm256_cvtepi32_ps(p), acc);
                    extra += f16(blk.add(2)) * xd * *x.sum.get_unchecked(b) as f32;
                }
            }
            GgmlType::Q4_0 => {
                debug_assert!(w.len() >= nb * 18);
                for b in 0..nb {
                    let blk = w.as_ptr().add(b * 18);
                    let qs = _mm_loadu_si128(blk.add(2) as *const __m128i);
                    let lo = _mm_and_si128(qs, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                    let wv = _mm256_set_m128i(hi, lo);
                    let xv = _mm256_loadu_si256(xp.add(b * QK) as *const __m256i);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
                    let scale = f16(blk) * *x.d.get_unchecked(b);
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(p), acc);
                    // Σ(q-8)·x = Σq·x − 8·Σx
                    extra -= 8.0 * scale * *x.sum.get_unchecked(b) as f32;
                }
            }
            GgmlType::Q8_0 => {
                debug_assert!(w.len() >= nb * 34);
                for b in 0..nb {
                    let blk = w.as_ptr().add(b * 34);
                    let wv = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                    let xv = _mm256_loadu_si256(xp.add(b * QK) as *const __m256i);
                    // maddubs needs an unsigned operand: |w| · (x with w's sign).
                    let aw = _mm256_sign_epi8(wv, wv);
                    let sx = _mm256_sign_epi8(xv, wv);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones);
                    let scale = f16(blk) * *x.d.get_unchecked(b);
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(p), acc);
                }
            }
            _ => {}
        }
        hsum(acc) + extra
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; `a.len() == b.len()`.
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

/// Dot product of a quantized weight row with a quantized activation row.
#[inline]
pub fn dot_q(ty: GgmlType, w: &[u8], x: ActRow<'_>) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 {
        // SAFETY: `isa()` verified the CPU features; row lengths are set by the caller from
        // the same matrix shape (checked at model load).
        return unsafe { avx2::dot_q(ty, w, x) };
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

/// Reusable buffers for [`matmul`], and its precision choice.
#[derive(Debug, Default)]
pub struct MatmulScratch {
    acts: QuantizedActs,
    transposed: Vec<f32>,
    /// Multiply quantized weights with float activations (dequantizing each row) instead
    /// of 8-bit activations: several times slower, but equal to a float reference.
    pub precise: bool,
}

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
        if t == 1 {
            let a = acts.row(0);
            out.par_chunks_mut(chunk).enumerate().for_each(|(ci, o)| {
                for (i, v) in o.iter_mut().enumerate() {
                    *v = dot_q(w.ty, w.row(ci * chunk + i), a);
                }
            });
            return;
        }
        // Row-major over weights (rows × t), then transpose to tokens × rows.
        scratch.transposed.resize(w.rows * t, 0.0);
        scratch
            .transposed
            .par_chunks_mut(chunk * t)
            .enumerate()
            .for_each(|(ci, o)| {
                for (i, orow) in o.chunks_exact_mut(t).enumerate() {
                    let wr = w.row(ci * chunk + i);
                    for (ti, v) in orow.iter_mut().enumerate() {
                        *v = dot_q(w.ty, wr, acts.row(ti));
                    }
                }
            });
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
            let x: Vec<f32> = (0..cols).map(|_| rng.next_f32() * 3.0).collect();
            let mut a = QuantizedActs::default();
            a.quantize(&x, cols);
            let s = dot_q_scalar(ty, &w, a.row(0));
            let v = dot_q(ty, &w, a.row(0));
            assert!((s - v).abs() <= 1e-4 * s.abs().max(1.0), "{ty:?}: scalar {s} simd {v}");
        }
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
            for t in [1usize, 3] {
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
            let d = a.d[i / QK];
            assert!((a.qs[i] as f32 * d - v).abs() <= d * 0.5 + 1e-6);
        }
        assert_eq!(a.sum[0], a.qs[..32].iter().map(|&q| q as i32).sum::<i32>());
    }
}
