//! What the transformer and the layers beside it (mixture-of-experts, latent attention)
//! share: a weight matrix and how it is found, checked and repacked in the model file
//! ([`Matrix`], [`matrix`], [`matrices_3d`], [`weight_view`]), vectors and norms, the MLP
//! ([`Mlp`], its gate and up projections, its buffers), and a step's attention
//! [`Tile`]s.

use std::sync::Arc;

use crate::formats::gguf::{GgmlType, GgufError, GgufFile, TensorInfo};
use crate::kernels::{dequantize_row, PackedMatrix, WeightView, QK};

use super::ModelError;

/// A weight matrix: where it is in the file, its shape, and its repacked copy (built at
/// load for the SIMD kernels; then the file's pages of it are no longer read).
#[derive(Debug, Clone)]
pub(super) struct Matrix {
    pub(super) ty: GgmlType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) shard: usize,
    pub(super) offset: usize,
    pub(super) len: usize,
    pub(super) packed: Option<Arc<PackedMatrix>>,
}

/// The MLP's gate and up projections: two matrices, or one of `2·ff` rows, gate first
/// (Phi-3).
#[derive(Debug)]
pub(super) enum GateUp {
    Split { gate: Matrix, up: Matrix },
    Fused(Matrix),
}

/// A gated MLP: `down(act(gate(h)) ⊙ up(h))` — a dense layer's, one expert's, or the
/// shared experts' of a mixture.
#[derive(Debug)]
pub(super) struct Mlp {
    pub(super) gate_up: GateUp,
    pub(super) down: Matrix,
}

impl Mlp {
    pub(super) fn matrices(&self) -> Vec<&Matrix> {
        let mut ms = Vec::with_capacity(3);
        match &self.gate_up {
            GateUp::Split { gate, up } => ms.extend([gate, up]),
            GateUp::Fused(m) => ms.push(m),
        }
        ms.push(&self.down);
        ms
    }

    pub(super) fn matrices_mut(&mut self) -> Vec<&mut Matrix> {
        let mut ms = Vec::with_capacity(3);
        match &mut self.gate_up {
            GateUp::Split { gate, up } => ms.extend([gate, up]),
            GateUp::Fused(m) => ms.push(m),
        }
        ms.push(&mut self.down);
        ms
    }
}

/// Scratch for [`Mlp::forward`].
#[derive(Debug, Default)]
pub(super) struct MlpBufs {
    pub(super) gate: Vec<f32>,
    pub(super) up: Vec<f32>,
    pub(super) fused: Vec<f32>,
}

/// Splits each of `rows` rows of a fused projection's output into its parts: `outs[i]`
/// gets the next `outs[i].len() / rows` values of every row.
pub(super) fn split_rows(fused: &[f32], rows: usize, outs: &mut [&mut [f32]]) {
    let widths: Vec<usize> = outs.iter().map(|o| o.len() / rows.max(1)).collect();
    for (r, src) in fused
        .chunks_exact(widths.iter().sum::<usize>().max(1))
        .enumerate()
        .take(rows)
    {
        let mut at = 0;
        for (o, &w) in outs.iter_mut().zip(&widths) {
            o[r * w..(r + 1) * w].copy_from_slice(&src[at..at + w]);
            at += w;
        }
    }
}

pub(super) fn tensor<'a>(g: &'a GgufFile, name: &str) -> Result<&'a TensorInfo, ModelError> {
    g.tensor(name)
        .ok_or_else(|| ModelError::Gguf(GgufError::MissingTensor(name.to_string())))
}

pub(super) fn matrix(g: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
    let t = tensor(g, name)?;
    if t.dims != [cols as u64, rows as u64] {
        return Err(ModelError::Shape {
            name: name.into(),
            got: t.dims.clone(),
            want: vec![cols as u64, rows as u64],
        });
    }
    check_row_blocks(name, t.ty, cols)?;
    Ok(Matrix {
        ty: t.ty,
        rows,
        cols,
        shard: t.shard,
        offset: t.offset,
        len: t.len,
        packed: None,
    })
}

pub(super) fn vector(g: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
    let t = tensor(g, name)?;
    if t.dims != [n as u64] {
        return Err(ModelError::Shape {
            name: name.into(),
            got: t.dims.clone(),
            want: vec![n as u64],
        });
    }
    if t.ty.block_layout().is_none() {
        return Err(ModelError::TensorType {
            name: name.into(),
            ty: t.ty,
        });
    }
    let mut v = vec![0f32; n];
    dequantize_row(t.ty, g.tensor_data(t), &mut v);
    Ok(v)
}

/// A norm's weights, shifted as the file says ([`super::NORM_SHIFT_KEY`]).
pub(super) fn norm(g: &GgufFile, name: &str, n: usize, shift: f32) -> Result<Vec<f32>, ModelError> {
    let mut v = vector(g, name, n)?;
    if shift != 0.0 {
        v.iter_mut().for_each(|x| *x += shift);
    }
    Ok(v)
}

