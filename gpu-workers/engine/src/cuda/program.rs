//! The forward pass as a program: kernel launches and GEMMs over named buffers. The CUDA
//! backend runs it on the device (`device.rs`); the kernel emulator test
//! (`tests/engine/cuda_emulated.rs`) runs the same program, with the same kernels' source, on the
//! CPU and checks it against the CPU engine. So the launch order, the arguments and the
//! buffer sizes are tested without a GPU.

use crate::kernels::WeightView;
use crate::models::{Batch, ModelConfig, ModelWeights, RopeLayout};

use super::plan::{self, ATTENTION_WARPS};

/// A device buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Buf {
    // A step's inputs (`plan::StepInputs`).
    Tokens,
    Positions,
    Slots,
    Tables,
    LogitRows,
    // Activations.
    X,
    Normed,
    Qkv,
    Att,
    GateUp,
    Act,
    Last,
    Logits,
    /// The KV pool (its blocks plus the padding block).
    Pool,
    // Weights.
    Embed,
    /// Absent when the output is tied to the embedding (see [`output_matrix`]).
    Output,
    OutputNorm,
    InvFreq,
    AttnNorm(usize),
    FfnNorm(usize),
    Wqkv(usize),
    Wo(usize),
    WGateUp(usize),
    WDown(usize),
}

/// A buffer's element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    /// IEEE binary16 bits.
    F16,
    F32,
    I32,
}

impl Elem {
    pub fn bytes(self) -> usize {
        match self {
            Elem::F16 => 2,
            Elem::F32 | Elem::I32 => 4,
        }
    }
}

/// What the buffers are sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub block_tokens: usize,
    /// Blocks in a row's table (the served context, in blocks).
    pub table_width: usize,
    pub max_rows: usize,
    /// KV blocks, the padding block included.
    pub pool_blocks: usize,
    /// The output matrix is the embedding's.
    pub tied: bool,
}

impl Buf {
    pub fn elem(self) -> Elem {
        use Buf::*;
        match self {
            Tokens | Positions | Slots | Tables | LogitRows => Elem::I32,
            X | Qkv | GateUp | Logits | OutputNorm | InvFreq | AttnNorm(_) | FfnNorm(_) => Elem::F32,
            Normed | Att | Act | Last | Pool | Embed | Output | Wqkv(_) | Wo(_) | WGateUp(_) | WDown(_) => Elem::F16,
        }
    }

    /// Elements the buffer holds.
    pub fn len(self, c: &ModelConfig, s: &Shape) -> usize {
        use Buf::*;
        let (d, kvd, ff, v, r) = (c.d_model, c.kv_dim(), c.n_ff, c.vocab_size, s.max_rows);
        match self {
            Tokens | Positions | Slots | LogitRows => r,
            Tables => r * s.table_width,
            X | Normed | Att | Last => r * d,
            Qkv => r * (d + 2 * kvd),
            GateUp => r * 2 * ff,
            Act => r * ff,
            Logits => r * v,
            Pool => s.pool_blocks * block_elems(c, s.block_tokens),
            Embed | Output => v * d,
            OutputNorm | AttnNorm(_) | FfnNorm(_) => d,
            InvFreq => c.rope_dims / 2,
            Wqkv(_) => (d + 2 * kvd) * d,
            Wo(_) => d * d,
            WGateUp(_) => 2 * ff * d,
            WDown(_) => d * ff,
        }
    }
}

/// f16 elements of one KV block (every layer's keys and values).
pub fn block_elems(c: &ModelConfig, block_tokens: usize) -> usize {
    c.n_layers * 2 * block_tokens * c.kv_dim()
}

/// The buffers a step uses besides the weights: inputs, activations and the pool.
pub const STEP_BUFFERS: [Buf; 14] = [
    Buf::Tokens,
    Buf::Positions,
    Buf::Slots,
    Buf::Tables,
    Buf::LogitRows,
    Buf::X,
    Buf::Normed,
    Buf::Qkv,
    Buf::Att,
    Buf::GateUp,
    Buf::Act,
    Buf::Last,
    Buf::Logits,
    Buf::Pool,
];

