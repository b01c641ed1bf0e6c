//! x86-64 kernels: AVX2 (with or without AVX-VNNI) and AVX-512 VNNI.
//!
//! Every function here is `unsafe` because it needs CPU features the caller has checked
//! ([`super::isa`] only returns a path whose features `is_x86_feature_detected!` confirmed).

use std::arch::x86_64::*;
use std::ops::Range;

use super::packed::{PackKind, PackedMatrix, GROUP_ROWS};
use super::{BlockQ8, Isa, QuantizedActs};

/// Packed matrix × quantized activations for groups `groups` of `p`: output row `t`
/// (activation row `t`), column `r` goes to `out[t · ld + r]`.
///
/// # Safety
/// `isa` is available on this CPU; `acts` has `p.blocks` blocks per row; `out` is valid for
/// writes of `acts.rows()` rows of `ld ≥ p.rows` floats, and no other thread writes the
/// columns of these groups.
pub unsafe fn gemm_packed(
    isa: Isa,
    p: &PackedMatrix,
    acts: &QuantizedActs,
    groups: Range<usize>,
    out: *mut f32,
    ld: usize,
) {
    let t_total = acts.rows();
    let nb = p.blocks;
    let tile = if isa == Isa::Avx512 { 8 } else { 4 };
    for g in groups {
        let w = p.group(g).as_ptr();
        let lanes = (p.rows - g * GROUP_ROWS).min(GROUP_ROWS);
        let mut t0 = 0;
        while t0 < t_total {
            let n = (t_total - t0).min(tile);
            let x = acts.blocks.as_ptr().add(t0 * nb);
            if lanes == GROUP_ROWS {
                tile_kernel(isa, p.kind, n, w, nb, x, out.add(t0 * ld + g * GROUP_ROWS), ld);
            } else {
                // The last, partial group: compute 16 lanes, keep the real rows.
                let mut tmp = [0f32; GROUP_ROWS * 8];
                tile_kernel(isa, p.kind, n, w, nb, x, tmp.as_mut_ptr(), GROUP_ROWS);
                for t in 0..n {
                    std::ptr::copy_nonoverlapping(
                        tmp.as_ptr().add(t * GROUP_ROWS),
                        out.add((t0 + t) * ld + g * GROUP_ROWS),
                        lanes,
                    );
                }
            }
            t0 += n;
        }
    }
}

// The kinds as const parameters of the kernels.
const NIB: u8 = PackKind::Nibble.code();
const BYTE: u8 = PackKind::Byte.code();
const NIB5: u8 = PackKind::Nibble5.code();
const K4: u8 = PackKind::K4.code();
const K5: u8 = PackKind::K5.code();
const K6: u8 = PackKind::K6.code();

const fn kind_of(code: u8) -> PackKind {
    match code {
        NIB => PackKind::Nibble,
        BYTE => PackKind::Byte,
        NIB5 => PackKind::Nibble5,
        K4 => PackKind::K4,
        K5 => PackKind::K5,
        _ => PackKind::K6,
    }
}

/// One 16-row group against `n` activation rows.
#[allow(clippy::too_many_arguments)]
unsafe fn tile_kernel(
    isa: Isa,
    kind: PackKind,
    n: usize,
    w: *const u8,
    nb: usize,
    x: *const BlockQ8,
    out: *mut f32,
    ld: usize,
) {
    macro_rules! pick {
        ($f:ident, $($t:literal),*) => {
            match n {
                $($t => match kind {
                    PackKind::Nibble => $f::<$t, NIB>(w, nb, x, out, ld),
                    PackKind::Byte => $f::<$t, BYTE>(w, nb, x, out, ld),
                    PackKind::Nibble5 => $f::<$t, NIB5>(w, nb, x, out, ld),
                    PackKind::K4 => $f::<$t, K4>(w, nb, x, out, ld),
                    PackKind::K5 => $f::<$t, K5>(w, nb, x, out, ld),
                    PackKind::K6 => $f::<$t, K6>(w, nb, x, out, ld),
                },)*
                _ => unreachable!("token tile of {n}"),
            }
        };
    }
    match isa {
        Isa::Avx512 => pick!(group_avx512, 1, 2, 3, 4, 5, 6, 7, 8),
        Isa::Avx2Vnni => pick!(group_avx2_vnni, 1, 2, 3, 4),
        Isa::Avx2 => pick!(group_avx2, 1, 2, 3, 4),
        Isa::Scalar => unreachable!("the scalar path does not use packed weights"),
    }
}

