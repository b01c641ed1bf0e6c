//! The CUDA backend checked without a GPU: its kernels (`src/cuda/kernels.cu`, the very
//! source NVRTC compiles) are built for the CPU with a small emulator of CUDA's execution
//! model (`tests/emulator/emulate.cpp`: blocks, threads as fibers, `__syncthreads`, warp
//! shuffles), and the backend's forward program (`cuda::program::forward`, the launches and
//! GEMMs `CudaCompute` issues, with its buffers, step assembly and graph padding) is run
//! over them on synthetic Llama models, step for step against the CPU engine: the logits of
//! every sampled row, and the KV blocks written (which must match the CPU pool's layout
//! byte for byte, up to rounding, so that blocks move between CPU and GPU workers).
//!
//! What this cannot check: cudarc and cuBLAS calls, graph capture, NVRTC's code generation
//! and the device's own arithmetic (the GEMMs here are BLAS's definition, in f32).
//!
//! x86-64 only: the emulator converts f16 with F16C.
#![cfg(target_arch = "x86_64")]

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use hearth_engine::cuda::plan;
use hearth_engine::cuda::program::{self, Arg, Buf, Elem, HostData, Op, Shape};
use hearth_engine::formats::gguf::GgufFile;
use hearth_engine::kv::pool::{KvDtype, KvPool};
use hearth_engine::models::{Batch, ForwardScratch, Model, ModelConfig};
use hearth_engine::step::sampling::argmax;
use rayon::prelude::*;

type LaunchFn = unsafe extern "C" fn(*const c_char, u32, u32, u32, *mut *mut c_void) -> i32;

/// Builds the emulator with g++ (once per test binary) and returns its launch entry point.
fn emulator() -> LaunchFn {
    static LAUNCH: OnceLock<usize> = OnceLock::new();
    let addr = *LAUNCH.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("libhearth_cuda_emu.so");
        let status = std::process::Command::new("g++")
            .args([
                "-std=c++20",
                "-O2",
                "-shared",
                "-fPIC",
                "-mf16c",
                "-DHEARTH_CPU_EMULATION",
                "-o",
            ])
            .arg(&out)
            .arg(root.join("tests/emulator/emulate.cpp"))
            .status()
            .expect("g++ (the kernel emulator is C++)");
        assert!(status.success(), "the kernel emulator did not compile");
        let path = CString::new(out.to_str().unwrap()).unwrap();
        // SAFETY: loading a library this test just built; it has no initialisers beyond
        // zeroing its statics.
        let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!lib.is_null(), "dlopen of the emulator failed");
        // SAFETY: as above; the symbol is `extern "C" int hearth_emu_launch(...)`.
        let sym = unsafe { libc::dlsym(lib, c"hearth_emu_launch".as_ptr()) };
        assert!(!sym.is_null(), "hearth_emu_launch missing");
        sym as usize
    });
    // SAFETY: the address of `hearth_emu_launch`, whose signature is `LaunchFn`.
    unsafe { std::mem::transmute::<usize, LaunchFn>(addr) }
}

