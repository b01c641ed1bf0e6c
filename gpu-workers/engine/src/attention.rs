//! Attention over the paged KV cache: one query head against positions `0..n` of a
//! sequence, read through its block table.

use crate::kernels::{axpy, dot_f32};
use crate::kv::KvPool;

/// Where one head's keys and values live.
#[derive(Debug, Clone, Copy)]
pub struct HeadSpec {
    pub layer: usize,
    /// KV head (query heads are grouped onto KV heads).
    pub kv_head: usize,
    pub head_dim: usize,
    pub kv_dim: usize,
}

/// `out = softmax(q·Kᵀ / √d) · V` over the first `n` positions of the sequence whose blocks
/// are `table`. `scores` is scratch.
pub fn attend_head(
    q: &[f32],
    n: usize,
    table: &[u32],
    pool: &KvPool,
    h: HeadSpec,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let bt = pool.block_tokens();
    let (hd, off) = (h.head_dim, h.kv_head * h.head_dim);
    let scale = 1.0 / (hd as f32).sqrt();
    scores.clear();
    for (bi, &block) in table.iter().enumerate().take(n.div_ceil(bt)) {
        let keys = pool.keys(block, h.layer);
        let here = (n - bi * bt).min(bt);
        for slot in 0..here {
            scores.push(dot_f32(q, &keys[slot * h.kv_dim + off..][..hd]) * scale);
        }
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    out.fill(0.0);
    for (bi, &block) in table.iter().enumerate().take(n.div_ceil(bt)) {
        let values = pool.values(block, h.layer);
        let here = (n - bi * bt).min(bt);
        for slot in 0..here {
            axpy(
                scores[bi * bt + slot] * inv,
                &values[slot * h.kv_dim + off..][..hd],
                out,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::tests::Lcg;

    /// Paged attention equals attention over contiguous K/V, on random data with the
    /// sequence's blocks scattered through the pool.
    #[test]
    fn paged_equals_contiguous_reference() {
        let mut rng = Lcg(11);
        let (layers, kv_heads, hd, bt) = (2, 3, 8, 4);
        let kv_dim = kv_heads * hd;
        let mut pool = KvPool::new(layers, kv_dim, bt, 16);
        let table: Vec<u32> = vec![9, 2, 14, 5, 0, 11];
        for n in [1usize, 3, 4, 5, 17, 24] {
            let mut keys = vec![vec![0f32; kv_dim]; n];
            let mut vals = vec![vec![0f32; kv_dim]; n];
            for p in 0..n {
                for x in keys[p].iter_mut().chain(vals[p].iter_mut()) {
                    *x = rng.next_f32();
                }
                pool.write(table[p / bt], p % bt, 1, &keys[p], &vals[p]);
            }
            let q: Vec<f32> = (0..hd).map(|_| rng.next_f32()).collect();
            for g in 0..kv_heads {
                let mut out = vec![0f32; hd];
                let spec = HeadSpec {
                    layer: 1,
                    kv_head: g,
                    head_dim: hd,
                    kv_dim,
                };
                attend_head(&q, n, &table, &pool, spec, &mut out, &mut Vec::new());
                // Reference, in f64 over contiguous rows.
                let s: Vec<f64> = (0..n)
                    .map(|p| {
                        (0..hd).map(|i| q[i] as f64 * keys[p][g * hd + i] as f64).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..hd {
                    let want: f64 = (0..n).map(|p| e[p] / z * vals[p][g * hd + i] as f64).sum();
                    assert!(
                        (out[i] as f64 - want).abs() < 1e-5,
                        "n={n} g={g} i={i}: {} vs {want}",
                        out[i]
                    );
                }
            }
        }
    }
}
