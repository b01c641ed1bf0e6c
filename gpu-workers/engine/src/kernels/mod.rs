//! CPU kernels: dequantization, activation quantization, the matrix product over weight
//! rows, and the vector helpers of attention and the FFN. They know nothing about models.
//!
//! Quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K; their
//! formats are read in [`blocks`]) are multiplied against activations quantized to
//! 8 bits in blocks of 32 (as llama.cpp does), with integer dot products. On a SIMD path
//! the weights are first repacked ([`packed`]) so that one integer dot-product instruction
//! (`vpdpbusd` with VNNI, `vpmaddubsw` without) works on 8 or 16 weight rows at once and
//! each weight tile is read once for every activation row of the step. The instruction set
//! is chosen once ([`isa`], [`set_isa`]); the scalar path is the reference the tests compare
//! every other path with. Float weights (F32, F16, BF16) take a float path.

pub mod blocks;
pub mod pack_cache;
pub mod packed;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::sync::atomic::{AtomicU8, Ordering};

pub use packed::PackedMatrix;

use rayon::prelude::*;

use crate::formats::gguf::GgmlType;

pub const QK: usize = 32;

/// A row-major weight matrix borrowed from the model file: `rows` rows of `cols` elements.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    /// The same matrix repacked for the SIMD kernels, when it was.
    pub packed: Option<&'a PackedMatrix>,
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

    pub fn is_quantized(&self) -> bool {
        self.ty.is_quantized()
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
            // Through a small aligned buffer into `half`'s slice conversion (F16C where the
            // CPU has it, found at run time): several times faster than value by value.
            use half::slice::HalfFloatSliceExt;
            let mut bits = [half::f16::ZERO; 64];
            for (o, c) in out.chunks_mut(64).zip(src.chunks(128)) {
                for (b, v) in bits.iter_mut().zip(c.chunks_exact(2)) {
                    *b = half::f16::from_bits(u16::from_le_bytes([v[0], v[1]]));
                }
                bits[..o.len()].convert_to_f32_slice(o);
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
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
            blocks::dequantize_row(ty, src, out)
        }
        GgmlType::Other(_) => out.fill(0.0),
    }
}

/// One block of 32 activations quantized to 8 bits: scale, scale × sum of the quants (for
/// the offset terms of Q4_0, Q4_1, Q5_x and the K-quants' mins), the quants, and the sums of
/// each half's quants (for Q6_K's offset of 32 under two sub-block scales), interleaved so a
/// dot product reads one stream.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockQ8 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK],
    pub h: [i16; 2],
}

/// Activations quantized to 8 bits in blocks of 32, row after row.
#[derive(Debug, Default)]
pub struct QuantizedActs {
    pub blocks_per_row: usize,
    pub blocks: Vec<BlockQ8>,
}

fn quantize_block_scalar(xb: &[f32], out: &mut BlockQ8) {
    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut h = [0i32; 2];
    for (l, (q, v)) in out.qs.iter_mut().zip(xb).enumerate() {
        let qi = (v * id).round() as i32;
        *q = qi as i8;
        h[l / 16] += qi;
    }
    out.d = d;
    out.s = d * (h[0] + h[1]) as f32;
    out.h = [h[0] as i16, h[1] as i16];
}

impl QuantizedActs {
    /// Quantizes rows of `cols` (a multiple of 32) floats.
    pub fn quantize(&mut self, x: &[f32], cols: usize) {
        self.blocks_per_row = cols / QK;
        self.blocks.resize(x.len() / QK, BlockQ8::default());
        let blocks = &mut self.blocks;
        let work = |xs: &[f32], bs: &mut [BlockQ8]| {
            #[cfg(target_arch = "x86_64")]
            if isa().is_simd() {
                for (xb, b) in xs.chunks_exact(QK).zip(bs.iter_mut()) {
                    // SAFETY: every SIMD path implies AVX2/FMA/F16C (checked by `isa()`);
                    // `xb` has 32 floats.
                    unsafe { x86::avx2::quantize_block(xb, b) };
                }
                return;
            }
            for (xb, b) in xs.chunks_exact(QK).zip(bs.iter_mut()) {
                quantize_block_scalar(xb, b);
            }
        };
        // Large inputs (prefill) are split across threads.
        if x.len() >= 64 * 1024 {
            let per = 256;
            x.par_chunks(per * QK)
                .zip(blocks.par_chunks_mut(per))
                .for_each(|(xs, bs)| work(xs, bs));
        } else {
            work(x, blocks);
        }
    }