/// A minimal GGUF v3 writer for synthetic models.
#[derive(Default)]
struct GgufWriter {
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

fn gguf_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl GgufWriter {
    fn u32(&mut self, k: &str, v: u32) {
        gguf_str(&mut self.kv, k);
        self.kv.extend(4u32.to_le_bytes());
        self.kv.extend(v.to_le_bytes());
        self.n_kv += 1;
    }
    fn f32(&mut self, k: &str, v: f32) {
        gguf_str(&mut self.kv, k);
        self.kv.extend(6u32.to_le_bytes());
        self.kv.extend(v.to_le_bytes());
        self.n_kv += 1;
    }
    fn str(&mut self, k: &str, v: &str) {
        gguf_str(&mut self.kv, k);
        self.kv.extend(8u32.to_le_bytes());
        gguf_str(&mut self.kv, v);
        self.n_kv += 1;
    }
    /// `dims` in GGUF order (columns first); F32 (type 0) or F16 (type 1) data.
    fn tensor(&mut self, name: &str, dims: &[u64], values: &[f32], f16: bool) {
        let data = if f16 {
            values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
                .collect()
        } else {
            values.iter().flat_map(|v| v.to_le_bytes()).collect()
        };
        self.tensors.push((name.into(), dims.to_vec(), u32::from(f16), data));
    }
    fn write(&self, path: &Path) {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        let mut offset = 0u64;
        for (name, dims, ty, data) in &self.tensors {
            gguf_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        out.resize(out.len().div_ceil(32) * 32, 0);
        for (_, _, _, data) in &self.tensors {
            out.extend(data);
            out.resize(out.len().div_ceil(32) * 32, 0);
        }
        std::fs::write(path, out).unwrap();
    }
}

/// Deterministic pseudo-random values in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

struct Spec {
    layers: usize,
    d: usize,
    heads: usize,
    kv_heads: usize,
    ff: usize,
    vocab: usize,
    tied: bool,
    halves: bool,
}

/// A synthetic Llama model with F16 matrices (the GPU's weight format, so both sides
/// compute with the same weights).
fn synthetic_model(s: &Spec, seed: u64) -> Model {
    let mut w = GgufWriter::default();
    let mut rng = Rng(seed);
    let hd = s.d / s.heads;
    let kvd = s.kv_heads * hd;
    w.str("general.architecture", "llama");
    w.u32("llama.block_count", s.layers as u32);
    w.u32("llama.embedding_length", s.d as u32);
    w.u32("llama.feed_forward_length", s.ff as u32);
    w.u32("llama.attention.head_count", s.heads as u32);
    w.u32("llama.attention.head_count_kv", s.kv_heads as u32);
    w.u32("llama.context_length", 256);
    w.u32("llama.vocab_size", s.vocab as u32);
    w.f32("llama.rope.freq_base", 10000.0);
    w.f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
    if s.halves {
        w.str("hearth.rope.layout", "halves");
    }
    let m = |rng: &mut Rng, rows: usize, cols: usize| rng.vec(rows * cols, 1.7 / (cols as f32).sqrt());
    let norm = |rng: &mut Rng, n: usize| rng.vec(n, 0.2).into_iter().map(|v| 1.0 + v).collect::<Vec<_>>();
    let embed = rng.vec(s.vocab * s.d, 1.0);
    w.tensor("token_embd.weight", &[s.d as u64, s.vocab as u64], &embed, true);
    for l in 0..s.layers {
        let n = |t: &str| format!("blk.{l}.{t}.weight");
        let v = norm(&mut rng, s.d);
        w.tensor(&n("attn_norm"), &[s.d as u64], &v, false);
        for (t, rows, cols) in [
            ("attn_q", s.d, s.d),
            ("attn_k", kvd, s.d),
            ("attn_v", kvd, s.d),
            ("attn_output", s.d, s.d),
        ] {
            let v = m(&mut rng, rows, cols);
            w.tensor(&n(t), &[cols as u64, rows as u64], &v, true);
        }
        let v = norm(&mut rng, s.d);
        w.tensor(&n("ffn_norm"), &[s.d as u64], &v, false);
        for (t, rows, cols) in [("ffn_gate", s.ff, s.d), ("ffn_up", s.ff, s.d), ("ffn_down", s.d, s.ff)] {
            let v = m(&mut rng, rows, cols);
            w.tensor(&n(t), &[cols as u64, rows as u64], &v, true);
        }
    }
    let v = norm(&mut rng, s.d);
    w.tensor("output_norm.weight", &[s.d as u64], &v, false);
    if !s.tied {
        let v = m(&mut rng, s.vocab, s.d);
        w.tensor("output.weight", &[s.d as u64, s.vocab as u64], &v, true);
    }
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("synthetic-{seed}.gguf"));
    w.write(&path);
    Model::load_with(GgufFile::open(&path).unwrap(), false).unwrap()
}

/// The CUDA backend's program over emulated device memory.
struct Emulated {
    launch: LaunchFn,
    c: ModelConfig,
    shape: Shape,
    num_blocks: usize,
    /// 8-byte aligned storage per buffer.
    bufs: HashMap<Buf, Vec<u64>>,
}

impl Emulated {
    fn new(model: &Model, max_rows: usize, context: usize, bt: usize, num_blocks: usize) -> Self {
        let c = model.config.clone();
        plan::check_shape(&c).unwrap();
        let w = model.weights().unwrap();
        let shape = Shape {
            block_tokens: bt,
            table_width: context.div_ceil(bt),
            max_rows,
            pool_blocks: num_blocks + 1,
            tied: w.tied,
        };
        let mut e = Self {
            launch: emulator(),
            c: c.clone(),
            shape,
            num_blocks,
            bufs: HashMap::new(),
        };
        for b in program::STEP_BUFFERS {
            e.alloc(b);
        }
        for b in program::weight_bufs(c.n_layers, w.tied) {
            let data = program::weight_data(&w, &c, &shape, b).unwrap();
            e.alloc(b);
            match data {
                HostData::F16(v) => e.f16_mut(b).copy_from_slice(&v),
                HostData::F32(v) => e.f32_mut(b).copy_from_slice(&v),
            }
        }
        e
    }