/// One group, `T` activation rows, 512-bit registers: lane `r` of each register is row `r`.
#[allow(clippy::needless_range_loop)] // `t` indexes both the accumulators and the rows
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_avx512<const T: usize, const K: u8>(
    w: *const u8,
    nb: usize,
    x: *const BlockQ8,
    out: *mut f32,
    ld: usize,
) {
    let kind = kind_of(K);
    let per = kind.blocks_per_super();
    let (sbytes, hbytes, qbytes) = (kind.super_bytes(), kind.header_bytes(), kind.quant_bytes());
    let mut acc = [_mm512_setzero_ps(); T];
    let mask = _mm512_set1_epi8(0x0F);
    let bit4 = _mm512_set1_epi8(0x10);
    let bit5 = _mm512_set1_epi8(0x20);
    let flip = _mm512_set1_epi8(-128);
    let u8s = |p: *const u8| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i)));
    let i8s = |p: *const u8| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)));
    // The super-block's f16 scales, converted once per super-block.
    let (mut d16, mut c16) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    for b in 0..nb {
        let (s, j) = (b / per, b % per);
        let sup = w.add(s * sbytes);
        let q = sup.add(hbytes + j * qbytes);
        if j == 0 {
            d16 = _mm512_cvtph_ps(_mm256_load_si256(sup as *const __m256i));
            c16 = _mm512_cvtph_ps(_mm256_load_si256(sup.add(32) as *const __m256i));
        }
        // (D, C) of the layout's formula; for K6 (D·sa, D·sb).
        let (d, c) = match K {
            K4 | K5 => (
                _mm512_mul_ps(d16, u8s(sup.add(64 + 16 * j))),
                _mm512_mul_ps(c16, u8s(sup.add(192 + 16 * j))),
            ),
            K6 => (
                _mm512_mul_ps(d16, i8s(sup.add(64 + 32 * j))),
                _mm512_mul_ps(d16, i8s(sup.add(64 + 32 * j + 16))),
            ),
            _ => (d16, c16),
        };
        if K == BYTE {
            let mut wq = [_mm512_setzero_si512(); 8];
            for (k, v) in wq.iter_mut().enumerate() {
                *v = _mm512_xor_si512(_mm512_load_si512(q.add(64 * k) as *const __m512i), flip);
            }
            for t in 0..T {
                let xb = &*x.add(t * nb + b);
                let xq = xb.qs.as_ptr() as *const i32;
                let mut s0 = _mm512_setzero_si512();
                let mut s1 = _mm512_setzero_si512();
                for k in 0..4 {
                    s0 = _mm512_dpbusd_epi32(s0, wq[2 * k], _mm512_set1_epi32(xq.add(2 * k).read_unaligned()));
                    s1 = _mm512_dpbusd_epi32(s1, wq[2 * k + 1], _mm512_set1_epi32(xq.add(2 * k + 1).read_unaligned()));
                }
                let s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                acc[t] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(xb.d)), acc[t]);
                acc[t] = _mm512_fmadd_ps(c, _mm512_set1_ps(xb.s), acc[t]);
            }
            continue;
        }
        let mut lo = [_mm512_setzero_si512(); 4];
        let mut hi = [_mm512_setzero_si512(); 4];
        for k in 0..4 {
            let r = _mm512_load_si512(q.add(64 * k) as *const __m512i);
            lo[k] = _mm512_and_si512(r, mask);
            hi[k] = _mm512_and_si512(_mm512_srli_epi16(r, 4), mask);
        }
        if kind.high_planes() >= 1 {
            let mut h = _mm512_load_si512(q.add(256) as *const __m512i);
            for k in 0..4 {
                lo[k] = _mm512_or_si512(lo[k], _mm512_and_si512(_mm512_slli_epi32(h, 4), bit4));
                hi[k] = _mm512_or_si512(hi[k], _mm512_and_si512(h, bit4));
                h = _mm512_srli_epi32(h, 1);
            }
        }
        if kind.high_planes() == 2 {
            let mut h = _mm512_load_si512(q.add(320) as *const __m512i);
            for k in 0..4 {
                lo[k] = _mm512_or_si512(lo[k], _mm512_and_si512(_mm512_slli_epi32(h, 5), bit5));
                hi[k] = _mm512_or_si512(hi[k], _mm512_and_si512(_mm512_slli_epi32(h, 1), bit5));
                h = _mm512_srli_epi32(h, 1);
            }
        }
        for t in 0..T {
            let xb = &*x.add(t * nb + b);
            let xq = xb.qs.as_ptr() as *const i32;
            let mut s0 = _mm512_setzero_si512();
            let mut s1 = _mm512_setzero_si512();
            for k in 0..4 {
                s0 = _mm512_dpbusd_epi32(s0, lo[k], _mm512_set1_epi32(xq.add(k).read_unaligned()));
                s1 = _mm512_dpbusd_epi32(s1, hi[k], _mm512_set1_epi32(xq.add(4 + k).read_unaligned()));
            }
            let dx = _mm512_set1_ps(xb.d);
            if K == K6 {
                let t0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(32 * xb.h[0] as i32));
                let t1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(32 * xb.h[1] as i32));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t0), _mm512_mul_ps(d, dx), acc[t]);
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t1), _mm512_mul_ps(c, dx), acc[t]);
            } else {
                let s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                acc[t] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, dx), acc[t]);
                acc[t] = _mm512_fmadd_ps(c, _mm512_set1_ps(xb.s), acc[t]);
            }
        }
    }
    for (t, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * ld), *a);
    }
}