/// The matrix the logits are computed with.
pub fn output_matrix(s: &Shape) -> Buf {
    if s.tied {
        Buf::Embed
    } else {
        Buf::Output
    }
}

/// Hearth's kernels (entry points of [`plan::KERNELS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    EmbedRows,
    RmsNorm,
    Rope,
    KvWrite,
    Attention,
    SiluMul,
}

impl Kernel {
    pub const ALL: [Kernel; 6] = [
        Kernel::EmbedRows,
        Kernel::RmsNorm,
        Kernel::Rope,
        Kernel::KvWrite,
        Kernel::Attention,
        Kernel::SiluMul,
    ];

    pub fn name(self) -> &'static str {
        plan::KERNEL_NAMES[self as usize]
    }
}

/// A kernel argument.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// The buffer's device address.
    Buf(Buf),
    /// A null pointer.
    Null,
    I32(i32),
    F32(f32),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    Launch {
        kernel: Kernel,
        grid: (u32, u32),
        block: u32,
        args: Vec<Arg>,
    },
    /// `y[t][out] (+)= x[t][inn] · w[out][inn]ᵀ` ([`plan::gemm_dims`]).
    Gemm {
        w: Buf,
        x: Buf,
        y: Buf,
        t: usize,
        out: usize,
        inn: usize,
        accumulate: bool,
    },
}

/// The forward pass of `rows` rows (inputs in the input buffers) with the logits of
/// `n_logits` rows (the first `n_logits` of `LogitRows`).
pub fn forward(c: &ModelConfig, s: &Shape, rows: usize, n_logits: usize) -> Vec<Op> {
    use Arg::{Buf as B, I32};
    let r = rows as u32;
    let (d, kvd, hd, ff) = (c.d_model, c.kv_dim(), c.head_dim, c.n_ff);
    let stride = (d + 2 * kvd) as i32;
    let (k_off, v_off) = (d as i32, (d + kvd) as i32);
    let launch = |kernel, grid, block, args: Vec<Arg>| Op::Launch {
        kernel,
        grid,
        block,
        args,
    };
    // RMSNorm of `n` rows of x (`rows`: which ones, or Null for the first n) into `out`.
    let norm = |n: usize, rows: Arg, weight: Buf, out: Buf| {
        let args = vec![B(Buf::X), rows, B(weight), B(out), I32(d as i32), Arg::F32(c.rms_eps)];
        launch(Kernel::RmsNorm, (n as u32, 1), 256, args)
    };
    let gemm = |w, x, y, (t, out, inn), accumulate| Op::Gemm {
        w,
        x,
        y,
        t,
        out,
        inn,
        accumulate,
    };
    let n_layers = c.n_layers as i32;
    let (n_heads, n_kv_heads) = (c.n_heads as i32, c.n_kv_heads as i32);
    let (bt, width) = (s.block_tokens as i32, s.table_width as i32);
    let adjacent = i32::from(c.rope_layout == RopeLayout::Adjacent);
    let mut ops = vec![launch(
        Kernel::EmbedRows,
        (r, 1),
        256,
        vec![B(Buf::Embed), B(Buf::Tokens), B(Buf::X), I32(d as i32)],
    )];
    for l in 0..c.n_layers {
        let li = l as i32;
        ops.push(norm(rows, Arg::Null, Buf::AttnNorm(l), Buf::Normed));
        ops.push(gemm(Buf::Wqkv(l), Buf::Normed, Buf::Qkv, (rows, d + 2 * kvd, d), false));
        ops.push(launch(
            Kernel::Rope,
            (r, 1),
            128,
            vec![
                B(Buf::Qkv),
                I32(stride),
                I32(k_off),
                B(Buf::Positions),
                B(Buf::InvFreq),
                I32((c.rope_dims / 2) as i32),
                I32(n_heads),
                I32(n_kv_heads),
                I32(hd as i32),
                I32(adjacent),
            ],
        ));
        ops.push(launch(
            Kernel::KvWrite,
            (r, 1),
            128,
            vec![
                B(Buf::Qkv),
                I32(stride),
                I32(k_off),
                I32(v_off),
                B(Buf::Slots),
                B(Buf::Pool),
                I32(n_layers),
                I32(li),
                I32(kvd as i32),
                I32(hd as i32),
                I32(bt),
            ],
        ));
        ops.push(launch(
            Kernel::Attention,
            (r, c.n_heads as u32),
            32 * ATTENTION_WARPS,
            vec![
                B(Buf::Qkv),
                I32(stride),
                B(Buf::Positions),
                B(Buf::Tables),
                I32(width),
                B(Buf::Pool),
                B(Buf::Att),
                I32(n_layers),
                I32(li),
                I32(n_heads),
                I32(n_kv_heads),
                I32(hd as i32),
                I32(bt),
            ],
        ));
        // x += att · woᵀ (the residual rides on the GEMM)
        ops.push(gemm(Buf::Wo(l), Buf::Att, Buf::X, (rows, d, d), true));
        ops.push(norm(rows, Arg::Null, Buf::FfnNorm(l), Buf::Normed));
        ops.push(gemm(
            Buf::WGateUp(l),
            Buf::Normed,
            Buf::GateUp,
            (rows, 2 * ff, d),
            false,
        ));
        ops.push(launch(
            Kernel::SiluMul,
            (r, 1),
            256,
            vec![B(Buf::GateUp), B(Buf::Act), I32(ff as i32)],
        ));
        // x += act · w_downᵀ
        ops.push(gemm(Buf::WDown(l), Buf::Act, Buf::X, (rows, d, ff), true));
    }
    if n_logits > 0 {
        ops.push(norm(n_logits, B(Buf::LogitRows), Buf::OutputNorm, Buf::Last));
        ops.push(gemm(
            output_matrix(s),
            Buf::Last,
            Buf::Logits,
            (n_logits, c.vocab_size, d),
            false,
        ));
    }
    ops
}

