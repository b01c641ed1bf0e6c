//! Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), computed in its absorbed form.
//!
//! Each position's keys and values are one normalized latent vector `c` (`kv_lora_rank`
//! wide) decompressed per head (`k_nope = W_kb·c`, `v = W_vb·c`), plus one RoPE key `k_pe`
//! shared by every head. The KV cache stores `[c | k_pe]` and nothing else — one
//! `kv_lora_rank + qk_rope` vector per position and layer, against
//! `heads · (qk_nope + qk_rope + v_head)` for the same model with full attention
//! (DeepSeek-V3: 576 against 40,960 values, 1/71).
//!
//! Attention never decompresses the cache. The key's decompression is absorbed into the
//! query — `q_nope·(W_kb·c) = (W_kbᵀ·q_nope)·c` — and the value's applied after the
//! weighted sum — `Σ p·(W_vb·c) = W_vb·(Σ p·c)` — so every head is a query of
//! `kv_lora_rank + qk_rope` against the one cached vector per position (multi-query
//! attention over the latent pool, [`crate::kv::pool::KvShape::latent`]), whose output is the
//! latent's weighted sum, decompressed once per head and row:
//!
//! ```text
//! q        = h·Wq  |  rmsnorm(h·Wq_a)·Wq_b          per head [q_nope | q_pe]
//! [c|k_pe] = h·Wkv_a;  c = rmsnorm(c);  k_pe, q_pe = rope(k_pe), rope(q_pe)
//! cache    ← [c | k_pe]
//! query    = [W_kb,hᵀ·q_nope,h | q_pe,h]            per head
//! o_h      = W_vb,h · Σ softmax(scale · query·[c|k_pe]) · c
//! ```

use crate::formats::gguf::GgufFile;
use crate::kernels::{matmul, rms_norm_in_place};
use crate::kv::pool::KvPool;

use super::layers::{matrices_3d, matrix, norm, Matrix, Tile};
use super::rope;
use super::transformer::Batch;
use super::{ForwardScratch, MlaSpec, Model, ModelConfig, ModelError};

/// How queries are projected.
#[derive(Debug)]
enum Queries {
    /// `h·Wq` (DeepSeek-V2-Lite).
    Direct(Matrix),
    /// Through a low-rank bottleneck: `rmsnorm(h·Wq_a)·Wq_b`.
    Compressed { a: Matrix, norm: Vec<f32>, b: Matrix },
}

/// One layer's latent attention weights.
#[derive(Debug)]
pub(crate) struct Latent {
    q: Queries,
    /// `h` to `[c | k_pe]`.
    kv_a: Matrix,
    kv_norm: Vec<f32>,
    /// Per head: the latent to the head's key without RoPE (`kv_lora_rank × qk_nope`,
    /// applied transposed to the query).
    k_b: Vec<Matrix>,
    /// Per head: the latent to the head's value (`v_head × kv_lora_rank`).
    v_b: Vec<Matrix>,
    spec: MlaSpec,
}

impl Latent {
    pub(super) fn load(file: &GgufFile, c: &ModelConfig, m: &MlaSpec, l: usize) -> Result<Self, ModelError> {
        let (d, nh) = (c.d_model, c.n_heads);
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        if file.tensor(&n("attn_kv_b")).is_some() {
            return Err(ModelError::Config(
                "this deepseek2 file has the old attn_kv_b tensor; convert it again with a current convert_hf_to_gguf.py (it writes attn_k_b and attn_v_b)".into(),
            ));
        }
        let kh = m.qk_nope + m.qk_rope;
        let q = match m.q_lora_rank {
            0 => Queries::Direct(matrix(file, &n("attn_q"), nh * kh, d)?),
            r => Queries::Compressed {
                a: matrix(file, &n("attn_q_a"), r, d)?,
                norm: norm(file, &n("attn_q_a_norm"), r, c.norm_shift)?,
                b: matrix(file, &n("attn_q_b"), nh * kh, r)?,
            },
        };
        Ok(Self {
            q,
            kv_a: matrix(file, &n("attn_kv_a_mqa"), m.latent_dim(), d)?,
            kv_norm: norm(file, &n("attn_kv_a_norm"), m.kv_lora_rank, c.norm_shift)?,
            k_b: matrices_3d(file, &n("attn_k_b"), nh, m.kv_lora_rank, m.qk_nope)?,
            v_b: matrices_3d(file, &n("attn_v_b"), nh, m.v_head, m.kv_lora_rank)?,
            spec: *m,
        })
    }