    pub fn rows(&self) -> usize {
        self.blocks.len() / self.blocks_per_row.max(1)
    }

    fn row(&self, r: usize) -> &[BlockQ8] {
        let nb = self.blocks_per_row;
        &self.blocks[r * nb..(r + 1) * nb]
    }
}

/// Scalar reference dot product of one quantized weight row with one activation row.
pub fn dot_q_scalar(ty: GgmlType, w: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in x.iter().enumerate() {
        let xq = &xb.qs;
        match ty {
            GgmlType::Q4_0 => {
                let blk = &w[b * 18..(b + 1) * 18];
                let mut s = 0i32;
                for j in 0..16 {
                    s += ((blk[2 + j] & 0x0F) as i32 - 8) * xq[j] as i32;
                    s += ((blk[2 + j] >> 4) as i32 - 8) * xq[j + 16] as i32;
                }
                acc += f16_at(blk, 0) * xb.d * s as f32;
            }
            GgmlType::Q4_1 => {
                let blk = &w[b * 20..(b + 1) * 20];
                let mut s = 0i32;
                for j in 0..16 {
                    s += (blk[4 + j] & 0x0F) as i32 * xq[j] as i32;
                    s += (blk[4 + j] >> 4) as i32 * xq[j + 16] as i32;
                }
                acc += f16_at(blk, 0) * xb.d * s as f32 + f16_at(blk, 2) * xb.s;
            }
            GgmlType::Q8_0 => {
                let blk = &w[b * 34..(b + 1) * 34];
                let s: i32 = (0..QK).map(|j| blk[2 + j] as i8 as i32 * xq[j] as i32).sum();
                acc += f16_at(blk, 0) * xb.d * s as f32;
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
                acc += blocks::dot(&blocks::read(ty, w, b), xb);
            }
            _ => {}
        }
    }
    acc
}

/// The instruction set the kernels use. Chosen once per process ([`isa`]), overridable
/// ([`set_isa`], `--isa`, `HEARTH_ISA`) so that every path can be tested and measured on one
/// machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust: the reference every other path is tested against.
    Scalar,
    /// AVX2 + FMA + F16C; integer dot products with `vpmaddubsw` (AMD EPYC of this
    /// project's CI, any x86-64 from 2015 on).
    Avx2,
    /// AVX2 with AVX-VNNI: `vpdpbusd` on 256-bit registers.
    Avx2Vnni,
    /// AVX-512 F/BW/VL with AVX512-VNNI: `vpdpbusd` on 512-bit registers, 16 weight rows
    /// per instruction.
    Avx512,
}

/// A requested instruction set this CPU cannot run.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct IsaError(pub String);