/// The 256-bit kernel: a group is two halves of 8 rows. `$dp_nib` / `$dp_byte` compute
/// the 8 lanes' integer dot products for one block (for nibble kinds the low-nibble and
/// high-nibble halves apart); with VNNI they are `vpdpbusd`, without it `vpmaddubsw` +
/// `vpmaddwd`.
macro_rules! avx2_group_kernel {
    ($name:ident, $features:literal, $dp_nib:ident, $dp_byte:ident) => {
        #[target_feature(enable = $features)]
        unsafe fn $name<const T: usize, const K: u8>(
            w: *const u8,
            nb: usize,
            x: *const BlockQ8,
            out: *mut f32,
            ld: usize,
        ) {
            let kind = kind_of(K);
            let per = kind.blocks_per_super();
            let (sbytes, hbytes, qbytes) = (kind.super_bytes(), kind.header_bytes(), kind.quant_bytes());
            let mut acc = [[_mm256_setzero_ps(); 2]; T];
            let mask = _mm256_set1_epi8(0x0F);
            let bit4 = _mm256_set1_epi8(0x10);
            let bit5 = _mm256_set1_epi8(0x20);
            let u8s = |p: *const u8| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)));
            let i8s = |p: *const u8| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)));
            // The super-block's f16 scales (both halves), converted once per super-block.
            let (mut d16, mut c16) = ([_mm256_setzero_ps(); 2], [_mm256_setzero_ps(); 2]);
            for b in 0..nb {
                let (s, j) = (b / per, b % per);
                let sup = w.add(s * sbytes);
                let qb = sup.add(hbytes + j * qbytes);
                if j == 0 {
                    for h in 0..2 {
                        d16[h] = _mm256_cvtph_ps(_mm_load_si128(sup.add(16 * h) as *const __m128i));
                        c16[h] = _mm256_cvtph_ps(_mm_load_si128(sup.add(32 + 16 * h) as *const __m128i));
                    }
                }
                for h in 0..2 {
                    let (d, c) = match K {
                        K4 | K5 => (
                            _mm256_mul_ps(d16[h], u8s(sup.add(64 + 16 * j + 8 * h))),
                            _mm256_mul_ps(c16[h], u8s(sup.add(192 + 16 * j + 8 * h))),
                        ),
                        K6 => (
                            _mm256_mul_ps(d16[h], i8s(sup.add(64 + 32 * j + 8 * h))),
                            _mm256_mul_ps(d16[h], i8s(sup.add(64 + 32 * j + 16 + 8 * h))),
                        ),
                        _ => (d16[h], c16[h]),
                    };
                    let q = qb.add(32 * h);
                    if K == BYTE {
                        let mut wq = [_mm256_setzero_si256(); 8];
                        for (k, v) in wq.iter_mut().enumerate() {
                            *v = _mm256_load_si256(q.add(64 * k) as *const __m256i);
                        }
                        for t in 0..T {
                            let xb = &*x.add(t * nb + b);
                            let (s, with_c) = $dp_byte(&wq, xb.qs.as_ptr() as *const i32);
                            let s = _mm256_cvtepi32_ps(s);
                            acc[t][h] = _mm256_fmadd_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(xb.d)), acc[t][h]);
                            if with_c {
                                acc[t][h] = _mm256_fmadd_ps(c, _mm256_set1_ps(xb.s), acc[t][h]);
                            }
                        }
                        continue;
                    }
                    let mut lo = [_mm256_setzero_si256(); 4];
                    let mut hi = [_mm256_setzero_si256(); 4];
                    for k in 0..4 {
                        let r = _mm256_load_si256(q.add(64 * k) as *const __m256i);
                        lo[k] = _mm256_and_si256(r, mask);
                        hi[k] = _mm256_and_si256(_mm256_srli_epi16(r, 4), mask);
                    }
                    if kind.high_planes() >= 1 {
                        let mut hb = _mm256_load_si256(qb.add(256 + 32 * h) as *const __m256i);
                        for k in 0..4 {
                            lo[k] = _mm256_or_si256(lo[k], _mm256_and_si256(_mm256_slli_epi32(hb, 4), bit4));
                            hi[k] = _mm256_or_si256(hi[k], _mm256_and_si256(hb, bit4));
                            hb = _mm256_srli_epi32(hb, 1);
                        }
                    }
                    if kind.high_planes() == 2 {
                        let mut hb = _mm256_load_si256(qb.add(320 + 32 * h) as *const __m256i);
                        for k in 0..4 {
                            lo[k] = _mm256_or_si256(lo[k], _mm256_and_si256(_mm256_slli_epi32(hb, 5), bit5));
                            hi[k] = _mm256_or_si256(hi[k], _mm256_and_si256(_mm256_slli_epi32(hb, 1), bit5));
                            hb = _mm256_srli_epi32(hb, 1);
                        }
                    }
                    for t in 0..T {
                        let xb = &*x.add(t * nb + b);
                        let (s0, s1) = $dp_nib::<K>(&lo, &hi, xb.qs.as_ptr() as *const i32);
                        let dx = _mm256_set1_ps(xb.d);
                        if K == K6 {
                            let t0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(32 * xb.h[0] as i32));
                            let t1 = _mm256_sub_epi32(s1, _mm256_set1_epi32(32 * xb.h[1] as i32));
                            acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t0), _mm256_mul_ps(d, dx), acc[t][h]);
                            acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t1), _mm256_mul_ps(c, dx), acc[t][h]);
                        } else {
                            let s = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
                            acc[t][h] = _mm256_fmadd_ps(s, _mm256_mul_ps(d, dx), acc[t][h]);
                            acc[t][h] = _mm256_fmadd_ps(c, _mm256_set1_ps(xb.s), acc[t][h]);
                        }
                    }
                }
            }
            for (t, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(t * ld), a[0]);
                _mm256_storeu_ps(out.add(t * ld + 8), a[1]);
            }
        }
    };
}