    fn alloc(&mut self, b: Buf) {
        let bytes = b.len(&self.c, &self.shape) * b.elem().bytes();
        self.bufs.insert(b, vec![0u64; bytes.div_ceil(8)]);
    }

    fn raw(&mut self, b: Buf) -> (*mut u8, usize) {
        let len = b.len(&self.c, &self.shape);
        (self.bufs.get_mut(&b).unwrap().as_mut_ptr().cast(), len)
    }

    fn f16_mut(&mut self, b: Buf) -> &mut [u16] {
        assert_eq!(b.elem(), Elem::F16);
        let (p, n) = self.raw(b);
        // SAFETY: the buffer holds `n` 2-byte elements, 8-byte aligned.
        unsafe { std::slice::from_raw_parts_mut(p.cast(), n) }
    }

    fn f32_mut(&mut self, b: Buf) -> &mut [f32] {
        assert_eq!(b.elem(), Elem::F32);
        let (p, n) = self.raw(b);
        // SAFETY: as above, 4-byte elements.
        unsafe { std::slice::from_raw_parts_mut(p.cast(), n) }
    }

    fn i32_mut(&mut self, b: Buf) -> &mut [i32] {
        assert_eq!(b.elem(), Elem::I32);
        let (p, n) = self.raw(b);
        // SAFETY: as above, 4-byte elements.
        unsafe { std::slice::from_raw_parts_mut(p.cast(), n) }
    }

    fn forward(&mut self, batch: &Batch<'_>, graphs: bool) -> Vec<f32> {
        let step = program::step(batch, &self.shape, self.num_blocks as u32, graphs).unwrap();
        let s = &step.inputs;
        self.i32_mut(Buf::Tokens)[..s.rows].copy_from_slice(&s.tokens);
        self.i32_mut(Buf::Positions)[..s.rows].copy_from_slice(&s.positions);
        self.i32_mut(Buf::Slots)[..s.rows].copy_from_slice(&s.slots);
        let width = self.shape.table_width;
        self.i32_mut(Buf::Tables)[..s.rows * width].copy_from_slice(&s.tables);
        self.i32_mut(Buf::LogitRows)[..s.logit_rows.len()].copy_from_slice(&s.logit_rows);
        for op in program::forward(&self.c, &self.shape, step.rows, step.n_logits) {
            self.exec(op);
        }
        let n = batch.logit_rows.len() * self.c.vocab_size;
        self.f32_mut(Buf::Logits)[..n].to_vec()
    }

