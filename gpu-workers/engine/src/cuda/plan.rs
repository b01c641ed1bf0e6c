//! The CUDA backend's host-side logic, kept free of any CUDA call so that it is built and
//! tested everywhere: the kernels' source, how a forward step's rows become the device's
//! input arrays, which steps replay a CUDA graph, how row-major matrices map onto cuBLAS's
//! column-major GEMM, how weights become f16, and how device memory is shared out.

use crate::kernels::{dequantize_row, WeightView};
use crate::models::{Batch, ModelConfig};

/// The kernels, in CUDA C, compiled at run time by NVRTC (and in CI, see
/// `tests/engine/cuda_kernels.rs`).
pub const KERNELS: &str = include_str!("kernels.cu");

/// Every `extern "C" __global__` entry point in [`KERNELS`] the backend loads.
pub const KERNEL_NAMES: [&str; 6] = [
    "embed_rows",
    "rms_norm_f16",
    "rope_qk",
    "kv_write",
    "attention",
    "silu_mul_f16",
];

/// Warps per block of the `attention` kernel (its `ATT_WARPS`).
pub const ATTENTION_WARPS: u32 = 4;

/// The largest head the `attention` kernel takes (its shared arrays), and the multiple it
/// needs (a lane per 32 elements).
pub const MAX_HEAD_DIM: usize = 128;

/// Decode steps with this many rows or fewer replay a captured CUDA graph, padded up to
/// the next bucket.
pub const GRAPH_BUCKETS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];

/// Whether the model's shape is one the kernels compute (else: a clear error at load).
pub fn check_shape(c: &ModelConfig) -> Result<(), String> {
    if c.head_dim > MAX_HEAD_DIM || !c.head_dim.is_multiple_of(32) {
        return Err(format!(
            "head dimension {} is not supported by the CUDA kernels (a multiple of 32, at most {MAX_HEAD_DIM})",
            c.head_dim
        ));
    }
    if c.q_dim() != c.d_model {
        return Err(format!(
            "{} heads of {} (wider than d_model {}) are not supported by the CUDA kernels",
            c.n_heads, c.head_dim, c.d_model
        ));
    }
    if c.rope_dims != c.head_dim {
        return Err(format!(
            "partial RoPE ({} of {} dimensions) is not supported by the CUDA kernels",
            c.rope_dims, c.head_dim
        ));
    }
    Ok(())
}

/// The graph bucket a step replays: only steps whose every row is sampled (plain decode,
/// one row a sequence, or speculative verification) and that fit the largest bucket
/// at or under `max_rows`. None: run eagerly.
pub fn graph_bucket(rows: usize, logit_rows: &[usize], max_rows: usize) -> Option<usize> {
    if rows == 0 || logit_rows.len() != rows || logit_rows.iter().enumerate().any(|(i, &r)| i != r) {
        return None;
    }
    GRAPH_BUCKETS.into_iter().find(|&b| b >= rows && b <= max_rows)
}

/// A forward step's rows as the kernels read them (all `i32`, padded to `rows`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepInputs {
    pub rows: usize,
    pub tokens: Vec<i32>,
    pub positions: Vec<i32>,
    /// KV slot of each row: `block * block_tokens + slot`.
    pub slots: Vec<i32>,
    /// `rows × table_width` block ids; unused entries are the padding block.
    pub tables: Vec<i32>,
    /// Rows whose logits are wanted (padding rows included when padded for a graph).
    pub logit_rows: Vec<i32>,
}