impl Isa {
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx2Vnni, Isa::Avx512];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx2Vnni => "avx2+vnni",
            Isa::Avx512 => "avx512+vnni",
        }
    }

    /// Whether this CPU (and OS) can run the path.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2,
                Isa::Avx2Vnni => avx2 && is_x86_feature_detected!("avxvnni"),
                Isa::Avx512 => {
                    avx2 && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512vnni")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Scalar
        }
    }

    /// The fastest path this CPU runs.
    pub fn best() -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|i| i.available())
            .unwrap_or(Isa::Scalar)
    }

    /// Every path this CPU runs, slowest first.
    pub fn all_available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.available()).collect()
    }

    /// A SIMD path (weights are repacked for it).
    pub fn is_simd(self) -> bool {
        self != Isa::Scalar
    }

    /// Parses `--isa`: `auto`, `scalar`, `avx2` (with AVX-VNNI when the CPU has it),
    /// `avx2-novnni`, `avx512`; refuses a path this CPU cannot run.
    pub fn parse(s: &str) -> Result<Isa, IsaError> {
        let want = match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "native" | "best" => return Ok(Isa::best()),
            "scalar" => Isa::Scalar,
            "avx2" => {
                if Isa::Avx2Vnni.available() {
                    Isa::Avx2Vnni
                } else {
                    Isa::Avx2
                }
            }
            "avx2-novnni" | "avx2-plain" => Isa::Avx2,
            "avx2+vnni" | "avx2-vnni" | "avxvnni" => Isa::Avx2Vnni,
            "avx512" | "avx512+vnni" | "avx512-vnni" => Isa::Avx512,
            other => {
                return Err(IsaError(format!(
                    "unknown instruction set {other:?} (auto, scalar, avx2, avx2-novnni, avx512)"
                )))
            }
        };
        if !want.available() {
            return Err(IsaError(format!(
                "this CPU cannot run the {} path (it has: {}); paths available: {}",
                want.name(),
                cpu_features(),
                Isa::all_available()
                    .iter()
                    .map(|i| i.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        Ok(want)
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The CPU features that matter to the kernels, as the CPU reports them. AMX is listed when
/// reported but never used: on some hypervisors CPUID reports it while the OS has not
/// enabled tile state, and the first tile instruction faults.
pub fn cpu_features() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let mut f = Vec::new();
        macro_rules! has {
            ($($name:tt),*) => {$(
                if is_x86_feature_detected!($name) { f.push($name); }
            )*};
        }
        has!(
            "avx2",
            "fma",
            "f16c",
            "avxvnni",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512vnni",
            "avx512bf16"
        );
        // CPUID.(EAX=7,ECX=0):EDX bit 24 is AMX-TILE (its detection macro is unstable).
        let amx = std::arch::x86_64::__cpuid_count(7, 0).edx & (1 << 24) != 0;
        if amx && is_x86_feature_detected!("avx2") {
            f.push("amx(reported, unused)");
        }
        if f.is_empty() {
            return "baseline x86-64".into();
        }
        f.join(" ")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        std::env::consts::ARCH.to_string()
    }
}

/// 0: not chosen yet; otherwise 1 + the index in [`Isa::ALL`].
static SELECTED: AtomicU8 = AtomicU8::new(0);

/// The instruction set in use. The first call chooses it: `HEARTH_ISA` (same values as
/// `--isa`; `HEARTH_FORCE_SCALAR` is the older spelling of `HEARTH_ISA=scalar`), else the
/// best this CPU runs.
#[inline]
pub fn isa() -> Isa {
    match SELECTED.load(Ordering::Relaxed) {
        0 => init_isa(),
        n => Isa::ALL[n as usize - 1],
    }
}

#[cold]
fn init_isa() -> Isa {
    let chosen = if std::env::var_os("HEARTH_FORCE_SCALAR").is_some() {
        Isa::Scalar
    } else {
        match std::env::var("HEARTH_ISA") {
            Ok(v) => Isa::parse(&v).unwrap_or_else(|e| {
                tracing::warn!("HEARTH_ISA ignored: {e}");
                Isa::best()
            }),
            Err(_) => Isa::best(),
        }
    };
    let _ = SELECTED.compare_exchange(0, index(chosen), Ordering::Relaxed, Ordering::Relaxed);
    isa()
}

fn index(i: Isa) -> u8 {
    Isa::ALL.iter().position(|x| *x == i).unwrap_or(0) as u8 + 1
}

/// Chooses the instruction set (before a model is loaded: weights are repacked for it).
pub fn set_isa(i: Isa) -> Result<(), IsaError> {
    if !i.available() {
        return Err(IsaError(format!("this CPU cannot run the {} path", i.name())));
    }
    SELECTED.store(index(i), Ordering::Relaxed);
    Ok(())
}

/// Float dot product.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa().is_simd() {
        // SAFETY: every SIMD path implies AVX2/FMA (checked by `isa()`); the kernel reads
        // min(len) elements.
        return unsafe { x86::avx2::dot_f32(a, b) };
    }
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `out += w · v`.
#[inline]
pub fn axpy(w: f32, v: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa().is_simd() {
        // SAFETY: as for `dot_f32`; the kernel touches min(len) elements.
        unsafe { x86::avx2::axpy(w, v, out) };
        return;
    }
    for (o, x) in out.iter_mut().zip(v) {
        *o += w * x;
    }
}

/// LoRA's shrink: `t[j] = a[j] · x` for the `t.len()` rows of `a` (f16 bits), each
/// `x.len()` wide.
pub fn lora_shrink(a: &[u16], x: &[f32], t: &mut [f32]) {
    assert!(a.len() >= t.len() * x.len(), "A is smaller than rank × columns");
    #[cfg(target_arch = "x86_64")]
    if isa().is_simd() {
        // SAFETY: every SIMD path implies AVX2/FMA/F16C (checked by `isa()`); the length
        // is asserted above.
        unsafe { x86::avx2::lora_shrink(a, x, t) };
        return;
    }
    for (t, a) in t.iter_mut().zip(a.chunks_exact(x.len().max(1))) {
        *t = a
            .iter()
            .zip(x)
            .map(|(&a, x)| half::f16::from_bits(a).to_f32() * x)
            .sum();
    }
}

/// LoRA's expand: `y[o] += Σ_j t[j] · bt[j][o]`, `bt` being `t.len()` f16 rows of
/// `y.len()`.
pub fn lora_expand(bt: &[u16], t: &[f32], y: &mut [f32]) {
    assert!(bt.len() >= t.len() * y.len(), "Bᵀ is smaller than rank × rows");
    #[cfg(target_arch = "x86_64")]
    if isa().is_simd() {
        // SAFETY: as for `lora_shrink`.
        unsafe { x86::avx2::lora_expand(bt, t, y) };
        return;
    }
    for (&w, b) in t.iter().zip(bt.chunks_exact(y.len().max(1))) {
        for (y, &b) in y.iter_mut().zip(b) {
            *y += w * half::f16::from_bits(b).to_f32();
        }
    }
}

/// `gate[i] = silu(gate[i]) · up[i]` (SwiGLU).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    #[cfg(target_arch = "x86_64")]
    if isa().is_simd() {
        // SAFETY: AVX2/FMA checked by `isa()`; both slices hold `n` floats.
        unsafe { x86::avx2::silu_mul(&mut gate[..n], &up[..n]) };
        return;
    }
    for (g, u) in gate[..n].iter_mut().zip(&up[..n]) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `gate[i] = gelu(gate[i]) · up[i]` with GELU's tanh approximation (GeGLU), written as
/// `x · sigmoid(2·√(2/π)·(x + 0.044715·x³))`, which is the same function.
pub fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    #[cfg(target_arch = "x86_64")]
    if isa().is_simd() {
        // SAFETY: AVX2/FMA checked by `isa()`; both slices hold `n` floats.
        unsafe { x86::avx2::gelu_mul(&mut gate[..n], &up[..n]) };
        return;
    }
    for (g, u) in gate[..n].iter_mut().zip(&up[..n]) {
        *g = gelu_tanh(*g) * u;
    }
}

/// `1 / √(mean(x²) + eps)`: RMSNorm's scale of one row. The sum is sequential on every
/// path: the golden answers were fixed with this rounding (a vectorised sum moves the
/// default model's fifth-ranked logit past its sixth).
fn rms_scale(x: &[f32], eps: f32) -> f32 {
    1.0 / (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + eps).sqrt()
}

/// RMSNorm of each `w.len()`-wide row of `x` (a whole row, or one head) into `out`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        let s = rms_scale(xr, eps);
        or.iter_mut().zip(xr).zip(w).for_each(|((o, v), g)| *o = v * s * g);
    }
}