    fn exec(&mut self, op: Op) {
        match op {
            Op::Launch {
                kernel,
                grid,
                block,
                args,
            } => {
                let mut slots: Vec<u64> = args
                    .iter()
                    .map(|a| match *a {
                        Arg::Buf(b) => self.raw(b).0 as u64,
                        Arg::Null => 0,
                        Arg::I32(v) => v as u32 as u64,
                        Arg::F32(v) => v.to_bits() as u64,
                    })
                    .collect();
                let mut ptrs: Vec<*mut c_void> = slots.iter_mut().map(|s| (s as *mut u64).cast()).collect();
                let name = CString::new(kernel.name()).unwrap();
                // SAFETY: each argument slot holds its value in its low bytes (little
                // endian), as the kernel's parameter type reads it; buffers are sized by
                // the program.
                let rc = unsafe { (self.launch)(name.as_ptr(), grid.0, grid.1, block, ptrs.as_mut_ptr()) };
                assert_eq!(rc, 0, "launch of {} failed", kernel.name());
            }
            Op::Gemm {
                w,
                x,
                y,
                t,
                out,
                inn,
                accumulate,
            } => {
                let g = plan::gemm_dims(t, out, inn);
                let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
                let (lda, ldb, ldc) = (g.lda as usize, g.ldb as usize, g.ldc as usize);
                let wv: Vec<f32> = self.f16_mut(w)[..m * lda]
                    .iter()
                    .map(|h| half::f16::from_bits(*h).to_f32())
                    .collect();
                let xv: Vec<f32> = self.f16_mut(x)[..n * ldb]
                    .iter()
                    .map(|h| half::f16::from_bits(*h).to_f32())
                    .collect();
                let yv = self.f32_mut(y);
                // BLAS's column-major definition, C = op(A)·op(B) (+ C), as cuBLAS computes
                // it; `a(i, p)` and `b(p, j)` index by the transposition flags.
                let a = |i: usize, p: usize| if g.transa { wv[p + i * lda] } else { wv[i + p * lda] };
                let b = |p: usize, j: usize| if g.transb { xv[j + p * ldb] } else { xv[p + j * ldb] };
                yv[..n * ldc].par_chunks_mut(ldc).enumerate().for_each(|(j, col)| {
                    for (i, c) in col[..m].iter_mut().enumerate() {
                        // Eight partial sums, so that the loop vectorises.
                        let mut acc = [0f32; 8];
                        for p in 0..k {
                            acc[p % 8] += a(i, p) * b(p, j);
                        }
                        let sum: f32 = acc.iter().sum();
                        *c = sum + if accumulate { *c } else { 0.0 };
                    }
                });
            }
        }
    }

    fn read_block(&mut self, block: u32) -> Vec<u16> {
        let n = program::block_elems(&self.c, self.shape.block_tokens);
        self.f16_mut(Buf::Pool)[block as usize * n..(block as usize + 1) * n].to_vec()
    }
}

/// Max |a − b| and the scale (max |b|).
fn diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len());
    let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
    (d, b.iter().fold(0.0f32, |m, v| m.max(v.abs())))
}

/// The CPU engine and the emulated device over the same steps.
struct Pair<'m> {
    model: &'m Model,
    cpu: KvPool,
    gpu: Emulated,
    /// The worst logit error so far, as a fraction of the logits' scale.
    worst: f32,
}

impl Pair<'_> {
    /// One step on both sides; asserts the logits agree, row by row.
    fn step(&mut self, batch: &Batch<'_>, graphs: bool, what: &str) {
        let want = self
            .model
            .forward_batch(batch, &mut self.cpu, &mut ForwardScratch::precise());
        let got = self.gpu.forward(batch, graphs);
        let vocab = self.model.config.vocab_size;
        for (r, (g, w)) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)).enumerate() {
            let (d, scale) = diff(g, w);
            self.worst = self.worst.max(d / scale);
            // f16 weights on both sides; the device path also rounds activations and KV to
            // f16. A wrong index or a missed term is off by the logits' own size.
            assert!(
                d <= 0.01 * scale,
                "{what}, logit row {r}: max |Δ| {d} against a scale of {scale}"
            );
            let mut sorted = w.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 2.0 * d {
                assert_eq!(argmax(g), argmax(w), "{what}, logit row {r}: another top token");
            }
        }
    }
}