/// A vector that may be absent.
pub(super) fn opt_vector(g: &GgufFile, name: &str, n: usize) -> Result<Option<Vec<f32>>, ModelError> {
    match g.tensor(name) {
        Some(_) => vector(g, name, n).map(Some),
        None => Ok(None),
    }
}

/// Layer `l`'s gated MLP `ffn_{gate,up,down}{suffix}` of width `ff` (a fused gate-up
/// matrix of `2·ff` rows, gate first, where the file has one: Phi-3).
pub(super) fn load_mlp(g: &GgufFile, l: usize, suffix: &str, d: usize, ff: usize) -> Result<Mlp, ModelError> {
    let n = |s: &str| format!("blk.{l}.{s}{suffix}.weight");
    let gate_up = match g.tensor(&n("ffn_gate")) {
        Some(_) => GateUp::Split {
            gate: matrix(g, &n("ffn_gate"), ff, d)?,
            up: matrix(g, &n("ffn_up"), ff, d)?,
        },
        None => GateUp::Fused(matrix(g, &n("ffn_up"), 2 * ff, d)?),
    };
    Ok(Mlp {
        gate_up,
        down: matrix(g, &n("ffn_down"), d, ff)?,
    })
}

/// The `n` matrices of a 3-D tensor `[cols, rows, n]` (experts, per-head projections):
/// matrix `e` is the `e`-th equal slice of its bytes, a matrix of its own (repacked like
/// any other). Where the file has no such tensor, `n` 2-D ones named `{stem}.{e}.weight`
/// (how a Hugging Face directory's per-expert tensors are presented, unstacked and
/// uncopied) serve instead.
pub(super) fn matrices_3d(
    g: &GgufFile,
    name: &str,
    n: usize,
    rows: usize,
    cols: usize,
) -> Result<Vec<Matrix>, ModelError> {
    let stem = name.strip_suffix(".weight").unwrap_or(name);
    if g.tensor(name).is_none() && g.tensor(&format!("{stem}.0.weight")).is_some() {
        return (0..n)
            .map(|e| matrix(g, &format!("{stem}.{e}.weight"), rows, cols))
            .collect();
    }
    let t = tensor(g, name)?;
    if t.dims != [cols as u64, rows as u64, n as u64] {
        return Err(ModelError::Shape {
            name: name.into(),
            got: t.dims.clone(),
            want: vec![cols as u64, rows as u64, n as u64],
        });
    }
    check_row_blocks(name, t.ty, cols)?;
    let each = t.len / n.max(1);
    Ok((0..n)
        .map(|e| Matrix {
            ty: t.ty,
            rows,
            cols,
            shard: t.shard,
            offset: t.offset + e * each,
            len: each,
            packed: None,
        })
        .collect())
}

/// Rows of `cols` values of type `ty` are a whole number of blocks.
fn check_row_blocks(name: &str, ty: GgmlType, cols: usize) -> Result<(), ModelError> {
    let (per_block, _) = ty
        .block_layout()
        .ok_or(ModelError::TensorType { name: name.into(), ty })?;
    if !cols.is_multiple_of(per_block) || (per_block > 1 && !cols.is_multiple_of(QK)) {
        return Err(ModelError::Config(format!(
            "{name}: row length {cols} is not a whole number of blocks"
        )));
    }
    Ok(())
}

/// A matrix's bytes in the file, with its repacked copy when it has one (one mapped from
/// the pack cache once its check passed: the first use waits for it, and a copy that failed
/// it is repacked from the file here, whose pages are then released again, as at load).
pub(super) fn weight_view<'a>(file: &'a GgufFile, m: &'a Matrix) -> WeightView<'a> {
    let t = TensorInfo {
        name: String::new(),
        dims: vec![],
        ty: m.ty,
        offset: m.offset,
        len: m.len,
        shard: m.shard,
    };
    let mut w = WeightView {
        ty: m.ty,
        rows: m.rows,
        cols: m.cols,
        data: file.tensor_data(&t),
        packed: None,
    };
    w.packed = m.packed.as_deref().and_then(|p| {
        p.checked(|| {
            let repacked = pack_one(&w);
            if repacked.is_some() {
                file.release(m.shard, m.offset, m.len);
            }
            repacked
        })
    });
    w
}

/// A matrix repacked (at load, or in place of a cached copy that failed its check):
/// quantized weights as they are, floats quantized to Q8_0.
pub(super) fn pack_one(w: &WeightView<'_>) -> Option<PackedMatrix> {
    match w.ty.is_quantized() {
        true => PackedMatrix::pack(w),
        false => PackedMatrix::pack_float_as_q8_0(w),
    }
}

/// A unit of attention work: rows `row..row + rows` — consecutive positions of one
/// sequence — and query heads `head..head + heads` of KV head `kv_head`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tile {
    pub(super) row: usize,
    pub(super) rows: usize,
    pub(super) kv_head: usize,
    pub(super) head: usize,
    pub(super) heads: usize,
}