    pub(super) fn matrices(&self) -> Vec<&Matrix> {
        let mut ms: Vec<&Matrix> = match &self.q {
            Queries::Direct(q) => vec![q],
            Queries::Compressed { a, b, .. } => vec![a, b],
        };
        ms.push(&self.kv_a);
        ms.extend(self.k_b.iter().chain(&self.v_b));
        ms
    }

    pub(super) fn matrices_mut(&mut self) -> Vec<&mut Matrix> {
        let mut ms: Vec<&mut Matrix> = match &mut self.q {
            Queries::Direct(q) => vec![q],
            Queries::Compressed { a, b, .. } => vec![a, b],
        };
        ms.push(&mut self.kv_a);
        ms.extend(self.k_b.iter_mut().chain(&mut self.v_b));
        ms
    }

    /// Layer `l`'s attention of every row of `h` into `att` (`heads · v_head` per row),
    /// writing each row's latent into the pool first.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        model: &Model,
        b: &Batch<'_>,
        l: usize,
        h: &[f32],
        rope_table: &[(f32, f32)],
        tiles: &[Tile],
        pool: &mut KvPool,
        att: &mut [f32],
        s: &mut ForwardScratch,
    ) {
        let c = &model.config;
        let m = &self.spec;
        let (t, nh, bt) = (b.tokens.len(), c.n_heads, pool.block_tokens());
        let (kh, ld, r) = (m.qk_nope + m.qk_rope, m.latent_dim(), m.kv_lora_rank);
        let mut q = vec![0f32; t * nh * kh];
        match &self.q {
            Queries::Direct(w) => matmul(&model.view(w), h, &mut q, &mut s.mm),
            Queries::Compressed { a, norm, b: wb } => {
                let mut qa = vec![0f32; t * a.rows];
                matmul(&model.view(a), h, &mut qa, &mut s.mm);
                rms_norm_in_place(&mut qa, norm, c.rms_eps);
                matmul(&model.view(wb), &qa, &mut q, &mut s.mm);
            }
        }
        // Each row's latent and RoPE key, rotated and cached.
        let mut kv = vec![0f32; t * ld];
        matmul(&model.view(&self.kv_a), h, &mut kv, &mut s.mm);
        let mut k_pe: Vec<f32> = kv.chunks_exact(ld).flat_map(|row| row[r..].to_vec()).collect();
        rope::rotate(&mut k_pe, 1, m.qk_rope, c.rope_layout, rope_table);
        for (row, pe) in kv.chunks_exact_mut(ld).zip(k_pe.chunks_exact(m.qk_rope)) {
            rms_norm_in_place(&mut row[..r], &self.kv_norm, c.rms_eps);
            row[r..].copy_from_slice(pe);
        }
        for (i, row) in kv.chunks_exact(ld).enumerate() {
            let p = b.positions[i];
            pool.write(b.tables[i][p / bt], p % bt, l, row, &[]);
        }
        // Every head's query against the latent: [W_kbᵀ·q_nope | rope(q_pe)].
        let mut q_pe: Vec<f32> = q.chunks_exact(kh).flat_map(|head| head[m.qk_nope..].to_vec()).collect();
        rope::rotate(&mut q_pe, nh, m.qk_rope, c.rope_layout, rope_table);
        let mut queries = vec![0f32; t * nh * ld];
        let (mut x, mut y) = (vec![0f32; t * m.qk_nope], vec![0f32; t * r]);
        for (head, k_b) in self.k_b.iter().enumerate() {
            for (i, dst) in x.chunks_exact_mut(m.qk_nope).enumerate() {
                dst.copy_from_slice(&q[(i * nh + head) * kh..][..m.qk_nope]);
            }
            matmul(&model.view(k_b), &x, &mut y, &mut s.mm);
            for (i, src) in y.chunks_exact(r).enumerate() {
                let dst = &mut queries[(i * nh + head) * ld..][..ld];
                dst[..r].copy_from_slice(src);
                dst[r..].copy_from_slice(&q_pe[(i * nh + head) * m.qk_rope..][..m.qk_rope]);
            }
        }
        // The latent's weighted sum per head, then each head's value decompressed.
        let mut lat = vec![0f32; t * nh * r];
        model.attention(b, l, None, tiles, &queries, ld, r, pool, &mut lat);
        let mut v = vec![0f32; t * m.v_head];
        for (head, v_b) in self.v_b.iter().enumerate() {
            for (i, dst) in y.chunks_exact_mut(r).enumerate() {
                dst.copy_from_slice(&lat[(i * nh + head) * r..][..r]);
            }
            matmul(&model.view(v_b), &y, &mut v, &mut s.mm);
            for (i, src) in v.chunks_exact(m.v_head).enumerate() {
                att[(i * nh + head) * m.v_head..][..m.v_head].copy_from_slice(src);
            }
        }
    }
}