/// One step as the program computes it: the inputs to upload, the rows and logit rows to
/// compute (a graph bucket's, padded, when the step replays one), and that bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub inputs: plan::StepInputs,
    pub rows: usize,
    pub n_logits: usize,
    pub bucket: Option<usize>,
}

/// Lays out `b` for the buffers of `shape` (see [`plan::assemble`]); with `graphs`, padded
/// to its graph bucket when it has one. `pad_block` is the pool's padding block.
pub fn step(b: &Batch<'_>, shape: &Shape, pad_block: u32, graphs: bool) -> Result<Step, String> {
    let t = b.tokens.len();
    let bucket = graphs
        .then(|| plan::graph_bucket(t, b.logit_rows, shape.max_rows))
        .flatten();
    let inputs = plan::assemble(b, shape.block_tokens, shape.table_width, pad_block, bucket)?;
    let (rows, n_logits) = bucket.map_or((t, b.logit_rows.len()), |k| (k, k));
    Ok(Step {
        inputs,
        rows,
        n_logits,
        bucket,
    })
}

/// A weight buffer's contents, prepared on the host.
#[derive(Debug, Clone, PartialEq)]
pub enum HostData {
    F16(Vec<u16>),
    F32(Vec<f32>),
}

impl HostData {
    fn len(&self) -> usize {
        match self {
            HostData::F16(v) => v.len(),
            HostData::F32(v) => v.len(),
        }
    }
}

/// Every weight buffer the program reads.
pub fn weight_bufs(n_layers: usize, tied: bool) -> Vec<Buf> {
    let mut v: Vec<Buf> = (0..n_layers)
        .flat_map(|l| {
            [
                Buf::AttnNorm(l),
                Buf::Wqkv(l),
                Buf::Wo(l),
                Buf::FfnNorm(l),
                Buf::WGateUp(l),
                Buf::WDown(l),
            ]
        })
        .collect();
    v.extend([Buf::Embed, Buf::OutputNorm, Buf::InvFreq]);
    if !tied {
        v.push(Buf::Output);
    }
    v
}