fn run_scenario(spec: Spec, seed: u64) {
    let model = synthetic_model(&spec, seed);
    let bt = hearth_protocol::DEFAULT_BLOCK_TOKENS;
    let num_blocks = 20;
    let mut pair = Pair {
        model: &model,
        cpu: KvPool::new(model.kv_shape(bt), KvDtype::F16, num_blocks),
        gpu: Emulated::new(&model, 160, 256, bt, num_blocks),
        worst: 0.0,
    };
    let v = spec.vocab as u32;
    let (ta, tb, tc) = (vec![3u32, 0, 6], vec![1u32], vec![2u32, 5]);

    // 1. Two prompts in one eager step: A spans two blocks (20 tokens), B one (7).
    let tokens: Vec<u32> = (0..27).map(|i| (i * 7 + 3) % v).collect();
    let positions: Vec<usize> = (0..20).chain(0..7).collect();
    let tables: Vec<&[u32]> = (0..27).map(|i| if i < 20 { &ta[..] } else { &tb[..] }).collect();
    let batch = Batch {
        tokens: &tokens,
        positions: &positions,
        tables: &tables,
        logit_rows: &[19, 26],
        adapters: &[],
    };
    pair.step(&batch, true, "two prefills");

    // 2. Both decode: a graph-padded step (2 rows, bucket 2), then the same eagerly.
    for (k, graphs) in [(0usize, true), (1, false), (2, true)] {
        let tokens = [(11 + k as u32) % v, (5 + k as u32) % v];
        let positions = [20 + k, 7 + k];
        let tables: Vec<&[u32]> = vec![&ta, &tb];
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            tables: &tables,
            logit_rows: &[0, 1],
            adapters: &[],
        };
        pair.step(&batch, graphs, &format!("decode {k}"));
    }

    // 3. Speculative verification (B: 3 rows, every one sampled) beside A's decode and a
    //    new prompt C: a mixed step, eager; then B and A alone (4 rows, bucket 4).
    let tokens: Vec<u32> = [9, 10, 11, 12]
        .into_iter()
        .chain((0..5).map(|i| (40 + i) % v))
        .collect();
    let positions: Vec<usize> = vec![23, 10, 11, 12, 0, 1, 2, 3, 4];
    let tables: Vec<&[u32]> = vec![&ta, &tb, &tb, &tb, &tc, &tc, &tc, &tc, &tc];
    let batch = Batch {
        tokens: &tokens,
        positions: &positions,
        tables: &tables,
        logit_rows: &[0, 1, 2, 3, 8],
        adapters: &[],
    };
    pair.step(&batch, true, "mixed step");
    let tokens = [13u32, 14, 15, 16];
    let positions = [24usize, 13, 14, 15];
    let tables: Vec<&[u32]> = vec![&ta, &tb, &tb, &tb];
    let batch = Batch {
        tokens: &tokens,
        positions: &positions,
        tables: &tables,
        logit_rows: &[0, 1, 2, 3],
        adapters: &[],
    };
    pair.step(&batch, true, "speculative verify");

    // 4. A long prompt (150 tokens: attention spreads over all 4 warps, several chunks of
    //    32 positions each, merged at the end), then its decode steps, graph-padded.
    let td: Vec<u32> = (8..18).collect();
    let tokens: Vec<u32> = (0..150).map(|i| (i * 13 + 1) % v).collect();
    let positions: Vec<usize> = (0..150).collect();
    let tables: Vec<&[u32]> = vec![&td; 150];
    let batch = Batch {
        tokens: &tokens,
        positions: &positions,
        tables: &tables,
        logit_rows: &[63, 127, 149],
        adapters: &[],
    };
    pair.step(&batch, true, "long prompt");
    for k in 0..2 {
        let tables: Vec<&[u32]> = vec![&td, &ta];
        let batch = Batch {
            tokens: &[(21 + k) % v, (31 + k) % v],
            positions: &[150 + k as usize, 25 + k as usize],
            tables: &tables,
            logit_rows: &[0, 1],
            adapters: &[],
        };
        pair.step(&batch, true, &format!("long decode {k}"));
    }

    // 5. The KV blocks: the device pool's bytes are the CPU pool's layout.
    let mut kv_worst = 0f32;
    for block in [3u32, 0, 1, 2, 8, 12, 17] {
        let want: Vec<f32> = pair
            .cpu
            .read_block(block)
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        let got: Vec<f32> = pair
            .gpu
            .read_block(block)
            .iter()
            .map(|h| half::f16::from_bits(*h).to_f32())
            .collect();
        let (d, scale) = diff(&got, &want);
        kv_worst = kv_worst.max(d / scale);
        assert!(d <= 0.01 * scale, "KV block {block}: max |Δ| {d} against {scale}");
    }
    eprintln!(
        "{} layers, d {}, {}/{} heads, {}, {}: worst logit error {:.2e} of scale, KV {:.2e}",
        spec.layers,
        spec.d,
        spec.heads,
        spec.kv_heads,
        if spec.tied { "tied" } else { "untied" },
        if spec.halves { "RoPE halves" } else { "RoPE adjacent" },
        pair.worst,
        kv_worst
    );
}

