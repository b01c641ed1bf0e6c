//! `hearth bench attention`: the attention kernels alone on one thread, over a synthetic
//! paged KV cache of f16 keys and values — one query per call ([`attend_head`], what a
//! kernel without grouping does) against a group of queries sharing each key and value read
//! ([`attend_group`]: a GQA group's heads × consecutive rows, as the engine calls it), for
//! decode-shaped work (one row, a group's heads) and prefill-shaped work (a chunk of
//! consecutive rows), at several context lengths and head sizes.

use std::time::Instant;

use serde::Serialize;

use hearth_engine::attention::{attend_group, attend_head, HeadSpec, Query, Scoring, MAX_GROUP};
use hearth_engine::kernels::isa;
use hearth_engine::kv::pool::{KvDtype, KvPool, KvShape};

#[derive(Debug, Clone, Serialize)]
pub struct AttentionRow {
    pub shape: String,
    pub head_dim: usize,
    pub group: usize,
    pub rows: usize,
    pub context: usize,
    /// GFLOP/s of the q·k and p·v products (4·head_dim flops per query and position).
    pub per_head_gflop_s: f64,
    pub grouped_gflop_s: f64,
    pub speedup: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct AttentionReport {
    pub isa: String,
    pub rows: Vec<AttentionRow>,
}

impl AttentionReport {
    pub fn table(&self) -> String {
        let mut s = format!("attention kernels, one thread, f16 KV, isa {}\n", self.isa);
        s.push_str(&format!(
            "{:<10}{:>6}{:>7}{:>6}{:>9}{:>16}{:>15}{:>9}\n",
            "shape", "head", "group", "rows", "context", "1 query GF/s", "grouped GF/s", "ratio"
        ));
        for r in &self.rows {
            s.push_str(&format!(
                "{:<10}{:>6}{:>7}{:>6}{:>9}{:>16.1}{:>15.1}{:>8.2}x\n",
                r.shape, r.head_dim, r.group, r.rows, r.context, r.per_head_gflop_s, r.grouped_gflop_s, r.speedup
            ));
        }
        s
    }
}

/// One measurement: `rows` consecutive rows ending at `context`, `group` query heads on one
/// KV head, timed both ways for at least `min_s` seconds each.
fn measure(head_dim: usize, group: usize, rows: usize, context: usize, min_s: f64) -> AttentionRow {
    let bt = hearth_protocol::DEFAULT_BLOCK_TOKENS;
    let shape = KvShape {
        n_layers: 1,
        kv_heads: 1,
        head_dim,
        block_tokens: bt,
        latent: false,
    };
    let blocks = context.div_ceil(bt);
    let mut pool = KvPool::new(shape, KvDtype::F16, blocks);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    // Values in [-1, 1) from a fixed sequence (the kernels' speed does not depend on them).
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    for p in 0..context {
        let k: Vec<f32> = (0..head_dim).map(|_| next()).collect();
        let v: Vec<f32> = (0..head_dim).map(|_| next()).collect();
        pool.write(table[p / bt], p % bt, 0, &k, &v);
    }
    let qs: Vec<Vec<f32>> = (0..rows * group)
        .map(|_| (0..head_dim).map(|_| next()).collect())
        .collect();
    let spans: Vec<_> = (0..rows * group).map(|i| 0..context - rows + 1 + i / group).collect();
    let spec = HeadSpec {
        layer: 0,
        kv_head: 0,
        head_dim,
        kv_dim: head_dim,
    };
    let scoring = Scoring {
        scale: 1.0 / (head_dim as f32).sqrt(),
        softcap: None,
    };
    let flops: f64 = spans.iter().map(|s| (4 * head_dim * s.len()) as f64).sum();
    let mut scores = Vec::new();
    let mut out = vec![0f32; rows * group * head_dim];
    let time = |f: &mut dyn FnMut()| {
        f();
        let (t, mut n) = (Instant::now(), 0u32);
        while n < 3 || t.elapsed().as_secs_f64() < min_s {
            f();
            n += 1;
        }
        flops * n as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let per_head = time(&mut || {
        for ((q, span), o) in qs.iter().zip(&spans).zip(out.chunks_exact_mut(head_dim)) {
            attend_head(q, span.clone(), &table, &pool, spec, scoring, o, &mut scores);
        }
    });
    let grouped = time(&mut || {
        let queries: Vec<Query<'_>> = qs
            .iter()
            .zip(&spans)
            .map(|(q, span)| Query { q, span: span.clone() })
            .collect();
        for (tile, o) in queries.chunks(MAX_GROUP).zip(out.chunks_mut(MAX_GROUP * head_dim)) {
            attend_group(tile, &table, &pool, spec, scoring, o, &mut scores);
        }
    });
    AttentionRow {
        shape: if rows == 1 { "decode" } else { "prefill" }.into(),
        head_dim,
        group,
        rows,
        context,
        per_head_gflop_s: per_head,
        grouped_gflop_s: grouped,
        speedup: grouped / per_head,
    }
}

/// Decode (one row) and prefill (48 consecutive rows) at 1k–32k positions, heads of 64,
/// 128 and 256, GQA groups of 1, 3 and 4.
pub fn run(quick: bool) -> AttentionReport {
    let min_s = if quick { 0.05 } else { 0.4 };
    let contexts: &[usize] = if quick {
        &[1024, 4096]
    } else {
        &[1024, 4096, 16384, 32768]
    };
    let mut rows = Vec::new();
    for &(head_dim, group) in &[(64, 3), (128, 4), (256, 2), (96, 1)] {
        for &context in contexts {
            rows.push(measure(head_dim, group, 1, context, min_s));
            rows.push(measure(head_dim, group, 48, context, min_s));
        }
    }
    AttentionReport {
        isa: isa().to_string(),
        rows,
    }
}
