//! Attention over the paged KV cache: one query head against positions `0..n` of a
//! sequence, read through its block table.
//!
//! Scores are computed a block at a time: keys are stored transposed per head
//! (`[head_dim][slot]`, see [`KvPool`]), so one vector register holds the running scores
//! of 8 positions and each query element is one broadcast multiply-add. Softmax uses a
//! vectorised `exp`; the weighted sum of values keeps the output row in registers.

use crate::kernels::{exp_shifted_sum, isa, Isa};
use crate::kv::{KvPool, KvSlice};

/// Where one head's keys and values live.
#[derive(Debug, Clone, Copy)]
pub struct HeadSpec {
    pub layer: usize,
    /// KV head (query heads are grouped onto KV heads).
    pub kv_head: usize,
    pub head_dim: usize,
    pub kv_dim: usize,
}

/// How scores are formed: `scale · q·k`, then soft-capped (`cap · tanh(s / cap)`) when a
/// cap is set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scoring {
    pub scale: f32,
    pub softcap: Option<f32>,
}

impl Scoring {
    /// Plain scaled dot-product attention: `1/√head_dim`, no cap.
    pub fn plain(head_dim: usize) -> Self {
        Self {
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: None,
        }
    }
}

/// `out = softmax(score(q, K)) · V` over positions `span` (`0..n` for full attention, the
/// window's `n − w..n` for sliding-window layers) of the sequence whose blocks are `table`.
/// `scores` is scratch.
#[allow(clippy::too_many_arguments)]
pub fn attend_head(
    q: &[f32],
    span: std::ops::Range<usize>,
    table: &[u32],
    pool: &KvPool,
    h: HeadSpec,
    scoring: Scoring,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let bt = pool.block_tokens();
    let hd = h.head_dim;
    let n = span.end;
    // The SIMD kernels read through raw pointers sized by these shapes.
    let shape = pool.shape();
    assert!(
        q.len() == hd
            && out.len() == hd
            && hd == shape.head_dim
            && h.kv_dim == shape.kv_dim()
            && h.kv_head < shape.kv_heads,
        "attention head shape does not match the KV pool"
    );
    assert!(table.len() * bt >= n, "the block table does not cover {n} positions");
    assert!(span.start < n, "an empty attention span");
    // Blocks wholly before the span are skipped; positions of the first block before it
    // get no weight.
    let first = span.start / bt;
    let table = &table[first..n.div_ceil(bt)];
    let skip = span.start - first * bt;
    let n = n - first * bt;
    let nblocks = table.len();
    scores.clear();
    scores.resize(nblocks * bt, 0.0);
    #[cfg(target_arch = "x86_64")]
    let simd = isa().is_simd() && bt.is_multiple_of(8) && hd.is_multiple_of(8) && hd <= 256;
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    // 512-bit registers: 16 positions (one block) or 16 output elements per register.
    let wide = simd && isa() == Isa::Avx512 && bt.is_multiple_of(16) && matches!(hd, 64 | 128 | 256);
    for (bi, &block) in table.iter().enumerate() {
        let keys = pool.keys(block, h.layer);
        let dst = &mut scores[bi * bt..(bi + 1) * bt];
        let kt_off = h.kv_head * hd * bt;
        if simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a SIMD path implies AVX2/FMA/F16C; the head's keys are `hd · bt`
            // elements from `kt_off` inside the block section; `bt` is a multiple of 8.
            unsafe {
                if wide {
                    x86::scores512(q, scoring.scale, keys, kt_off, bt, dst)
                } else {
                    x86::scores(q, scoring.scale, keys, kt_off, bt, dst)
                }
            };
        } else {
            for (slot, d) in dst.iter_mut().enumerate() {
                let s: f32 = (0..hd).map(|i| q[i] * keys.get(kt_off + i * bt + slot)).sum();
                *d = s * scoring.scale;
            }
        }
    }
    scores.truncate(n);
    let live = &mut scores[skip..];
    if let Some(cap) = scoring.softcap {
        for s in live.iter_mut() {
            *s = cap * (*s / cap).tanh();
        }
    }
    let max = live.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let inv = 1.0 / exp_shifted_sum(live, max);
    scores[..skip].fill(0.0);
    let off = h.kv_head * hd;
    if simd {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; every position `< n` lies in the table's blocks, whose value
        // rows hold `kv_dim ≥ off + hd` elements.
        unsafe {
            match (wide, hd) {
                (true, 64) => x86::weighted512::<4>(scores, inv, table, pool, h, off, out),
                (true, 128) => x86::weighted512::<8>(scores, inv, table, pool, h, off, out),
                (true, _) => x86::weighted512::<16>(scores, inv, table, pool, h, off, out),
                _ => x86::weighted_values(scores, inv, table, pool, h, off, out),
            }
        };
        return;
    }
    out.fill(0.0);
    for (bi, &block) in table.iter().enumerate() {
        let values = pool.values(block, h.layer);
        let here = (n - bi * bt).min(bt);
        for slot in 0..here {
            let w = scores[bi * bt + slot] * inv;
            for (i, o) in out.iter_mut().enumerate().take(hd) {
                *o += w * values.get(slot * h.kv_dim + off + i);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{HeadSpec, KvPool, KvSlice};

    /// 8 stored elements from `at` as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(s: KvSlice<'_>, at: usize) -> __m256 {
        match s {
            KvSlice::F16(d) => _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().add(at) as *const __m128i)),
            KvSlice::F32(d) => _mm256_loadu_ps(d.as_ptr().add(at)),
        }
    }

    /// Scores of one block's `bt` positions: `dst[slot] = scale · Σᵢ q[i] · Kᵀ[i][slot]`.
    ///
    /// # Safety
    /// AVX2/FMA/F16C; `keys` holds `kt_off + q.len() · bt` elements; `bt % 8 == 0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scores(q: &[f32], scale: f32, keys: KvSlice<'_>, kt_off: usize, bt: usize, dst: &mut [f32]) {
        let hd = q.len();
        for half in 0..bt / 8 {
            let mut acc = [_mm256_setzero_ps(); 4];
            let base = kt_off + 8 * half;
            let mut i = 0;
            while i + 4 <= hd {
                for (j, a) in acc.iter_mut().enumerate() {
                    let qi = _mm256_set1_ps(*q.get_unchecked(i + j));
                    *a = _mm256_fmadd_ps(qi, load8(keys, base + (i + j) * bt), *a);
                }
                i += 4;
            }
            while i < hd {
                acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(q[i]), load8(keys, base + i * bt), acc[0]);
                i += 1;
            }
            let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            _mm256_storeu_ps(dst.as_mut_ptr().add(8 * half), _mm256_mul_ps(s, _mm256_set1_ps(scale)));
        }
    }

    /// `out = inv · Σⱼ p[j] · V[j][off..off + hd]` over the `p.len()` first positions.
    ///
    /// # Safety
    /// AVX2/FMA/F16C; `hd = out.len()` is a multiple of 8, at most 256; the table covers
    /// `p.len()` positions.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_values(
        p: &[f32],
        inv: f32,
        table: &[u32],
        pool: &KvPool,
        h: HeadSpec,
        off: usize,
        out: &mut [f32],
    ) {
        match out.len() / 8 {
            8 => weighted::<8>(p, inv, table, pool, h, off, out),
            16 => weighted::<16>(p, inv, table, pool, h, off, out),
            4 => weighted::<4>(p, inv, table, pool, h, off, out),
            // Wider heads (Gemma's 256) in register-sized halves.
            32 => {
                let (lo, hi) = out.split_at_mut(128);
                weighted::<16>(p, inv, table, pool, h, off, lo);
                weighted::<16>(p, inv, table, pool, h, off + 128, hi);
            }
            n => {
                // Other head sizes: accumulate through memory.
                out.fill(0.0);
                let bt = pool.block_tokens();
                for (j, &w) in p.iter().enumerate() {
                    let v = pool.values(table[j / bt], h.layer);
                    let row = (j % bt) * h.kv_dim + off;
                    let wv = _mm256_set1_ps(w * inv);
                    for c in 0..n {
                        let o = out.as_mut_ptr().add(8 * c);
                        _mm256_storeu_ps(o, _mm256_fmadd_ps(wv, load8(v, row + 8 * c), _mm256_loadu_ps(o)));
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weighted<const NV: usize>(
        p: &[f32],
        inv: f32,
        table: &[u32],
        pool: &KvPool,
        h: HeadSpec,
        off: usize,
        out: &mut [f32],
    ) {
        let bt = pool.block_tokens();
        let mut acc = [_mm256_setzero_ps(); NV];
        for (bi, &block) in table.iter().enumerate().take(p.len().div_ceil(bt)) {
            let v = pool.values(block, h.layer);
            let here = (p.len() - bi * bt).min(bt);
            for slot in 0..here {
                let w = _mm256_set1_ps(*p.get_unchecked(bi * bt + slot));
                let row = slot * h.kv_dim + off;
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(w, load8(v, row + 8 * c), *a);
                }
            }
        }
        let iv = _mm256_set1_ps(inv);
        for (c, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), _mm256_mul_ps(*a, iv));
        }
    }

    /// 16 stored elements from `at` as f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn load16(s: KvSlice<'_>, at: usize) -> __m512 {
        match s {
            KvSlice::F16(d) => _mm512_cvtph_ps(_mm256_loadu_si256(d.as_ptr().add(at) as *const __m256i)),
            KvSlice::F32(d) => _mm512_loadu_ps(d.as_ptr().add(at)),
        }
    }

    /// [`scores`] with 16 positions per register.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL; as [`scores`], with `bt % 16 == 0`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn scores512(q: &[f32], scale: f32, keys: KvSlice<'_>, kt_off: usize, bt: usize, dst: &mut [f32]) {
        let hd = q.len();
        for part in 0..bt / 16 {
            let mut acc = [_mm512_setzero_ps(); 4];
            let base = kt_off + 16 * part;
            let mut i = 0;
            while i + 4 <= hd {
                for (j, a) in acc.iter_mut().enumerate() {
                    let qi = _mm512_set1_ps(*q.get_unchecked(i + j));
                    *a = _mm512_fmadd_ps(qi, load16(keys, base + (i + j) * bt), *a);
                }
                i += 4;
            }
            while i < hd {
                acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(q[i]), load16(keys, base + i * bt), acc[0]);
                i += 1;
            }
            let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
            _mm512_storeu_ps(dst.as_mut_ptr().add(16 * part), _mm512_mul_ps(s, _mm512_set1_ps(scale)));
        }
    }

    /// [`weighted_values`] with the output row in `NV` 512-bit registers (`hd = 16·NV`).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL; `out.len() == 16 · NV`; the table covers `p.len()` positions.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn weighted512<const NV: usize>(
        p: &[f32],
        inv: f32,
        table: &[u32],
        pool: &KvPool,
        h: HeadSpec,
        off: usize,
        out: &mut [f32],
    ) {
        let bt = pool.block_tokens();
        let mut acc = [_mm512_setzero_ps(); NV];
        for (bi, &block) in table.iter().enumerate().take(p.len().div_ceil(bt)) {
            let v = pool.values(block, h.layer);
            let here = (p.len() - bi * bt).min(bt);
            for slot in 0..here {
                let w = _mm512_set1_ps(*p.get_unchecked(bi * bt + slot));
                let row = slot * h.kv_dim + off;
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(w, load16(v, row + 16 * c), *a);
                }
            }
        }
        let iv = _mm512_set1_ps(inv);
        for (c, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(16 * c), _mm512_mul_ps(*a, iv));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::tests::Lcg;
    use crate::kv::{KvDtype, KvShape};

    /// Paged attention equals attention over contiguous K/V, on random data with the
    /// sequence's blocks scattered through the pool: for both storage types, on shapes the
    /// SIMD kernels take (heads of 64, 128 and 256, blocks of 16) and ones only the scalar
    /// code takes; with full spans and windows that start mid-block, with and without a
    /// soft-cap.
    #[test]
    fn paged_equals_contiguous_reference() {
        let mut rng = Lcg(11);
        for (hd, bt) in [(8usize, 4usize), (64, 16), (128, 32), (256, 16), (24, 8)] {
            for dtype in [KvDtype::F32, KvDtype::F16] {
                let (layers, kv_heads) = (2, 3);
                let kv_dim = kv_heads * hd;
                let shape = KvShape {
                    n_layers: layers,
                    kv_heads,
                    head_dim: hd,
                    block_tokens: bt,
                };
                let mut pool = KvPool::new(shape, dtype, 16);
                let table: Vec<u32> = vec![9, 2, 14, 5, 0, 11, 3, 7];
                let round = |x: f32| match dtype {
                    KvDtype::F16 => half::f16::from_f32(x).to_f32(),
                    KvDtype::F32 => x,
                };
                for n in [1usize, 3, 4, 5, 17, 24, 8 * bt] {
                    let mut keys = vec![vec![0f32; kv_dim]; n];
                    let mut vals = vec![vec![0f32; kv_dim]; n];
                    for p in 0..n {
                        for x in keys[p].iter_mut().chain(vals[p].iter_mut()) {
                            *x = rng.next_f32() * 2.0;
                        }
                        pool.write(table[p / bt], p % bt, 1, &keys[p], &vals[p]);
                    }
                    let q: Vec<f32> = (0..hd).map(|_| rng.next_f32()).collect();
                    // (KV head, window, soft-cap): full spans, windows from one position to
                    // one past a block, capped and not.
                    let cases = [(0, n, None), (1, 3, Some(0.5)), (2, bt + 1, None), (0, 1, Some(2.0))];
                    for (g, window, softcap) in cases {
                        let window = window.min(n);
                        let mut out = vec![0f32; hd];
                        let spec = HeadSpec {
                            layer: 1,
                            kv_head: g,
                            head_dim: hd,
                            kv_dim,
                        };
                        let scoring = Scoring {
                            softcap,
                            ..Scoring::plain(hd)
                        };
                        let start = n - window;
                        attend_head(&q, start..n, &table, &pool, spec, scoring, &mut out, &mut Vec::new());
                        // Reference, in f64 over contiguous rows of the stored values.
                        let s: Vec<f64> = (start..n)
                            .map(|p| {
                                let s = (0..hd)
                                    .map(|i| q[i] as f64 * round(keys[p][g * hd + i]) as f64)
                                    .sum::<f64>()
                                    / (hd as f64).sqrt();
                                softcap.map_or(s, |c| c as f64 * (s / c as f64).tanh())
                            })
                            .collect();
                        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                        let z: f64 = e.iter().sum();
                        for i in 0..hd {
                            let want: f64 = (start..n)
                                .map(|p| e[p - start] / z * round(vals[p][g * hd + i]) as f64)
                                .sum();
                            assert!(
                                (out[i] as f64 - want).abs() < 2e-5,
                                "{dtype:?} hd={hd} bt={bt} n={n} window={window} cap={softcap:?} g={g} i={i}: {} vs {want}",
                                out[i]
                            );
                        }
                    }
                }
            }
        }
    }
}