avx2_group_kernel!(group_avx2, "avx2,fma,f16c", dp_nib_maddubs, dp_byte_maddubs);
avx2_group_kernel!(group_avx2_vnni, "avx2,fma,f16c,avxvnni", dp_nib_vnni, dp_byte_vnni);

/// Nibbles × activations without VNNI, returning the low-nibble and high-nibble sums (4-bit
/// kinds: both in the first). `vpmaddubsw` pairs stay below 2 · v_max · 127 and add in 16
/// bits as long as their sum cannot overflow: 8 pairs for 4-bit quants (30480), 4 for 5-bit
/// (31496), 2 for 6-bit (32004), then one widening `vpmaddwd`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dp_nib_maddubs<const K: u8>(lo: &[__m256i; 4], hi: &[__m256i; 4], xq: *const i32) -> (__m256i, __m256i) {
    let bx = |i: usize| _mm256_set1_epi32(xq.add(i).read_unaligned());
    let ones = _mm256_set1_epi16(1);
    let m = |v: __m256i, i: usize| _mm256_maddubs_epi16(v, bx(i));
    match kind_of(K).high_planes() {
        0 => {
            let mut p = _mm256_add_epi16(m(lo[0], 0), m(hi[0], 4));
            for k in 1..4 {
                p = _mm256_add_epi16(p, m(lo[k], k));
                p = _mm256_add_epi16(p, m(hi[k], 4 + k));
            }
            (_mm256_madd_epi16(p, ones), _mm256_setzero_si256())
        }
        1 => {
            let half = |v: &[__m256i; 4], o: usize| {
                let p = _mm256_add_epi16(
                    _mm256_add_epi16(m(v[0], o), m(v[1], o + 1)),
                    _mm256_add_epi16(m(v[2], o + 2), m(v[3], o + 3)),
                );
                _mm256_madd_epi16(p, ones)
            };
            (half(lo, 0), half(hi, 4))
        }
        _ => {
            let half = |v: &[__m256i; 4], o: usize| {
                let a = _mm256_madd_epi16(_mm256_add_epi16(m(v[0], o), m(v[1], o + 1)), ones);
                let b = _mm256_madd_epi16(_mm256_add_epi16(m(v[2], o + 2), m(v[3], o + 3)), ones);
                _mm256_add_epi32(a, b)
            };
            (half(lo, 0), half(hi, 4))
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn dp_nib_vnni<const K: u8>(lo: &[__m256i; 4], hi: &[__m256i; 4], xq: *const i32) -> (__m256i, __m256i) {
    let bx = |i: usize| _mm256_set1_epi32(xq.add(i).read_unaligned());
    let mut s0 = _mm256_setzero_si256();
    let mut s1 = _mm256_setzero_si256();
    for k in 0..4 {
        s0 = _mm256_dpbusd_avx_epi32(s0, lo[k], bx(k));
        s1 = _mm256_dpbusd_avx_epi32(s1, hi[k], bx(4 + k));
    }
    (s0, s1)
}

/// Signed bytes × activations without VNNI: `|w| · (x with w's sign)` (at most
/// 2 · 128 · 127 = 32512 per 16-bit lane). Returns the sums and whether the `c` term applies (no:
/// the weights were not offset).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dp_byte_maddubs(wq: &[__m256i; 8], xq: *const i32) -> (__m256i, bool) {
    let ones = _mm256_set1_epi16(1);
    let mut s = _mm256_setzero_si256();
    for (k, w) in wq.iter().enumerate() {
        let xv = _mm256_set1_epi32(xq.add(k).read_unaligned());
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(*w, *w), _mm256_sign_epi8(xv, *w));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
    (s, false)
}

/// Signed bytes made unsigned (`w + 128`) for `vpdpbusd`; the `c = −128·d` term corrects.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn dp_byte_vnni(wq: &[__m256i; 8], xq: *const i32) -> (__m256i, bool) {
    let flip = _mm256_set1_epi8(-128);
    let mut s0 = _mm256_setzero_si256();
    let mut s1 = _mm256_setzero_si256();
    for k in 0..4 {
        let x0 = _mm256_set1_epi32(xq.add(2 * k).read_unaligned());
        let x1 = _mm256_set1_epi32(xq.add(2 * k + 1).read_unaligned());
        s0 = _mm256_dpbusd_avx_epi32(s0, _mm256_xor_si256(wq[2 * k], flip), x0);
        s1 = _mm256_dpbusd_avx_epi32(s1, _mm256_xor_si256(wq[2 * k + 1], flip), x1);
    }
    (_mm256_add_epi32(s0, s1), true)
}