/// Flattens a step for the device. `pad_block` is the pool's last block, which no
/// sequence owns (real rows' blocks are below it); `pad_to`: pad with rows of token 0 at
/// position 0 in it, each sampled, up to this many rows (graph replay). Refuses a step
/// whose tables do not cover its positions, name a block outside the pool, or are wider
/// than the buffers (`table_width` blocks a row).
pub fn assemble(
    b: &Batch<'_>,
    block_tokens: usize,
    table_width: usize,
    pad_block: u32,
    pad_to: Option<usize>,
) -> Result<StepInputs, String> {
    let t = b.tokens.len();
    if b.positions.len() != t || b.tables.len() != t {
        return Err(format!(
            "a step of {t} tokens has {} positions and {} tables",
            b.positions.len(),
            b.tables.len()
        ));
    }
    if b.logit_rows.iter().any(|&l| l >= t) {
        return Err(format!("a logit row is past the step's {t} rows"));
    }
    let rows = pad_to.unwrap_or(t).max(t);
    let mut s = StepInputs {
        rows,
        tokens: Vec::with_capacity(rows),
        positions: Vec::with_capacity(rows),
        slots: Vec::with_capacity(rows),
        tables: vec![pad_block as i32; rows * table_width],
        logit_rows: b.logit_rows.iter().map(|&r| r as i32).collect(),
    };
    for r in 0..t {
        let (p, table) = (b.positions[r], b.tables[r]);
        let need = p / block_tokens + 1;
        if need > table.len() {
            return Err(format!(
                "row {r}: position {p} is past its block table ({} blocks)",
                table.len()
            ));
        }
        if need > table_width {
            return Err(format!(
                "row {r}: position {p} needs {need} blocks, more than {table_width}"
            ));
        }
        if let Some(b) = table[..need].iter().find(|&&b| b >= pad_block) {
            return Err(format!("row {r}: block {b} is not in the pool ({pad_block} blocks)"));
        }
        s.tokens.push(b.tokens[r] as i32);
        s.positions.push(p as i32);
        s.slots
            .push((table[p / block_tokens] as usize * block_tokens + p % block_tokens) as i32);
        for (dst, &blk) in s.tables[r * table_width..].iter_mut().zip(&table[..need]) {
            *dst = blk as i32;
        }
    }
    for r in t..rows {
        s.tokens.push(0);
        s.positions.push(0);
        s.slots.push((pad_block as usize * block_tokens) as i32);
        s.logit_rows.push(r as i32);
    }
    Ok(s)
}

/// cuBLAS's view of `y[t][out] = x[t][inn] · w[out][inn]ᵀ (+ y)` on row-major buffers: in
/// column-major terms `yᵀ = op(w)·xᵀ` with `w` transposed ("TN").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmDims {
    pub transa: bool,
    pub transb: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub lda: i32,
    pub ldb: i32,
    pub ldc: i32,
}

pub fn gemm_dims(t: usize, out: usize, inn: usize) -> GemmDims {
    GemmDims {
        transa: true,
        transb: false,
        m: out as i32,
        n: t as i32,
        k: inn as i32,
        lda: inn as i32,
        ldb: inn as i32,
        ldc: out as i32,
    }
}

/// A matrix dequantized to f16 (row-major, as the file stores it).
pub fn dequantize_f16(w: &WeightView<'_>) -> Vec<u16> {
    let mut out = Vec::with_capacity(w.rows * w.cols);
    let mut row = vec![0f32; w.cols];
    for r in 0..w.rows {
        dequantize_row(w.ty, w.row(r), &mut row);
        out.extend(row.iter().map(|&v| half::f16::from_f32(v).to_bits()));
    }
    out
}

/// Matrices stacked by rows (`[q; k; v]`, `[gate; up]`): one GEMM computes all of them,
/// each row of its output holding the parts side by side.
pub fn stack_rows(parts: &[Vec<u16>]) -> Vec<u16> {
    parts.concat()
}