/// [`rms_norm`] in place (Q/K norms per head, post-norms).
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    for xr in x.chunks_exact_mut(w.len()) {
        let s = rms_scale(xr, eps);
        xr.iter_mut().zip(w).for_each(|(v, g)| *v *= s * g);
    }
}

/// `x[i] = cap · tanh(x[i] / cap)` (Gemma 2's soft-capping of scores and logits).
pub fn soft_cap(x: &mut [f32], cap: f32) {
    #[cfg(target_arch = "x86_64")]
    if isa().is_simd() {
        // SAFETY: AVX2/FMA checked by `isa()`.
        unsafe { x86::avx2::soft_cap(x, cap) };
        return;
    }
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
}

/// GELU, tanh form: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // √(2/π)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

/// `x[i] = exp(x[i] − max)`, returning the sum (softmax's numerator and denominator).
pub fn exp_shifted_sum(x: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa().is_simd() {
        // SAFETY: AVX2/FMA checked by `isa()`.
        return unsafe { x86::avx2::exp_shifted_sum(x, max) };
    }
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    sum
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

/// Activation rows per tile on the scalar path.
const TOKEN_TILE: usize = 16;

/// A raw output pointer shared by tasks that write disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks given an `OutPtr` write disjoint elements (documented at each use).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[t][r] = Σ_c w[r][c] · x[t][c]` for `t` in `0..x.len()/cols`: every weight row (or
/// tile of 16 rows) is read once for all tokens of the step. Parallel over weight rows
/// (rayon's current pool).
pub fn matmul(w: &WeightView<'_>, x: &[f32], out: &mut [f32], scratch: &mut MatmulScratch) {
    let cols = w.cols;
    let t = x.len() / cols;
    debug_assert_eq!(out.len(), t * w.rows);
    if t == 0 {
        return;
    }
    let chunk = (w.rows / (rayon::current_num_threads() * 8)).clamp(8, 256);
    #[cfg(target_arch = "x86_64")]
    {
        // Quantized weights, or float weights quantized at load, packed for this path.
        let isa = isa(); // read once: another thread may change it (tests do)
        if let (Some(p), true, false) = (w.packed, isa.is_simd(), scratch.precise) {
            scratch.acts.quantize(x, cols);
            packed_matmul(isa, p, &scratch.acts, out);
            return;
        }
    }
    if w.is_quantized() && !scratch.precise {
        scratch.acts.quantize(x, cols);
        let acts = &scratch.acts;
        scratch.transposed.resize(w.rows * t, 0.0);
        // Layout: weight-row major (rows × t).
        scratch
            .transposed
            .par_chunks_mut(chunk * t)
            .enumerate()
            .for_each(|(ci, o)| {
                let rows = o.len() / t;
                for t0 in (0..t).step_by(TOKEN_TILE) {
                    let t1 = (t0 + TOKEN_TILE).min(t);
                    for i in 0..rows {
                        let wr = w.row(ci * chunk + i);
                        for tt in t0..t1 {
                            o[i * t + tt] = dot_q_scalar(w.ty, wr, acts.row(tt));
                        }
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

/// Several matrices over the same input (Q, K and V; gate and up): on the packed path the
/// activations are quantized once and all the products run in one parallel region.
pub fn matmul_many(ws: &[WeightView<'_>], x: &[f32], outs: &mut [&mut [f32]], scratch: &mut MatmulScratch) {
    debug_assert_eq!(ws.len(), outs.len());
    if ws.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let isa = isa(); // read once: another thread may change it (tests do)
        if !scratch.precise && isa.is_simd() && ws.iter().all(|w| w.packed.is_some() && w.cols == ws[0].cols) {
            scratch.acts.quantize(x, ws[0].cols);
            let packed: Vec<&PackedMatrix> = ws.iter().filter_map(|w| w.packed).collect();
            packed_matmul_many(isa, &packed, &scratch.acts, outs);
            return;
        }
    }
    for (w, out) in ws.iter().zip(outs.iter_mut()) {
        matmul(w, x, out, scratch);
    }
}

/// The packed path: tasks own ranges of 16-row groups and write those columns of every
/// output row.
#[cfg(target_arch = "x86_64")]
fn packed_matmul(isa: Isa, p: &PackedMatrix, acts: &QuantizedActs, out: &mut [f32]) {
    packed_matmul_many(isa, &[p], acts, &mut [out]);
}

#[cfg(target_arch = "x86_64")]
fn packed_matmul_many(isa: Isa, ps: &[&PackedMatrix], acts: &QuantizedActs, outs: &mut [&mut [f32]]) {
    let t = acts.rows();
    let groups: usize = ps.iter().map(|p| p.groups()).sum();
    for (p, out) in ps.iter().zip(outs.iter()) {
        assert_eq!(acts.blocks_per_row, p.blocks, "activation and weight shapes differ");
        assert!(out.len() >= t * p.rows, "output too small");
    }
    let threads = rayon::current_num_threads();
    // Decode: few large tasks stream the weights; prefill: smaller tasks balance better.
    let per_task = if t == 1 {
        groups.div_ceil(threads * 2)
    } else {
        groups.div_ceil(threads * 8)
    }
    .max(1);
    // Tasks: (matrix, group range), never spanning two matrices.
    let mut tasks = Vec::new();
    for (m, p) in ps.iter().enumerate() {
        let n = p.groups();
        let mut g = 0;
        while g < n {
            tasks.push((m, g..(g + per_task).min(n)));
            g += per_task;
        }
    }
    let ptrs: Vec<OutPtr> = outs.iter_mut().map(|o| OutPtr(o.as_mut_ptr())).collect();
    let run = |(m, groups): &(usize, std::ops::Range<usize>)| {
        let p = ps[*m];
        // SAFETY: `isa` was checked available when chosen; the packed matrix and the
        // activations have the same number of blocks per row and the output holds `t` rows
        // of `p.rows` floats (asserted above); this task writes only the columns of its own
        // groups of its own matrix, disjoint from every other task's.
        unsafe { x86::gemm_packed(isa, p, acts, groups.clone(), ptrs[*m].0, p.rows) };
    };
    if tasks.len() == 1 {
        run(&tasks[0]);
    } else {
        tasks.par_iter().for_each(run);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The SIMD shrink and expand (f16 matrices) equal the plain sums, tails included.
    #[test]
    fn lora_shrink_and_expand_match_the_plain_sums() {
        let (cols, rank, out) = (37, 6, 43);
        let h = |v: f32| half::f16::from_f32(v).to_bits();
        let f = |b: u16| half::f16::from_bits(b).to_f32();
        let a: Vec<u16> = (0..rank * cols).map(|i| h(((i * 7 % 11) as f32 - 5.0) / 8.0)).collect();
        let x: Vec<f32> = (0..cols).map(|i| ((i * 5 % 13) as f32 - 6.0) / 4.0).collect();
        let bt: Vec<u16> = (0..rank * out).map(|i| h(((i * 3 % 7) as f32 - 3.0) / 2.0)).collect();
        let mut t = vec![0f32; rank];
        lora_shrink(&a, &x, &mut t);
        for (j, &tj) in t.iter().enumerate() {
            let want: f32 = (0..cols).map(|c| f(a[j * cols + c]) * x[c]).sum();
            assert!((tj - want).abs() < 1e-4, "t[{j}] = {tj}, want {want}");
        }
        let mut y: Vec<f32> = (0..out).map(|o| o as f32).collect();
        lora_expand(&bt, &t, &mut y);
        for (o, &yo) in y.iter().enumerate() {
            let want = o as f32 + (0..rank).map(|j| t[j] * f(bt[j * out + o])).sum::<f32>();
            assert!((yo - want).abs() < 1e-3, "y[{o}] = {yo}, want {want}");
        }
    }

    const QUANTIZED: [GgmlType; 8] = GgmlType::QUANTIZED;

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
        if let Some((per, bytes)) = ty
            .block_layout()
            .filter(|_| ty.is_quantized() && !matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0))
        {
            // Random bytes, then the f16 scales made small and finite.
            for _ in 0..rows * cols / per {
                let mut blk: Vec<u8> = (0..bytes).map(|_| rng.byte()).collect();
                let scales: &[usize] = match ty {
                    GgmlType::Q5_0 => &[0],
                    GgmlType::Q6_K => &[208],
                    _ => &[0, 2],
                };
                for &at in scales {
                    let v = if ty == GgmlType::Q5_1 && at == 2 {
                        rng.next_f32() * 0.5
                    } else {
                        rng.next_f32().abs() * 0.01
                    };
                    blk[at..at + 2].copy_from_slice(&f16_bytes(v));
                }
                out.extend(blk);
            }
            return out;
        }
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
                _ => unreachable!(),
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

    /// The vectorised activations equal their scalar definitions (GELU's tanh form,
    /// soft-capping) over the range the exp clamps cover, and beyond it.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn simd_gelu_and_soft_cap_equal_scalar() {
        if !Isa::Avx2.available() {
            return;
        }
        let x: Vec<f32> = (-2000..2000)
            .map(|i| i as f32 * 0.013)
            .chain([-500.0, 500.0, 0.0, -0.0])
            .collect();
        let up: Vec<f32> = x.iter().map(|v| 1.0 + v.sin()).collect();
        let mut g = x.clone();
        // SAFETY: AVX2 checked above.
        unsafe { x86::avx2::gelu_mul(&mut g, &up) };
        for ((a, v), u) in g.iter().zip(&x).zip(&up) {
            let want = gelu_tanh(*v) * u;
            assert!(
                (a - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "gelu({v}): {a} vs {want}"
            );
        }
        for cap in [50.0f32, 30.0, 0.5] {
            let mut c = x.clone();
            // SAFETY: as above.
            unsafe { x86::avx2::soft_cap(&mut c, cap) };
            for (a, v) in c.iter().zip(&x) {
                let want = cap * (v / cap).tanh();
                assert!((a - want).abs() <= 2e-6 * cap, "cap {cap} at {v}: {a} vs {want}");
            }
        }
    }

    /// Every SIMD path this CPU runs, over the packed layout, equals the scalar dot product
    /// over the GGUF bytes (the same integer sums; only float rounding differs), for each
    /// quantized type, a partial last group and every token-tile remainder.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn packed_kernels_match_scalar_reference_on_every_isa() {
        let mut rng = Lcg(7);
        for ty in QUANTIZED {
            let (rows, cols) = (67, 768);
            let data = random_weights(ty, rows, cols, &mut rng);
            let w = WeightView {
                ty,
                rows,
                cols,
                data: &data,
                packed: None,
            };
            let p = PackedMatrix::pack(&w).unwrap();
            for t in [1usize, 2, 3, 4, 5, 8, 9, 19] {
                let x: Vec<f32> = (0..t * cols).map(|_| rng.next_f32() * 3.0).collect();
                let mut a = QuantizedActs::default();
                a.quantize(&x, cols);
                for r in 0..rows {
                    for ti in 0..t {
                        let s = dot_q_scalar(ty, w.row(r), a.row(ti));
                        let ps = p.dot_scalar(r, a.row(ti));
                        assert!(
                            (s - ps).abs() <= 1e-4 * s.abs().max(1.0),
                            "{ty:?} packed scalar {ps} vs {s}"
                        );
                    }
                }
                for isa in Isa::all_available().into_iter().filter(|i| i.is_simd()) {
                    let mut out = vec![f32::NAN; t * rows];
                    packed_matmul(isa, &p, &a, &mut out);
                    for r in 0..rows {
                        for ti in 0..t {
                            let s = dot_q_scalar(ty, w.row(r), a.row(ti));
                            let g = out[ti * rows + r];
                            assert!(
                                (s - g).abs() <= 1e-4 * s.abs().max(1.0),
                                "{ty:?} {isa} t={t} row {r} token {ti}: scalar {s} simd {g}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The largest integer sums the kernels can meet — every quant at its maximum (15, 31,
    /// 63; Q8_0 at −128), every activation at ±127 — give the scalar result on every path:
    /// the 16-bit partial sums of the AVX2 path without VNNI do not overflow.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn extreme_quants_do_not_overflow_any_path() {
        for ty in QUANTIZED {
            let (rows, cols) = (16, 256);
            let (per, bytes) = ty.block_layout().unwrap();
            let mut data = Vec::new();
            for _ in 0..rows * cols / per {
                let mut blk = vec![if ty == GgmlType::Q8_0 { 0x80 } else { 0xFF }; bytes];
                let at: &[usize] = match ty {
                    GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
                    GgmlType::Q6_K => &[208],
                    _ => &[0, 2],
                };
                for &a in at {
                    blk[a..a + 2].copy_from_slice(&f16_bytes(0.01));
                }
                data.extend(blk);
            }
            let w = WeightView {
                ty,
                rows,
                cols,
                data: &data,
                packed: None,
            };
            let p = PackedMatrix::pack(&w).unwrap();
            for sign in [1.0f32, -1.0] {
                let x = vec![sign; cols];
                let mut a = QuantizedActs::default();
                a.quantize(&x, cols);
                assert!(a.blocks.iter().all(|b| b.qs.iter().all(|&q| q == (127.0 * sign) as i8)));
                let want = dot_q_scalar(ty, w.row(0), a.row(0));
                for isa in Isa::all_available().into_iter().filter(|i| i.is_simd()) {
                    let mut out = vec![0f32; rows];
                    packed_matmul(isa, &p, &a, &mut out);
                    for g in out {
                        assert!(
                            (g - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "{ty:?} {isa} x={sign}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn isa_names_parse_and_unavailable_paths_are_refused() {
        assert_eq!(Isa::parse("scalar").unwrap(), Isa::Scalar);
        assert_eq!(Isa::parse("auto").unwrap(), Isa::best());
        assert!(Isa::parse("sse9").unwrap_err().0.contains("unknown"));
        for i in Isa::ALL {
            match Isa::parse(i.name()) {
                Ok(got) => assert!(got.available()),
                Err(e) => assert!(!i.available() && e.0.contains("cannot run"), "{e}"),
            }
        }
        assert!(Isa::all_available().contains(&Isa::Scalar));
    }

    #[test]
    fn simd_quantize_matches_scalar() {
        let mut rng = Lcg(5);
        let x: Vec<f32> = (0..32 * 64).map(|i| rng.next_f32() * (1 + i % 7) as f32).collect();
        let mut a = QuantizedActs::default();
        a.quantize(&x, 64);
        for (xb, got) in x.chunks_exact(QK).zip(&a.blocks) {
            let mut want = BlockQ8::default();
            quantize_block_scalar(xb, &mut want);
            assert!((got.d - want.d).abs() <= 1e-7);
            // Rounding of exact halves may differ by one step (ties-to-even vs away-from-zero).
            for (g, w) in got.qs.iter().zip(&want.qs) {
                assert!((*g as i32 - *w as i32).abs() <= 1);
            }
            let sum: i32 = got.qs.iter().map(|&q| q as i32).sum();
            assert!((got.s - got.d * sum as f32).abs() <= 1e-5 * got.s.abs().max(1.0));
            for (blk, what) in [(got, "simd"), (&want, "scalar")] {
                let half = |r: std::ops::Range<usize>| blk.qs[r].iter().map(|&q| q as i32).sum::<i32>() as i16;
                assert_eq!(blk.h, [half(0..16), half(16..32)], "{what} half sums");
            }
        }
        // Zero blocks quantize to zero without NaNs.
        let mut z = QuantizedActs::default();
        z.quantize(&[0.0; 32], 32);
        assert_eq!((z.blocks[0].d, z.blocks[0].s), (0.0, 0.0));
    }

    #[test]
    fn matmul_matches_float_reference_for_every_type() {
        let mut rng = Lcg(42);
        for ty in QUANTIZED
            .into_iter()
            .chain([GgmlType::F32, GgmlType::F16, GgmlType::BF16])
        {
            for t in [1usize, 3, 21] {
                let (rows, cols) = (67, 256);
                let data = random_weights(ty, rows, cols, &mut rng);
                let w = WeightView {
                    ty,
                    rows,
                    cols,
                    data: &data,
                    packed: None,
                };
                // With the repacked matrix when the type has one (the SIMD paths use it).
                let p = PackedMatrix::pack(&w);
                let w = WeightView {
                    packed: p.as_ref(),
                    ..w
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
            let b = &a.blocks[i / QK];
            assert!((b.qs[i % QK] as f32 * b.d - v).abs() <= b.d * 0.5 + 1e-6);
        }
    }
}
