//! Attention over the paged KV cache: query heads against a span of a sequence's positions
//! (all of them, or a sliding window's), read through its block table; scores scaled and
//! optionally soft-capped.
//!
//! Scores are computed a block at a time: keys are stored transposed per head
//! (`[head_dim][slot]`, see [`KvPool`]), so one vector register holds the running scores
//! of 8 or 16 positions and each query element is one broadcast multiply-add. Softmax uses
//! a vectorised `exp`; the weighted sum of values keeps output columns in registers.
//! [`attend_group`] takes up to [`MAX_GROUP`] queries on one KV head at once (a GQA
//! group's heads, consecutive rows of a prefill), reading each key and value once for all.

use crate::kernels::{exp_shifted_sum, isa, soft_cap, Isa};
use crate::kv::pool::{KvPool, KvSlice};

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

#[cfg(test)]
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
/// window's `n − w..n` for sliding-window layers) of the sequence whose blocks are `table`:
/// a group of one ([`attend_group`]). `scores` is scratch.
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
    attend_group(&[Query { q, span }], table, pool, h, scoring, out, scores)
}

/// The scalar reference every SIMD path is tested against, and the path for shapes the
/// kernels do not take.
#[allow(clippy::too_many_arguments)]
fn attend_scalar(
    q: &[f32],
    span: std::ops::Range<usize>,
    table: &[u32],
    pool: &KvPool,
    h: HeadSpec,
    scoring: Scoring,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let (bt, hd) = (pool.block_tokens(), h.head_dim);
    assert!(
        table.len() * bt >= span.end,
        "the block table does not cover {} positions",
        span.end
    );
    scores.clear();
    scores.extend(span.clone().map(|p| {
        let keys = pool.keys(table[p / bt], h.layer);
        let kt_off = h.kv_head * hd * bt + p % bt;
        let s: f32 = (0..hd).map(|i| q[i] * keys.get(kt_off + i * bt)).sum();
        s * scoring.scale
    }));
    if let Some(cap) = scoring.softcap {
        soft_cap(scores, cap);
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let inv = 1.0 / exp_shifted_sum(scores, max);
    out.fill(0.0);
    let off = h.kv_head * hd;
    let latent = pool.shape().latent;
    for (p, &w) in span.zip(scores.iter()) {
        // A latent pool's value is its key's leading part (stored transposed).
        let (values, at) = match latent {
            true => (pool.keys(table[p / bt], h.layer), off * bt + p % bt),
            false => (pool.values(table[p / bt], h.layer), (p % bt) * h.kv_dim + off),
        };
        let stride = if latent { bt } else { 1 };
        for (i, o) in out.iter_mut().enumerate() {
            *o += w * inv * values.get(at + i * stride);
        }
    }
}

/// Most queries one [`attend_group`] call takes (what the kernels' registers hold).
pub const MAX_GROUP: usize = 12;

/// One query of a group: its vector and the positions it attends.
#[derive(Debug, Clone)]
pub struct Query<'a> {
    pub q: &'a [f32],
    pub span: std::ops::Range<usize>,
}

/// [`attend_head`] for up to [`MAX_GROUP`] queries against the same KV head of the same
/// sequence — the query heads of a GQA group, and consecutive rows of a prefill chunk —
/// reading and converting each key and value vector once for all of them (a long prompt's
/// attention is then bound by arithmetic, not by re-reading its keys per query). `out`
/// holds the queries' outputs one after another; `scores` is scratch.
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    queries: &[Query<'_>],
    table: &[u32],
    pool: &KvPool,
    h: HeadSpec,
    scoring: Scoring,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    attend_group_on(isa(), queries, table, pool, h, scoring, out, scores)
}