/// How many KV blocks the device holds, given the memory still free once the weights and
/// buffers are allocated. `requested_mib`: the operator's size; else half of what is free
/// beyond `headroom` (cuBLAS, graphs, the driver), at most 16 GiB. Errors if not even
/// `min_blocks` fit.
pub fn kv_blocks(
    free_bytes: usize,
    headroom: usize,
    block_bytes: usize,
    requested_mib: Option<usize>,
    min_blocks: usize,
) -> Result<usize, String> {
    let left = free_bytes.saturating_sub(headroom);
    let want = match requested_mib {
        Some(mib) => mib << 20,
        None => (left / 2).min(16 << 30),
    };
    if want > left {
        return Err(format!(
            "a {} MiB KV cache does not fit: {} MiB of device memory are left after the weights and buffers",
            want >> 20,
            left >> 20
        ));
    }
    let blocks = want / block_bytes.max(1);
    if blocks < min_blocks {
        return Err(format!(
            "a KV cache of {blocks} blocks is too small (at least {min_blocks}: one sequence of the model's context)"
        ));
    }
    Ok(blocks)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::formats::gguf::GgmlType;
    use crate::kv::pool::{KvDtype, KvPool, KvShape};

    pub(crate) fn cfg() -> ModelConfig {
        ModelConfig {
            n_layers: 2,
            d_model: 64,
            n_ff: 96,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 32,
            rope_dims: 32,
            rope_theta: 10000.0,
            rms_eps: 1e-5,
            context_length: 64,
            vocab_size: 100,
            rope_layout: Default::default(),
            arch: crate::models::Arch::Llama,
            rope_scaling: Default::default(),
            norm_shift: 0.0,
            block: crate::models::BlockSpec {
                attn_scale: 1.0 / 32f32.sqrt(),
                ..Default::default()
            },
            moe: None,
            mla: None,
        }
    }

    #[test]
    fn every_kernel_name_is_an_entry_point() {
        for name in KERNEL_NAMES {
            assert!(
                KERNELS.contains(&format!("__global__ void {name}(")),
                "{name} is not defined in kernels.cu"
            );
        }
        assert!(KERNELS.contains(&format!("#define ATT_WARPS {ATTENTION_WARPS}")));
        assert!(KERNELS.contains(&format!("__shared__ float q[{MAX_HEAD_DIM}]")));
    }

    #[test]
    fn shapes_the_kernels_cannot_compute_are_refused() {
        assert!(check_shape(&cfg()).is_ok());
        let mut c = cfg();
        c.head_dim = 48;
        assert!(check_shape(&c).unwrap_err().contains("head dimension 48"));
        let mut c = cfg();
        c.head_dim = 256;
        assert!(check_shape(&c).is_err());
        let mut c = cfg();
        c.rope_dims = 16;
        assert!(check_shape(&c).unwrap_err().contains("partial RoPE"));
    }

    #[test]
    fn only_all_sampled_small_steps_replay_a_graph() {
        assert_eq!(graph_bucket(1, &[0], 64), Some(1));
        assert_eq!(graph_bucket(3, &[0, 1, 2], 64), Some(4));
        assert_eq!(graph_bucket(33, &(0..33).collect::<Vec<_>>(), 64), Some(64));
        // Beyond the largest bucket, or the buffers' rows: eager.
        assert_eq!(graph_bucket(65, &(0..65).collect::<Vec<_>>(), 512), None);
        assert_eq!(graph_bucket(20, &(0..20).collect::<Vec<_>>(), 16), None);
        // A prefill chunk samples only its last row: eager.
        assert_eq!(graph_bucket(5, &[4], 64), None);
        assert_eq!(graph_bucket(2, &[1, 0], 64), None);
        assert_eq!(graph_bucket(0, &[], 64), None);
    }

    #[test]
    fn assembled_rows_address_the_pool_as_the_cpu_engine_does() {
        let bt = 16;
        // Sequence A (blocks 7, 3) decoding at position 20; sequence B prefilling 0..3 in block 5.
        let (ta, tb) = ([7u32, 3], [5u32]);
        let tables: Vec<&[u32]> = vec![&ta, &tb, &tb, &tb];
        let batch = Batch {
            tokens: &[11, 12, 13, 14],
            positions: &[20, 0, 1, 2],
            tables: &tables,
            logit_rows: &[0, 3],
            adapters: &[],
        };
        let s = assemble(&batch, bt, 4, 99, None).unwrap();
        assert_eq!(s.rows, 4);
        assert_eq!(s.tokens, [11, 12, 13, 14]);
        assert_eq!(s.slots, [3 * 16 + 4, 5 * 16, 5 * 16 + 1, 5 * 16 + 2]);
        assert_eq!(&s.tables[..4], [7, 3, 99, 99]);
        assert_eq!(&s.tables[4..8], [5, 99, 99, 99]);
        assert_eq!(s.logit_rows, [0, 3]);

        // The slot's index formula (the kernels' `kv_write`) lands where KvPool::write puts
        // the same row, for a key and a value element.
        let shape = KvShape {
            n_layers: 2,
            kv_heads: 2,
            head_dim: 4,
            block_tokens: bt,
            latent: false,
        };
        let mut pool = KvPool::new(shape, KvDtype::F32, 8);
        let kvd = shape.kv_dim();
        let k: Vec<f32> = (0..kvd).map(|i| 100.0 + i as f32).collect();
        let v: Vec<f32> = (0..kvd).map(|i| 200.0 + i as f32).collect();
        pool.write(3, 4, 1, &k, &v);
        let bytes = pool.read_block(3);
        let at = |i: usize| f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
        let (block, slot) = (s.slots[0] as usize / bt, s.slots[0] as usize % bt);
        assert_eq!(block, 3);
        let section = bt * kvd;
        let keys = (block - 3) * 2 * 2 * section + 2 * section; // layer 1 of this block
        for j in 0..kvd {
            let (head, i) = (j / shape.head_dim, j % shape.head_dim);
            assert_eq!(at(keys + head * shape.head_dim * bt + i * bt + slot), k[j]);
            assert_eq!(at(keys + section + slot * kvd + j), v[j]);
        }
    }

    #[test]
    fn padding_fills_a_graph_bucket_with_sampled_rows_in_the_pad_block() {
        let t = [2u32];
        let tables: Vec<&[u32]> = vec![&t, &t, &t];
        let batch = Batch {
            tokens: &[1, 2, 3],
            positions: &[5, 9, 17],
            tables: &tables,
            logit_rows: &[0, 1, 2],
            adapters: &[],
        };
        // Position 17 needs a second block this table lacks.
        assert!(assemble(&batch, 16, 4, 9, Some(4))
            .unwrap_err()
            .contains("past its block table"));
        let t2 = [2u32, 6];
        let tables: Vec<&[u32]> = vec![&t, &t, &t2];
        let batch = Batch {
            tables: &tables,
            ..batch
        };
        let s = assemble(&batch, 16, 2, 9, Some(4)).unwrap();
        assert_eq!(s.rows, 4);
        assert_eq!(s.tokens, [1, 2, 3, 0]);
        assert_eq!(s.positions, [5, 9, 17, 0]);
        assert_eq!(s.slots, [37, 41, 6 * 16 + 1, 9 * 16]);
        assert_eq!(s.tables, [2, 9, 2, 9, 2, 6, 9, 9]);
        assert_eq!(s.logit_rows, [0, 1, 2, 3]);
        // A table wider than the buffers is refused, not truncated.
        assert!(assemble(&batch, 16, 1, 9, None).unwrap_err().contains("more than 1"));
        // A block outside the pool (the padding block or beyond) is refused: on the device
        // it would be a write out of bounds.
        assert!(assemble(&batch, 16, 2, 6, None)
            .unwrap_err()
            .contains("block 6 is not in the pool"));
    }

    /// BLAS's column-major GEMM, by its definition: C = op(A)·op(B) + β·C.
    #[allow(clippy::too_many_arguments)]
    fn blas_gemm(g: GemmDims, a: &[f32], b: &[f32], beta: f32, c: &mut [f32]) {
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let (lda, ldb, ldc) = (g.lda as usize, g.ldb as usize, g.ldc as usize);
        for j in 0..n {
            for i in 0..m {
                let mut s = 0.0;
                for p in 0..k {
                    let av = if g.transa { a[p + i * lda] } else { a[i + p * lda] };
                    let bv = if g.transb { b[j + p * ldb] } else { b[p + j * ldb] };
                    s += av * bv;
                }
                c[i + j * ldc] = s + beta * c[i + j * ldc];
            }
        }
    }

    #[test]
    fn gemm_dims_compute_x_times_w_transposed_on_row_major_buffers() {
        let (t, out, inn) = (3, 5, 4);
        let w: Vec<f32> = (0..out * inn).map(|i| (i as f32 * 0.37).sin()).collect();
        let x: Vec<f32> = (0..t * inn).map(|i| (i as f32 * 0.91).cos()).collect();
        let mut y: Vec<f32> = (0..t * out).map(|i| i as f32).collect();
        let resid = y.clone();
        blas_gemm(gemm_dims(t, out, inn), &w, &x, 1.0, &mut y);
        for r in 0..t {
            for o in 0..out {
                let want: f32 = (0..inn).map(|i| x[r * inn + i] * w[o * inn + i]).sum::<f32>() + resid[r * out + o];
                assert!((y[r * out + o] - want).abs() < 1e-5, "y[{r}][{o}]");
            }
        }
    }

    #[test]
    fn stacked_weights_give_each_part_side_by_side() {
        // [q; k] stacked: one product's row holds q's outputs then k's.
        let (inn, q_rows, k_rows) = (4, 3, 2);
        let q: Vec<f32> = (0..q_rows * inn).map(|i| i as f32).collect();
        let k: Vec<f32> = (0..k_rows * inn).map(|i| 50.0 - i as f32).collect();
        let h = |v: &[f32]| {
            v.iter()
                .map(|&x| half::f16::from_f32(x).to_bits())
                .collect::<Vec<u16>>()
        };
        let stacked: Vec<f32> = stack_rows(&[h(&q), h(&k)])
            .into_iter()
            .map(|b| half::f16::from_bits(b).to_f32())
            .collect();
        let x = [1.0f32, -2.0, 0.5, 3.0];
        let mut y = vec![0f32; q_rows + k_rows];
        blas_gemm(gemm_dims(1, q_rows + k_rows, inn), &stacked, &x, 0.0, &mut y);
        let dot = |w: &[f32], r: usize| (0..inn).map(|i| w[r * inn + i] * x[i]).sum::<f32>();
        for (r, got) in y[..q_rows].iter().enumerate() {
            assert_eq!(*got, dot(&q, r));
        }
        for r in 0..k_rows {
            assert_eq!(y[q_rows + r], dot(&k, r));
        }
    }

    #[test]
    fn quantized_weights_dequantize_to_f16_as_the_cpu_reads_them() {
        // A Q8_0 matrix of 2 rows × 32: per block an f16 scale then 32 int8 values.
        let mut data = Vec::new();
        for r in 0..2 {
            data.extend(half::f16::from_f32(0.5 + r as f32).to_bits().to_le_bytes());
            data.extend((0..32).map(|i| (i as i8 - 16) as u8));
        }
        let w = WeightView {
            ty: GgmlType::Q8_0,
            rows: 2,
            cols: 32,
            data: &data,
            packed: None,
        };
        let h = dequantize_f16(&w);
        assert_eq!(h.len(), 64);
        for r in 0..2 {
            for i in 0..32 {
                let want = (0.5 + r as f32) * (i as f32 - 16.0);
                assert_eq!(half::f16::from_bits(h[r * 32 + i]).to_f32(), want);
            }
        }
    }

    #[test]
    fn memory_plan_shares_what_is_left() {
        let gib = 1usize << 30;
        // 80 GiB free, 1 GiB headroom: half of 79 GiB, capped at 16 GiB.
        assert_eq!(kv_blocks(80 * gib, gib, 1 << 20, None, 10).unwrap(), 16 * 1024);
        // Small device: half of what is left.
        assert_eq!(kv_blocks(6 * gib, gib, 1 << 20, None, 10).unwrap(), 2560);
        // An explicit size is taken as given, and refused when it does not fit.
        assert_eq!(kv_blocks(6 * gib, gib, 1 << 20, Some(1000), 10).unwrap(), 1000);
        assert!(kv_blocks(6 * gib, gib, 1 << 20, Some(6000), 10)
            .unwrap_err()
            .contains("does not fit"));
        // Too small for one sequence.
        assert!(kv_blocks(6 * gib, gib, 1 << 20, Some(5), 10)
            .unwrap_err()
            .contains("too small"));
    }
}