#[test]
fn emulated_kernels_match_the_cpu_engine_gqa_tied_adjacent_rope() {
    run_scenario(
        Spec {
            layers: 2,
            d: 128,
            heads: 4,
            kv_heads: 2,
            ff: 192,
            vocab: 96,
            tied: true,
            halves: false,
        },
        7,
    );
}

#[test]
fn emulated_kernels_match_the_cpu_engine_head_dim_128_untied_halves_rope() {
    // head_dim 128 (4 values a lane in attention), no GQA, a separate output matrix and
    // Hugging Face's RoPE pairing.
    run_scenario(
        Spec {
            layers: 2,
            d: 256,
            heads: 2,
            kv_heads: 2,
            ff: 320,
            vocab: 80,
            tied: false,
            halves: true,
        },
        11,
    );
}

#[test]
fn emulated_kernels_give_the_golden_answer_on_the_default_model() {
    // The default model (Q4_1 matrices, a Q8_0 tied embedding, 30 layers, 9/3 heads of 64)
    // through the device program: the golden prompt prefilled in one eager step, then the
    // greedy answer decoded with graph-padded steps (see shared/reference/smollm2).
    let path = crate::harness::default_model();
    let model = Model::load_unpacked(GgufFile::open(&path).unwrap(), Default::default()).unwrap();
    let prompt: [u32; 42] = [
        1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2,
        198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 6330, 30, 2, 198, 1, 520, 9531, 198,
    ];
    let bt = hearth_protocol::DEFAULT_BLOCK_TOKENS;
    let mut gpu = Emulated::new(&model, 64, 128, bt, 8);
    let table: Vec<u32> = vec![5, 2, 7, 0];
    let positions: Vec<usize> = (0..prompt.len()).collect();
    let tables: Vec<&[u32]> = vec![&table; prompt.len()];
    let first = gpu.forward(
        &Batch {
            tokens: &prompt,
            positions: &positions,
            tables: &tables,
            logit_rows: &[prompt.len() - 1],
            adapters: &[],
        },
        true,
    );
    let mut top: Vec<usize> = (0..first.len()).collect();
    top.sort_by(|a, b| first[*b].total_cmp(&first[*a]));
    let mut top5 = top[..5].to_vec();
    eprintln!(
        "first position top-5 {top5:?}: {:?}",
        top5.iter().map(|&i| first[i]).collect::<Vec<_>>()
    );
    assert_eq!(top5[0], 504);
    top5.sort();
    assert_eq!(top5, [57, 60, 504, 7026, 38634], "the reference's top-5 set");
    let mut answer = vec![504u32];
    while answer.len() < 8 {
        let pos = prompt.len() + answer.len() - 1;
        let tables: Vec<&[u32]> = vec![&table];
        let logits = gpu.forward(
            &Batch {
                tokens: &[*answer.last().unwrap()],
                positions: &[pos],
                tables: &tables,
                logit_rows: &[0],
                adapters: &[],
            },
            true,
        );
        answer.push(argmax(&logits));
    }
    assert_eq!(
        answer,
        [504, 3575, 282, 4649, 314, 7042, 30, 2],
        "The capital of France is Paris.<|im_end|>"
    );
}