/// [`attend_group`] on a given instruction set.
#[allow(clippy::too_many_arguments)]
fn attend_group_on(
    path: Isa,
    queries: &[Query<'_>],
    table: &[u32],
    pool: &KvPool,
    h: HeadSpec,
    scoring: Scoring,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let (m, hd, bt) = (queries.len(), h.head_dim, pool.block_tokens());
    // A latent pool's values are the leading `vd` dims of its keys; otherwise `vd = hd`.
    let latent = pool.shape().latent;
    let vd = out.len() / m.max(1);
    assert!(
        (1..=MAX_GROUP).contains(&m) && out.len() == m * vd && (vd == hd || (latent && vd < hd)),
        "a group of {m} queries"
    );
    assert!(path.available(), "{path} cannot run here");
    // The kernels' shapes: AVX-512 takes 16 positions and 32 output columns at a time,
    // AVX2 8 and 8.
    let wide = match path {
        _ if !cfg!(target_arch = "x86_64") => None,
        Isa::Avx512 if bt.is_multiple_of(16) && hd.is_multiple_of(32) => Some(true),
        i if i.is_simd() && bt.is_multiple_of(8) && hd.is_multiple_of(8) => Some(false),
        _ => None,
    };
    let Some(wide) = wide else {
        for (q, o) in queries.iter().zip(out.chunks_exact_mut(vd)) {
            attend_scalar(q.q, q.span.clone(), table, pool, h, scoring, o, scores);
        }
        return;
    };
    let shape = pool.shape();
    assert!(
        queries.iter().all(|q| q.q.len() == hd && q.span.start < q.span.end)
            && hd == shape.head_dim
            && h.kv_dim == shape.kv_dim()
            && h.kv_head < shape.kv_heads,
        "attention head shape does not match the KV pool"
    );
    let lo = queries.iter().map(|q| q.span.start).min().unwrap_or(0);
    let hi = queries.iter().map(|q| q.span.end).max().unwrap_or(0);
    assert!(table.len() * bt >= hi, "the block table does not cover {hi} positions");
    let first = lo / bt;
    let blocks = &table[first..hi.div_ceil(bt)];
    let base = first * bt;
    let width = blocks.len() * bt;
    scores.clear();
    scores.resize(m * width, 0.0);
    let qs: Vec<&[f32]> = queries.iter().map(|q| q.q).collect();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the ISA was checked above; every block of `blocks` is in the pool (its
    // sections are `kv_dim · bt` long), `hd` and `bt` are multiples of the kernels'
    // widths (above), and `scores` holds `m · width`.
    unsafe {
        x86::group_scores(&qs, scoring.scale, blocks, pool, h, scores, width, wide)
    };
    // Each query's softmax over its own span; weights outside it are zero.
    for (q, row) in queries.iter().zip(scores.chunks_exact_mut(width)) {
        let (a, b) = (q.span.start - base, q.span.end - base);
        let live = &mut row[a..b];
        if let Some(cap) = scoring.softcap {
            soft_cap(live, cap);
        }
        let max = live.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let inv = 1.0 / exp_shifted_sum(live, max);
        live.iter_mut().for_each(|p| *p *= inv);
        row[..a].fill(0.0);
        row[b..].fill(0.0);
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as above; `out` holds `m · hd` (`m · vd` for a latent pool, `vd < hd`).
    unsafe {
        match latent {
            true => x86::latent_values(scores, width, hi - base, blocks, pool, h, out),
            false => x86::group_values(scores, width, hi - base, blocks, pool, h, out, wide),
        }
    };
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

    /// 16 stored elements from `at` as f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn load16(s: KvSlice<'_>, at: usize) -> __m512 {
        match s {
            KvSlice::F16(d) => _mm512_cvtph_ps(_mm256_loadu_si256(d.as_ptr().add(at) as *const __m256i)),
            KvSlice::F32(d) => _mm512_loadu_ps(d.as_ptr().add(at)),
        }
    }

    /// Scores of `qs` (M queries) over every position of `blocks`: `scores[m·width + j]`.
    /// Each query's sums run in the same order whatever the group (no accumulators split by
    /// group size): a row's result does not depend on which rows share its step, so
    /// speculative verification gives the tokens plain decoding gives.
    ///
    /// # Safety
    /// AVX2/FMA/F16C (AVX-512 F/BW/VL with `wide`); `head_dim` and the block length
    /// multiples of 32 and 16 with `wide`, of 8 without; `scores` holds `qs.len() · width`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn group_scores(
        qs: &[&[f32]],
        scale: f32,
        blocks: &[u32],
        pool: &KvPool,
        h: HeadSpec,
        scores: &mut [f32],
        width: usize,
        wide: bool,
    ) {
        macro_rules! run {
            ($($m:literal)*) => {
                match (qs.len(), wide) {
                    $(($m, true) => scores_m512::<$m>(qs, scale, blocks, pool, h, scores, width),
                      ($m, false) => scores_m256::<$m>(qs, scale, blocks, pool, h, scores, width),)*
                    _ => unreachable!("group sizes are 1..=MAX_GROUP"),
                }
            };
        }
        run!(1 2 3 4 5 6 7 8 9 10 11 12)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn scores_m512<const M: usize>(
        qs: &[&[f32]],
        scale: f32,
        blocks: &[u32],
        pool: &KvPool,
        h: HeadSpec,
        scores: &mut [f32],
        width: usize,
    ) {
        let (bt, hd) = (pool.block_tokens(), h.head_dim);
        let kt_off = h.kv_head * hd * bt;
        let sc = _mm512_set1_ps(scale);
        for (bi, &block) in blocks.iter().enumerate() {
            let keys = pool.keys(block, h.layer);
            for part in 0..bt / 16 {
                let base = kt_off + 16 * part;
                let mut acc = [_mm512_setzero_ps(); M];
                for i in 0..hd {
                    let k = load16(keys, base + i * bt);
                    for (a, q) in acc.iter_mut().zip(qs) {
                        *a = _mm512_fmadd_ps(_mm512_set1_ps(*q.get_unchecked(i)), k, *a);
                    }
                }
                for (m, a) in acc.iter().enumerate() {
                    let dst = scores.as_mut_ptr().add(m * width + bi * bt + 16 * part);
                    _mm512_storeu_ps(dst, _mm512_mul_ps(*a, sc));
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores_m256<const M: usize>(
        qs: &[&[f32]],
        scale: f32,
        blocks: &[u32],
        pool: &KvPool,
        h: HeadSpec,
        scores: &mut [f32],
        width: usize,
    ) {
        let (bt, hd) = (pool.block_tokens(), h.head_dim);
        let kt_off = h.kv_head * hd * bt;
        let sc = _mm256_set1_ps(scale);
        for (bi, &block) in blocks.iter().enumerate() {
            let keys = pool.keys(block, h.layer);
            for part in 0..bt / 8 {
                let base = kt_off + 8 * part;
                let mut acc = [_mm256_setzero_ps(); M];
                for i in 0..hd {
                    let k = load8(keys, base + i * bt);
                    for (a, q) in acc.iter_mut().zip(qs) {
                        *a = _mm256_fmadd_ps(_mm256_set1_ps(*q.get_unchecked(i)), k, *a);
                    }
                }
                for (m, a) in acc.iter().enumerate() {
                    let dst = scores.as_mut_ptr().add(m * width + bi * bt + 8 * part);
                    _mm256_storeu_ps(dst, _mm256_mul_ps(*a, sc));
                }
            }
        }
    }

    /// `out[m] = Σⱼ p[m][j] · V[j]` over the first `n` positions of `blocks` (weights
    /// already normalized), [`VALUE_CHUNK`] positions at a time and, within a chunk, 32
    /// output columns at a time (8 without `wide`). The sums live in `out` between chunks
    /// (an exact round trip), so each output is the same chain of fused multiply-adds in
    /// position order as one pass over every position: the same bits.
    ///
    /// # Safety
    /// As [`group_scores`]; `out` holds `M · head_dim`, `p` holds `M · width`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn group_values(
        p: &[f32],
        width: usize,
        n: usize,
        blocks: &[u32],
        pool: &KvPool,
        h: HeadSpec,
        out: &mut [f32],
        wide: bool,
    ) {
        macro_rules! run {
            ($($m:literal)*) => {
                match (out.len() / h.head_dim, wide) {
                    $(($m, true) => values_m512::<$m>(p, width, n, blocks, pool, h, out),
                      ($m, false) => values_m256::<$m>(p, width, n, blocks, pool, h, out),)*
                    _ => unreachable!("group sizes are 1..=MAX_GROUP"),
                }
            };
        }
        run!(1 2 3 4 5 6 7 8 9 10 11 12)
    }

    /// `out[m][i] = Σⱼ p[m][j] · K[i][j]` over the first `n` positions of `blocks`, for the
    /// leading `out.len() / M` dims of a latent pool's keys (stored `[dim][slot]`, so each
    /// dim is a dot product over contiguous positions). Slots past `n` are never read: they
    /// may hold another sequence's stale values (an infinity times a zero weight is NaN).
    ///
    /// # Safety
    /// AVX2/FMA/F16C; the block length a multiple of 8; `p` holds `M · width`, `width`
    /// covering every position of `blocks`; `out.len() / M ≤ head_dim` and `kv_head` is a
    /// head of the pool.
    pub unsafe fn latent_values(
        p: &[f32],
        width: usize,
        n: usize,
        blocks: &[u32],
        pool: &KvPool,
        h: HeadSpec,
        out: &mut [f32],
    ) {
        macro_rules! run {
            ($($m:literal)*) => {
                match p.len() / width {
                    $($m => latent_values_m::<$m>(p, width, n, blocks, pool, h, out),)*
                    _ => unreachable!("group sizes are 1..=MAX_GROUP"),
                }
            };
        }
        run!(1 2 3 4 5 6 7 8 9 10 11 12)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn latent_values_m<const M: usize>(
        p: &[f32],
        width: usize,
        n: usize,
        blocks: &[u32],
        pool: &KvPool,
        h: HeadSpec,
        out: &mut [f32],
    ) {
        let bt = pool.block_tokens();
        let vd = out.len() / M;
        let off = h.kv_head * h.head_dim * bt;
        for i in 0..vd {
            let mut acc = [_mm256_setzero_ps(); M];
            for (bi, &block) in blocks.iter().enumerate() {
                let k = pool.keys(block, h.layer);
                let live = (n - bi * bt).min(bt);
                // Chunks wholly past `n` would add exact zeros: skipped. The partial one has
                // its dead lanes zeroed (their weights are zero too), so every row's sum runs
                // in the same order whatever its group's `n`: a row's result never depends
                // on the rows beside it.
                for part in 0..live.div_ceil(8) {
                    let lanes = _mm256_cmpgt_epi32(
                        _mm256_set1_epi32((live - 8 * part) as i32),
                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                    );
                    let kv = _mm256_and_ps(load8(k, off + i * bt + 8 * part), _mm256_castsi256_ps(lanes));
                    let j = bi * bt + 8 * part;
                    for (m, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(_mm256_loadu_ps(p.as_ptr().add(m * width + j)), kv, *a);
                    }
                }
            }
            for (m, a) in acc.iter().enumerate() {
                let hi = _mm256_extractf128_ps(*a, 1);
                let s4 = _mm_add_ps(_mm256_castps256_ps128(*a), hi);
                let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
                let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
                *out.get_unchecked_mut(m * vd + i) = _mm_cvtss_f32(s1);
            }
        }
    }

    /// Positions per pass of the value kernels: a chunk's weights (`M` rows, at most 6 KiB)
    /// stay in L1 across the output column passes. Unchunked, each column pass streamed a
    /// long context's whole weight rows again from L3 (12 rows of a 30,000-position prefill
    /// are 1.4 MB).
    const VALUE_CHUNK: usize = 128;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn values_m512<const M: usize>(
        p: &[f32],
        width: usize,
        n: usize,
        blocks: &[u32],
        pool: &KvPool,
        h: HeadSpec,
        out: &mut [f32],
    ) {
        let (bt, hd) = (pool.block_tokens(), h.head_dim);
        let off = h.kv_head * hd;
        out[..M * hd].fill(0.0);
        let per = (VALUE_CHUNK / bt).max(1);
        let blocks = &blocks[..n.div_ceil(bt)];
        for (b0, chunk) in (0..).step_by(per).zip(blocks.chunks(per)) {
            for c0 in (0..hd).step_by(32) {
                let mut acc = [[_mm512_setzero_ps(); 2]; M];
                for (m, a) in acc.iter_mut().enumerate() {
                    let src = out.as_ptr().add(m * hd + c0);
                    *a = [_mm512_loadu_ps(src), _mm512_loadu_ps(src.add(16))];
                }
                for (k, &block) in chunk.iter().enumerate() {
                    let bi = b0 + k;
                    let v = pool.values(block, h.layer);
                    for slot in 0..(n - bi * bt).min(bt) {
                        let row = slot * h.kv_dim + off + c0;
                        let (v0, v1) = (load16(v, row), load16(v, row + 16));
                        let j = bi * bt + slot;
                        for (m, a) in acc.iter_mut().enumerate() {
                            let w = _mm512_set1_ps(*p.get_unchecked(m * width + j));
                            a[0] = _mm512_fmadd_ps(w, v0, a[0]);
                            a[1] = _mm512_fmadd_ps(w, v1, a[1]);
                        }
                    }
                }
                for (m, a) in acc.iter().enumerate() {
                    let dst = out.as_mut_ptr().add(m * hd + c0);
                    _mm512_storeu_ps(dst, a[0]);
                    _mm512_storeu_ps(dst.add(16), a[1]);
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values_m256<const M: usize>(
        p: &[f32],
        width: usize,
        n: usize,
        blocks: &[u32],
        pool: &KvPool,
        h: HeadSpec,
        out: &mut [f32],
    ) {
        // One register of output columns per query: M accumulators fit the 16 registers.
        let (bt, hd) = (pool.block_tokens(), h.head_dim);
        let off = h.kv_head * hd;
        out[..M * hd].fill(0.0);
        let per = (VALUE_CHUNK / bt).max(1);
        let blocks = &blocks[..n.div_ceil(bt)];
        for (b0, chunk) in (0..).step_by(per).zip(blocks.chunks(per)) {
            for c0 in (0..hd).step_by(8) {
                let mut acc = [_mm256_setzero_ps(); M];
                for (m, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(out.as_ptr().add(m * hd + c0));
                }
                for (k, &block) in chunk.iter().enumerate() {
                    let bi = b0 + k;
                    let v = pool.values(block, h.layer);
                    for slot in 0..(n - bi * bt).min(bt) {
                        let v0 = load8(v, slot * h.kv_dim + off + c0);
                        let j = bi * bt + slot;
                        for (m, a) in acc.iter_mut().enumerate() {
                            *a = _mm256_fmadd_ps(_mm256_set1_ps(*p.get_unchecked(m * width + j)), v0, *a);
                        }
                    }
                }
                for (m, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.as_mut_ptr().add(m * hd + c0), *a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::tests::Lcg;
    use crate::kv::pool::{KvDtype, KvShape};

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
                    latent: false,
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

    /// A latent pool (one "key" per position, values its leading dims): every path and
    /// group size gives the f64 reference's output, `softmax(q·k)·k[..vd]`.
    #[test]
    fn latent_pools_read_values_from_their_keys() {
        let mut rng = Lcg(11);
        for path in Isa::all_available() {
            for (hd, vd, bt) in [(320usize, 256usize, 16usize), (576, 512, 16), (40, 32, 8)] {
                let shape = KvShape {
                    n_layers: 2,
                    kv_heads: 1,
                    head_dim: hd,
                    block_tokens: bt,
                    latent: true,
                };
                let mut pool = KvPool::new(shape, KvDtype::F32, 8);
                assert_eq!(
                    KvPool::block_bytes(shape, KvDtype::F32),
                    2 * bt * hd * 4,
                    "no value section"
                );
                let table: Vec<u32> = vec![6, 1, 4, 7, 0];
                let n = 4 * bt + 3;
                let keys: Vec<Vec<f32>> = (0..n).map(|_| (0..hd).map(|_| rng.next_f32()).collect()).collect();
                for (p, k) in keys.iter().enumerate() {
                    pool.write(table[p / bt], p % bt, 1, k, &[]);
                }
                // The last block's unused slots hold another sequence's garbage: never read.
                for p in n..table.len() * bt {
                    pool.write(table[p / bt], p % bt, 1, &vec![f32::INFINITY; hd], &[]);
                }
                for m in [1, 5, MAX_GROUP] {
                    let qs: Vec<Vec<f32>> = (0..m).map(|_| (0..hd).map(|_| rng.next_f32()).collect()).collect();
                    let queries: Vec<Query<'_>> = qs
                        .iter()
                        .enumerate()
                        .map(|(i, q)| Query { q, span: 0..n - i % 3 })
                        .collect();
                    let spec = HeadSpec {
                        layer: 1,
                        kv_head: 0,
                        head_dim: hd,
                        kv_dim: hd,
                    };
                    let mut out = vec![0f32; m * vd];
                    attend_group_on(
                        path,
                        &queries,
                        &table,
                        &pool,
                        spec,
                        Scoring::plain(hd),
                        &mut out,
                        &mut Vec::new(),
                    );
                    for (q, o) in queries.iter().zip(out.chunks_exact(vd)) {
                        let s: Vec<f64> = q
                            .span
                            .clone()
                            .map(|p| {
                                (0..hd).map(|i| q.q[i] as f64 * keys[p][i] as f64).sum::<f64>() / (hd as f64).sqrt()
                            })
                            .collect();
                        let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                        let z: f64 = e.iter().sum();
                        for i in 0..vd {
                            let want: f64 = q.span.clone().map(|p| e[p] / z * keys[p][i] as f64).sum();
                            assert!(
                                (o[i] as f64 - want).abs() < 1e-4,
                                "{path} hd={hd} m={m} i={i}: {} vs {want}",
                                o[i]
                            );
                        }
                    }
                }
            }
        }
    }

    /// The value kernels walk a long context in chunks, keeping their sums in the output
    /// between chunks; each output element is still exactly one fused multiply-add chain in
    /// position order (what a pass over every position at once computes), bit for bit, on
    /// spans of many chunks that end mid-block and mid-chunk.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn value_kernels_sum_each_output_in_position_order() {
        let mut rng = Lcg(23);
        let paths = Isa::all_available();
        let wides: Vec<bool> = [false, true]
            .into_iter()
            .filter(|&w| match w {
                true => paths.contains(&Isa::Avx512),
                false => paths.contains(&Isa::Avx2),
            })
            .collect();
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let (hd, bt, kv_heads) = (64usize, 16usize, 2usize);
            let kv_dim = kv_heads * hd;
            let shape = KvShape {
                n_layers: 1,
                kv_heads,
                head_dim: hd,
                block_tokens: bt,
                latent: false,
            };
            let blocks_n = 45;
            let mut pool = KvPool::new(shape, dtype, blocks_n);
            // The sequence's blocks scattered through the pool.
            let table: Vec<u32> = (0..blocks_n as u32).map(|i| (i * 17) % blocks_n as u32).collect();
            for p in 0..blocks_n * bt {
                let k: Vec<f32> = (0..kv_dim).map(|_| rng.next_f32()).collect();
                let v: Vec<f32> = (0..kv_dim).map(|_| rng.next_f32() * 2.0).collect();
                pool.write(table[p / bt], p % bt, 0, &k, &v);
            }
            let spec = HeadSpec {
                layer: 0,
                kv_head: 1,
                head_dim: hd,
                kv_dim,
            };
            for &wide in &wides {
                for (m, first, n) in [(1usize, 0usize, 44 * bt + 7), (5, 3, 700 - 3 * bt), (12, 1, 41 * bt)] {
                    let blocks = &table[first..first + n.div_ceil(bt)];
                    let width = blocks.len() * bt;
                    let p: Vec<f32> = (0..m * width).map(|_| rng.next_f32() / n as f32).collect();
                    let mut out = vec![f32::NAN; m * hd];
                    // SAFETY: the ISA is available (above); the pool holds every block,
                    // `hd` and `bt` are multiples of the kernels' widths, `p` is `m · width`.
                    unsafe { x86::group_values(&p, width, n, blocks, &pool, spec, &mut out, wide) };
                    for q in 0..m {
                        for i in 0..hd {
                            let mut want = 0f32;
                            for j in 0..n {
                                let v = pool.values(blocks[j / bt], 0).get((j % bt) * kv_dim + hd + i);
                                want = p[q * width + j].mul_add(v, want);
                            }
                            assert_eq!(
                                out[q * hd + i].to_bits(),
                                want.to_bits(),
                                "{dtype:?} wide={wide} m={m} n={n} query {q} column {i}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A group of queries (1 to MAX_GROUP, each with its own span: causal ends, windows)
    /// gives what the scalar reference gives each query, on every instruction-set path this
    /// CPU runs, for shapes every kernel takes and shapes only some do.
    #[test]
    fn groups_equal_single_queries() {
        let mut rng = Lcg(5);
        for path in Isa::all_available() {
            for (hd, bt) in [
                (64usize, 16usize),
                (128, 16),
                (256, 32),
                (96, 16),
                (80, 16),
                (24, 8),
                (20, 4),
            ] {
                for dtype in [KvDtype::F32, KvDtype::F16] {
                    let kv_heads = 2;
                    let kv_dim = kv_heads * hd;
                    let shape = KvShape {
                        n_layers: 1,
                        kv_heads,
                        head_dim: hd,
                        block_tokens: bt,
                        latent: false,
                    };
                    let mut pool = KvPool::new(shape, dtype, 12);
                    let table: Vec<u32> = vec![3, 7, 1, 10, 0, 5, 8, 2];
                    let n = 6 * bt + 5;
                    for p in 0..n {
                        let k: Vec<f32> = (0..kv_dim).map(|_| rng.next_f32() * 2.0).collect();
                        let v: Vec<f32> = (0..kv_dim).map(|_| rng.next_f32() * 2.0).collect();
                        pool.write(table[p / bt], p % bt, 0, &k, &v);
                    }
                    for m in 1..=MAX_GROUP {
                        let qs: Vec<Vec<f32>> = (0..m).map(|_| (0..hd).map(|_| rng.next_f32()).collect()).collect();
                        // Consecutive rows ending near n, some windowed.
                        let spans: Vec<_> = (0..m)
                            .map(|i| {
                                let end = n - (m - 1 - i) / 2;
                                let start = if i % 3 == 1 { end.saturating_sub(bt + 3) } else { 0 };
                                start..end
                            })
                            .collect();
                        let queries: Vec<Query<'_>> = qs
                            .iter()
                            .zip(&spans)
                            .map(|(q, sp)| Query { q, span: sp.clone() })
                            .collect();
                        let spec = HeadSpec {
                            layer: 0,
                            kv_head: 1,
                            head_dim: hd,
                            kv_dim,
                        };
                        let scoring = Scoring {
                            softcap: (m % 2 == 0).then_some(3.0),
                            ..Scoring::plain(hd)
                        };
                        let mut out = vec![0f32; m * hd];
                        attend_group_on(path, &queries, &table, &pool, spec, scoring, &mut out, &mut Vec::new());
                        for (i, q) in queries.iter().enumerate() {
                            // Alone, the query gives the same bits as in the group: a row's
                            // result never depends on the rows beside it.
                            let mut alone = vec![0f32; hd];
                            let one = &queries[i..=i];
                            attend_group_on(path, one, &table, &pool, spec, scoring, &mut alone, &mut Vec::new());
                            assert_eq!(alone, out[i * hd..(i + 1) * hd], "{path} hd={hd} m={m} query {i} alone");
                            let mut want = vec![0f32; hd];
                            let (span, scratch) = (q.span.clone(), &mut Vec::new());
                            attend_scalar(q.q, span, &table, &pool, spec, scoring, &mut want, scratch);
                            for (a, b) in out[i * hd..(i + 1) * hd].iter().zip(&want) {
                                assert!((a - b).abs() < 1e-5, "{path} hd={hd} m={m} query {i}: {a} vs {b}");
                            }
                        }
                    }
                }
            }
        }
    }
}