/// Vector helpers every SIMD path shares (AVX2 + FMA + F16C, which every SIMD path has).
pub mod avx2 {
    use super::super::BlockQ8;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn hmax(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_max_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// `exp(x)` for 8 lanes (Cephes' single-precision polynomial; relative error about
    /// 2e-7 over the clamped range, 0 below −87.3).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn exp(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.336_55)), _mm256_set1_ps(88.0));
        let fx = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.398_2e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.333_452e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_579_6e-2));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.166_666_65));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
        let y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
        _mm256_mul_ps(y, _mm256_castsi256_ps(e))
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
        let amax = hmax(m);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
        let i: [__m256i; 4] = [
            _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id)),
        ];
        // The two halves' sums: lanes 0..4 of `s4` hold the first half's partial sums,
        // 4..8 the second's.
        let lo = _mm256_add_epi32(i[0], i[1]);
        let hi = _mm256_add_epi32(i[2], i[3]);
        let s4 = _mm256_hadd_epi32(lo, hi); // [lo01 lo23 hi01 hi23 | lo45 lo67 hi45 hi67]
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
        let s4 = _mm_hadd_epi32(s4, s4); // [lo, hi, lo, hi]
        let h0 = _mm_cvtsi128_si32(s4);
        let h1 = _mm_extract_epi32(s4, 1);
        let total = h0 + h1;
        out.h = [h0 as i16, h1 as i16];
        // Pack i32 → i16 → i8; the packs interleave 128-bit lanes, so restore the order.
        let a = _mm256_packs_epi32(i[0], i[1]);
        let b = _mm256_packs_epi32(i[2], i[3]);
        let q = _mm256_packs_epi16(a, b);
        let q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(out.qs.as_mut_ptr() as *mut __m256i, q);
        out.d = d;
        out.s = d * total as f32;
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

    /// `out += w · v`.
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

    /// Eight f16 values from `p`, as floats.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    /// LoRA's shrink: `t[j] = a[j] · x` for the `t.len()` rows of `a` (f16, each `x.len()`
    /// wide), four rows of `a` per pass over `x`.
    ///
    /// # Safety
    /// AVX2/FMA/F16C available; `a` holds `t.len() · x.len()` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn lora_shrink(a: &[u16], x: &[f32], t: &mut [f32]) {
        let (cols, rank) = (x.len(), t.len());
        debug_assert!(a.len() >= rank * cols);
        let (xp, ap) = (x.as_ptr(), a.as_ptr());
        let scalar = |j: usize, from: usize| -> f32 {
            (from..cols)
                .map(|c| half::f16::from_bits(a[j * cols + c]).to_f32() * x[c])
                .sum()
        };
        let mut j = 0;
        while j + 4 <= rank {
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i + 8 <= cols {
                let xv = _mm256_loadu_ps(xp.add(i));
                for (k, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(load_f16(ap.add((j + k) * cols + i)), xv, *acc);
                }
                i += 8;
            }
            for (k, acc) in acc.iter().enumerate() {
                t[j + k] = hsum(*acc) + scalar(j + k, i);
            }
            j += 4;
        }
        while j < rank {
            let mut acc = _mm256_setzero_ps();
            let mut i = 0;
            while i + 8 <= cols {
                acc = _mm256_fmadd_ps(load_f16(ap.add(j * cols + i)), _mm256_loadu_ps(xp.add(i)), acc);
                i += 8;
            }
            t[j] = hsum(acc) + scalar(j, i);
            j += 1;
        }
    }

    /// LoRA's expand: `y[o] += Σ_j t[j] · bt[j][o]` (`bt` is `t.len()` f16 rows of
    /// `y.len()`), `y` read and written once.
    ///
    /// # Safety
    /// AVX2/FMA/F16C available; `bt` holds `t.len() · y.len()` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn lora_expand(bt: &[u16], t: &[f32], y: &mut [f32]) {
        let (out, rank) = (y.len(), t.len());
        debug_assert!(bt.len() >= rank * out);
        let (bp, yp) = (bt.as_ptr(), y.as_mut_ptr());
        let mut o = 0;
        while o + 16 <= out {
            let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for (j, &w) in t.iter().enumerate() {
                let w = _mm256_set1_ps(w);
                let p = bp.add(j * out + o);
                acc0 = _mm256_fmadd_ps(w, load_f16(p), acc0);
                acc1 = _mm256_fmadd_ps(w, load_f16(p.add(8)), acc1);
            }
            _mm256_storeu_ps(yp.add(o), _mm256_add_ps(_mm256_loadu_ps(yp.add(o)), acc0));
            _mm256_storeu_ps(yp.add(o + 8), _mm256_add_ps(_mm256_loadu_ps(yp.add(o + 8)), acc1));
            o += 16;
        }
        while o < out {
            y[o] += t
                .iter()
                .enumerate()
                .map(|(j, &w)| w * half::f16::from_bits(bt[j * out + o]).to_f32())
                .sum::<f32>();
            o += 1;
        }
    }

    /// `g = silu(g) · u`.
    ///
    /// # Safety
    /// AVX2/FMA available; equal lengths.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn silu_mul(g: &mut [f32], u: &[f32]) {
        let n = g.len().min(u.len());
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i + 8 <= n {
            let gp = g.as_mut_ptr().add(i);
            let gv = _mm256_loadu_ps(gp);
            let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(gp, _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i))));
            i += 8;
        }
        while i < n {
            g[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
            i += 1;
        }
    }

    /// `x = cap · tanh(x / cap)`, as `cap − 2·cap / (1 + exp(2x / cap))`.
    ///
    /// # Safety
    /// AVX2/FMA available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn soft_cap(x: &mut [f32], cap: f32) {
        let (c, two_c, k) = (
            _mm256_set1_ps(cap),
            _mm256_set1_ps(2.0 * cap),
            _mm256_set1_ps(2.0 / cap),
        );
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i + 8 <= x.len() {
            let p = x.as_mut_ptr().add(i);
            let e = exp(_mm256_mul_ps(_mm256_loadu_ps(p), k));
            _mm256_storeu_ps(p, _mm256_sub_ps(c, _mm256_div_ps(two_c, _mm256_add_ps(one, e))));
            i += 8;
        }
        for v in &mut x[i..] {
            *v = cap * (*v / cap).tanh();
        }
    }

    /// `g = gelu(g) · u` (tanh form, as `g · sigmoid(2c·(g + 0.044715·g³))`).
    ///
    /// # Safety
    /// AVX2/FMA available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn gelu_mul(g: &mut [f32], u: &[f32]) {
        let n = g.len().min(u.len());
        let one = _mm256_set1_ps(1.0);
        let k = _mm256_set1_ps(-2.0 * 0.797_884_6);
        let a = _mm256_set1_ps(0.044_715);
        let mut i = 0;
        while i + 8 <= n {
            let gp = g.as_mut_ptr().add(i);
            let x = _mm256_loadu_ps(gp);
            let x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            let inner = _mm256_mul_ps(k, _mm256_fmadd_ps(a, x3, x));
            let s = _mm256_div_ps(x, _mm256_add_ps(one, exp(inner)));
            _mm256_storeu_ps(gp, _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i))));
            i += 8;
        }
        while i < n {
            g[i] = super::super::gelu_tanh(g[i]) * u[i];
            i += 1;
        }
    }

    /// `x = exp(x − max)`, returning Σx.
    ///
    /// # Safety
    /// AVX2/FMA available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn exp_shifted_sum(x: &mut [f32], max: f32) -> f32 {
        let m = _mm256_set1_ps(max);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= x.len() {
            let p = x.as_mut_ptr().add(i);
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(p), m));
            _mm256_storeu_ps(p, e);
            acc = _mm256_add_ps(acc, e);
            i += 8;
        }
        let mut sum = hsum(acc);
        while i < x.len() {
            x[i] = (x[i] - max).exp();
            sum += x[i];
            i += 1;
        }
        sum
    }
}