/// A weight buffer's contents, built on the host (one at a time, so that the host holds
/// one matrix's f16 copy at a time): matrices dequantized to f16 with `q|k|v` and
/// `gate|up` stacked by rows; norms and RoPE frequencies as f32. Refuses a buffer that is
/// not a weight, or whose contents are not the size the program reads.
pub fn weight_data(w: &ModelWeights<'_>, c: &ModelConfig, shape: &Shape, b: Buf) -> Result<HostData, String> {
    let data = host_weight(w, b).ok_or_else(|| format!("no weights for {b:?}"))?;
    let want = b.len(c, shape);
    if data.len() != want {
        return Err(format!("{b:?} has {} elements, expected {want}", data.len()));
    }
    Ok(data)
}

fn host_weight(w: &ModelWeights<'_>, b: Buf) -> Option<HostData> {
    let f16 = |ms: &[&WeightView<'_>]| {
        HostData::F16(plan::stack_rows(
            &ms.iter().map(|m| plan::dequantize_f16(m)).collect::<Vec<_>>(),
        ))
    };
    let layer = |l: usize| w.layers.get(l);
    Some(match b {
        Buf::AttnNorm(l) => HostData::F32(layer(l)?.attn_norm.to_vec()),
        Buf::FfnNorm(l) => HostData::F32(layer(l)?.ffn_norm.to_vec()),
        Buf::Wqkv(l) => {
            let l = layer(l)?;
            f16(&[&l.wq, &l.wk, &l.wv])
        }
        Buf::Wo(l) => f16(&[&layer(l)?.wo]),
        Buf::WGateUp(l) => {
            let l = layer(l)?;
            f16(&[&l.w_gate, &l.w_up])
        }
        Buf::WDown(l) => f16(&[&layer(l)?.w_down]),
        Buf::Embed => f16(&[&w.embed]),
        Buf::Output => f16(&[&w.output]),
        Buf::OutputNorm => HostData::F32(w.output_norm.to_vec()),
        Buf::InvFreq => HostData::F32(w.inv_freq.to_vec()),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        ModelConfig {
            n_layers: 3,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            rope_dims: 16,
            ..plan::tests::cfg()
        }
    }

    #[test]
    fn kernel_names_match_their_entry_points() {
        for (k, name) in Kernel::ALL.iter().zip(plan::KERNEL_NAMES) {
            assert_eq!(k.name(), name);
        }
    }

    #[test]
    fn every_gemm_fits_its_buffers() {
        let c = cfg();
        let s = Shape {
            block_tokens: 16,
            table_width: 4,
            max_rows: 8,
            pool_blocks: 9,
            tied: true,
        };
        let ops = forward(&c, &s, 8, 8);
        // embed + per layer (2 norms, rope, kv write, attention, silu) + final norm
        let launches = ops.iter().filter(|o| matches!(o, Op::Launch { .. })).count();
        assert_eq!(launches, 1 + 6 * c.n_layers + 1);
        for op in &ops {
            if let Op::Gemm {
                w, x, y, t, out, inn, ..
            } = *op
            {
                assert!(w.len(&c, &s) >= out * inn, "{w:?}");
                assert!(x.len(&c, &s) >= t * inn, "{x:?}");
                assert!(y.len(&c, &s) >= t * out, "{y:?}");
                assert_eq!((w.elem(), x.elem(), y.elem()), (Elem::F16, Elem::F16, Elem::F32));
            }
        }
        // The logits come from the embedding when tied; no logit work without logit rows.
        assert!(ops.iter().any(|o| matches!(o, Op::Gemm { w: Buf::Embed, .. })));
        assert!(!forward(&c, &s, 8, 0)
            .iter()
            .any(|o| matches!(o, Op::Gemm { y: Buf::Logits, .. })));
    }
}
