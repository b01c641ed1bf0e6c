//! The CUDA backend's device side (see the module docs in `cuda/mod.rs`).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use super::plan::{self, StepInputs};
use super::program::{self, Arg, Buf, Elem, HostData, Kernel, Op, Shape};
use crate::models::{Batch, Model, ModelConfig};

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A library or device is missing: the message says which and what to install.
    #[error("{0}")]
    Unavailable(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    #[error("NVRTC could not compile Hearth's kernels: {0}")]
    Compile(String),
    #[error("{0}")]
    Model(String),
    /// An earlier device error left this engine out of service.
    #[error("the GPU failed earlier ({0}); restart the worker")]
    Failed(String),
}

fn nvrtc_missing() -> Option<CudaError> {
    // SAFETY: probes whether the library can be opened; nothing is called in it.
    (!unsafe { cudarc::nvrtc::sys::is_culib_present() }).then(|| {
        CudaError::Unavailable(
            "NVRTC (libnvrtc.so) was not found on the loader's path: install the CUDA toolkit's NVRTC \
             (or the nvidia-cuda-nvrtc wheel) and add its lib directory to LD_LIBRARY_PATH"
                .into(),
        )
    })
}

/// NVRTC's options for Hearth's kernels. The kernels use fast `__expf` and `rsqrtf` where
/// the CPU engine uses its own approximations; division and square roots stay IEEE.
fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--fmad=true".into(),
    ]
}

/// Compiles [`plan::KERNELS`] to PTX with the NVRTC this process finds (`libnvrtc.so*` on
/// the loader's path) for a virtual architecture such as `compute_90` (None: NVRTC's
/// default). The driver compiles PTX for its device at load, if the PTX is not newer than
/// the driver.
pub fn compile_ptx(arch: Option<&'static str>) -> Result<Ptx, CudaError> {
    if let Some(e) = nvrtc_missing() {
        return Err(e);
    }
    let opts = CompileOptions {
        arch,
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(true),
        name: Some("hearth_kernels.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(plan::KERNELS, opts).map_err(|e| match e {
        CompileError::CompileError { log, .. } => CudaError::Compile(log.to_string_lossy().into_owned()),
        other => CudaError::Compile(format!("{other:?}")),
    })
}

/// Compiles [`plan::KERNELS`] to a device binary (CUBIN) for a real architecture such as
/// `sm_90`: no JIT at load, and CUDA's minor-version compatibility lets it load on a
/// driver of the same CUDA major version as the NVRTC, even an older minor one (a CUBIN
/// from NVRTC 13 is not promised to load on a CUDA 12 driver).
pub fn compile_cubin(arch: &str) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result, sys as nv};
    if let Some(e) = nvrtc_missing() {
        return Err(e);
    }
    let src = std::ffi::CString::new(plan::KERNELS).expect("no NUL in the kernels");
    let failed = |what: &str, e: result::NvrtcError| CudaError::Compile(format!("{what}: {e:?}"));
    let prog = result::create_program(&src, Some(c"hearth_kernels.cu")).map_err(|e| failed("create", e))?;
    // SAFETY: `prog` was created above and is destroyed once, at the end; the buffers are
    // sized by NVRTC's own size calls.
    let out = unsafe {
        let compiled = result::compile_program(prog, &nvrtc_options(arch));
        let out = match compiled {
            Err(e) => {
                let log = result::get_program_log(prog).unwrap_or_default();
                let log: Vec<u8> = log.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect();
                Err(CudaError::Compile(format!("{e:?}: {}", String::from_utf8_lossy(&log))))
            }
            Ok(()) => {
                let mut size = 0usize;
                nv::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| failed("CUBIN size", e))
                    .and_then(|()| {
                        let mut bin = vec![0u8; size];
                        nv::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast())
                            .result()
                            .map_err(|e| failed("CUBIN", e))?;
                        Ok(bin)
                    })
            }
        };
        let _ = result::destroy_program(prog);
        out
    };
    out
}

/// NVRTC's version, e.g. (12, 9).
pub fn nvrtc_version() -> Option<(i32, i32)> {
    nvrtc_missing().is_none().then_some(())?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .ok()?;
    Some((major, minor))
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a CUDA library failed".into())
}

/// The newest PTX architecture NVRTC 12 and 13 both know: for a newer device NVRTC cannot
/// build a binary for (PTX runs on its own architecture and newer ones only).
const PTX_FALLBACK: &str = "compute_90";

/// The device's code: a CUBIN for its exact architecture, else (on devices from sm_90 up)
/// PTX for the driver to compile. Returns the module's image and what it is.
fn device_code((major, minor): (i32, i32)) -> Result<(Ptx, String), CudaError> {
    let sm = format!("sm_{major}{minor}");
    match compile_cubin(&sm) {
        Ok(bin) => Ok((Ptx::from_binary(bin), format!("cubin {sm}"))),
        Err(e @ CudaError::Unavailable(_)) => Err(e),
        Err(why) if major < 9 => Err(CudaError::Unavailable(format!(
            "this NVRTC cannot build Hearth's kernels for {sm} ({why}); NVRTC 13 no longer targets Volta (sm_70): use NVRTC 12"
        ))),
        Err(why) => {
            tracing::warn!(arch = %sm, error = %why, "NVRTC cannot build for this device; loading PTX instead");
            Ok((compile_ptx(Some(PTX_FALLBACK))?, format!("ptx {PTX_FALLBACK}")))
        }
    }
}

/// What the device is, for logs and benchmarks.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceReport {
    pub name: String,
    pub compute_capability: (i32, i32),
    /// The driver's CUDA version (e.g. 13000) and NVRTC's.
    pub driver_cuda: i32,
    pub nvrtc: Option<(i32, i32)>,
    /// `cubin sm_90` or `ptx compute_90`.
    pub kernels: String,
    pub total_mib: usize,
    pub weights_mib: usize,
    pub kv_cache_mib: usize,
    pub kv_blocks: usize,
    pub graphs: bool,
}

/// A device buffer, typed as the program's [`Elem`].
enum DevBuf {
    F16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
    I32(CudaSlice<i32>),
}

impl DevBuf {
    fn alloc(stream: &Arc<CudaStream>, elem: Elem, len: usize) -> Result<Self, CudaError> {
        Ok(match elem {
            Elem::F16 => DevBuf::F16(stream.alloc_zeros(len)?),
            Elem::F32 => DevBuf::F32(stream.alloc_zeros(len)?),
            Elem::I32 => DevBuf::I32(stream.alloc_zeros(len)?),
        })
    }

    fn ptr(&self, stream: &CudaStream) -> u64 {
        match self {
            DevBuf::F16(s) => ptr(s, stream),
            DevBuf::F32(s) => ptr(s, stream),
            DevBuf::I32(s) => ptr(s, stream),
        }
    }
}

/// How [`CudaCompute::new`] sets a model up on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// The GPU, by ordinal.
    pub ordinal: usize,
    /// The KV pool's size (None: see [`plan::kv_blocks`]).
    pub kv_cache_mib: Option<usize>,
    /// The most rows a step carries (the device buffers' size).
    pub max_rows: usize,
    /// The longest sequence served, in tokens (the block tables' width).
    pub context: usize,
    pub block_tokens: usize,
    /// Replay decode steps from CUDA graphs.
    pub graphs: bool,
}

/// A captured decode graph. CUDA graph handles are not tied to a thread; the graph is
/// only ever launched by the engine thread that owns the [`CudaCompute`].
struct Graph(CudaGraph);
// SAFETY: see above: moved once (into the engine thread), never shared.
unsafe impl Send for Graph {}

/// A kernel argument's value, held while a launch borrows it.
enum ArgVal {
    U64(u64),
    I32(i32),
    F32(f32),
}

/// A model on one GPU, with its KV pool: what the engine's runner computes with when its
/// device is CUDA. It runs [`program::forward`] over [`Buf`]fers.
pub struct CudaCompute {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
    kernels: Vec<CudaFunction>,
    cfg: ModelConfig,
    shape: Shape,
    bufs: HashMap<Buf, DevBuf>,
    graphs: HashMap<usize, Graph>,
    /// Its `kv_blocks` are the blocks the scheduler hands out; the block after them is the
    /// padding block (graph replays' padded rows write there). `graphs`: whether decode
    /// steps replay graphs.
    report: DeviceReport,
    /// Set by the first device error (see [`CudaCompute::guard`]).
    failed: Option<String>,
}

fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    // Event tracking is off (one stream), so the returned guard records nothing.
    let (p, _guard) = s.device_ptr(stream);
    p
}

impl CudaCompute {
    /// Uploads `model` to the GPU and builds its KV pool and buffers (see [`CudaOptions`]).
    /// A library too old for a symbol cudarc needs (it panics) is reported as
    /// [`CudaError::Unavailable`].
    pub fn new(model: &Model, o: &CudaOptions) -> Result<Self, CudaError> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Self::open(model, o))).unwrap_or_else(|p| {
            Err(CudaError::Unavailable(format!(
                "CUDA could not start: {}",
                panic_text(&p)
            )))
        })
    }

    fn open(model: &Model, o: &CudaOptions) -> Result<Self, CudaError> {
        let &CudaOptions {
            ordinal,
            kv_cache_mib,
            max_rows,
            context,
            block_tokens,
            graphs,
        } = o;
        let c = model.config.clone();
        plan::check_shape(&c).map_err(CudaError::Model)?;
        let w = model.weights().map_err(CudaError::Model)?;
        // SAFETY: probes whether the libraries can be opened; nothing is called in them.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "the CUDA driver (libcuda.so) was not found: is the NVIDIA driver installed?".into(),
            ));
        }
        // SAFETY: as above.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "cuBLAS (libcublas.so) was not found on the loader's path: install the CUDA toolkit's \
                 cuBLAS (or the nvidia-cublas wheel) and add its lib directory to LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let count = CudaContext::device_count()?;
        if ordinal as i32 >= count {
            return Err(CudaError::Unavailable(format!(
                "no CUDA device {ordinal}: this machine has {count}"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        // One stream does all the work, so cudarc's cross-stream event tracking is not
        // needed, and it must not record events into captured graphs.
        // SAFETY: nothing has been allocated on this context yet.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own: the legacy default stream cannot be captured into a graph.
        let stream = ctx.new_stream()?;
        let cc = ctx.compute_capability()?;
        let mut driver_cuda = 0;
        // SAFETY: one out-parameter.
        unsafe { sys::cuDriverGetVersion(&mut driver_cuda) }.result()?;
        let (code, kernels_kind) = device_code(cc)?;
        let module = ctx.load_module(code).map_err(|e| {
            CudaError::Unavailable(format!(
                "the driver (CUDA {}.{}) could not load Hearth's kernels ({kernels_kind}, NVRTC {:?}): {e}",
                driver_cuda / 1000,
                driver_cuda % 1000 / 10,
                nvrtc_version()
            ))
        })?;
        let kernels = Kernel::ALL
            .iter()
            .map(|k| module.load_function(k.name()))
            .collect::<Result<Vec<_>, _>>()?;

        let mut shape = Shape {
            block_tokens,
            table_width: context.div_ceil(block_tokens),
            max_rows,
            pool_blocks: 0,
            tied: w.tied,
        };
        let mut bufs = HashMap::new();
        let mut weight_bytes = 0;
        for b in program::weight_bufs(c.n_layers, w.tied) {
            let data = program::weight_data(&w, &c, &shape, b).map_err(CudaError::Model)?;
            let dev = match data {
                HostData::F16(v) => DevBuf::F16(stream.clone_htod(&v)?),
                HostData::F32(v) => DevBuf::F32(stream.clone_htod(&v)?),
            };
            weight_bytes += b.len(&c, &shape) * b.elem().bytes();
            bufs.insert(b, dev);
        }
        for b in program::STEP_BUFFERS.into_iter().filter(|b| *b != Buf::Pool) {
            bufs.insert(b, DevBuf::alloc(&stream, b.elem(), b.len(&c, &shape))?);
        }

        let blas = CudaBlas::new(stream.clone())?;
        // A fixed workspace, so that no GEMM allocates while a graph is being captured.
        let workspace_bytes = 32 << 20;
        let workspace = stream.alloc_zeros::<u8>(workspace_bytes)?;
        // SAFETY: the handle and the workspace live as long as `self`.
        unsafe {
            blas_sys::cublasSetWorkspace_v2(*blas.handle(), ptr(&workspace, &stream) as *mut c_void, workspace_bytes)
                .result()?;
        }

        let block_elems = program::block_elems(&c, block_tokens);
        let block_bytes = block_elems * 2;
        stream.synchronize()?;
        let (free, total) = ctx.mem_get_info()?;
        let num_blocks = plan::kv_blocks(free, 512 << 20, block_bytes, kv_cache_mib, shape.table_width)
            .map_err(CudaError::Unavailable)?;
        shape.pool_blocks = num_blocks + 1;
        bufs.insert(Buf::Pool, DevBuf::alloc(&stream, Elem::F16, Buf::Pool.len(&c, &shape))?);
        stream.synchronize()?;
        let report = DeviceReport {
            name: ctx.name()?,
            compute_capability: cc,
            driver_cuda,
            nvrtc: nvrtc_version(),
            kernels: kernels_kind,
            total_mib: total >> 20,
            weights_mib: weight_bytes >> 20,
            kv_cache_mib: (num_blocks * block_bytes) >> 20,
            kv_blocks: num_blocks,
            graphs,
        };
        tracing::info!(
            device = %report.name,
            compute_capability = ?cc,
            weights_mib = report.weights_mib,
            kv_cache_mib = report.kv_cache_mib,
            kernels = %report.kernels,
            driver_cuda = driver_cuda,
            graphs,
            "CUDA backend ready"
        );
        Ok(Self {
            stream,
            blas,
            _workspace: workspace,
            kernels,
            cfg: c,
            shape,
            bufs,
            graphs: HashMap::new(),
            report,
            failed: None,
        })
    }

    pub fn report(&self) -> &DeviceReport {
        &self.report
    }

    /// Replays decode steps from CUDA graphs (or not: `--cuda-graphs false`).
    pub fn set_graphs(&mut self, on: bool) {
        self.report.graphs = on;
    }

    /// KV blocks the scheduler may hand out (the padding block is not among them).
    pub fn num_blocks(&self) -> usize {
        self.report.kv_blocks
    }

    /// f16 elements in one KV block.
    fn block_elems(&self) -> usize {
        program::block_elems(&self.cfg, self.shape.block_tokens)
    }

    fn addr(&self, b: Buf) -> Result<u64, CudaError> {
        self.bufs
            .get(&b)
            .map(|d| d.ptr(&self.stream))
            .ok_or_else(|| CudaError::Model(format!("no device buffer {b:?}")))
    }

    /// `y[t][out] (+)= x[t][inn] · w[out][inn]ᵀ` (f16 inputs, f32 output and accumulation).
    fn gemm(
        &self,
        (w, x, y): (u64, u64, u64),
        (t, out, inn): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let g = plan::gemm_dims(t, out, inn);
        let op = |tr: bool| {
            if tr {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        // SAFETY: `w` holds out×inn, `x` t×inn f16 and `y` t×out f32 elements (the
        // program's buffers, sized for `max_rows` ≥ t; `program` tests check the sizes);
        // alpha and beta are host scalars read at the call.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                op(g.transa),
                op(g.transb),
                g.m,
                g.n,
                g.k,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16F,
                g.lda,
                x as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16F,
                g.ldb,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                g.ldc,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?;
        }
        Ok(())
    }

    /// Queues [`program::forward`] for `rows` rows (inputs already in the buffers) and
    /// `n_logits` logit rows. Nothing here synchronizes, so it can be captured into a graph.
    fn enqueue(&self, rows: usize, n_logits: usize) -> Result<(), CudaError> {
        for op in program::forward(&self.cfg, &self.shape, rows, n_logits) {
            match op {
                Op::Launch {
                    kernel,
                    grid,
                    block,
                    args,
                } => {
                    let vals = args
                        .iter()
                        .map(|a| {
                            Ok(match *a {
                                Arg::Buf(b) => ArgVal::U64(self.addr(b)?),
                                Arg::Null => ArgVal::U64(0),
                                Arg::I32(v) => ArgVal::I32(v),
                                Arg::F32(v) => ArgVal::F32(v),
                            })
                        })
                        .collect::<Result<Vec<_>, CudaError>>()?;
                    let mut launch = self.stream.launch_builder(&self.kernels[kernel as usize]);
                    for v in &vals {
                        match v {
                            ArgVal::U64(p) => launch.arg(p),
                            ArgVal::I32(i) => launch.arg(i),
                            ArgVal::F32(f) => launch.arg(f),
                        };
                    }
                    let cfg = LaunchConfig {
                        grid_dim: (grid.0, grid.1, 1),
                        block_dim: (block, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: the program passes each kernel the arguments of its signature
                    // in kernels.cu (pointers as device addresses of buffers sized by
                    // `Buf::len`), with grids inside those sizes; the emulator test runs the
                    // same program over the same source.
                    unsafe { launch.launch(cfg) }?;
                }
                Op::Gemm {
                    w,
                    x,
                    y,
                    t,
                    out,
                    inn,
                    accumulate,
                } => self.gemm((self.addr(w)?, self.addr(x)?, self.addr(y)?), (t, out, inn), accumulate)?,
            }
        }
        Ok(())
    }

    fn input(&mut self, b: Buf) -> &mut CudaSlice<i32> {
        match self.bufs.get_mut(&b) {
            Some(DevBuf::I32(s)) => s,
            _ => unreachable!("{b:?} is an i32 input buffer"),
        }
    }

    fn upload(&mut self, s: &StepInputs) -> Result<(), CudaError> {
        let st = self.stream.clone();
        let n = s.rows;
        let width = self.shape.table_width;
        st.memcpy_htod(&s.tokens, &mut self.input(Buf::Tokens).slice_mut(..n))?;
        st.memcpy_htod(&s.positions, &mut self.input(Buf::Positions).slice_mut(..n))?;
        st.memcpy_htod(&s.slots, &mut self.input(Buf::Slots).slice_mut(..n))?;
        st.memcpy_htod(&s.tables, &mut self.input(Buf::Tables).slice_mut(..n * width))?;
        if !s.logit_rows.is_empty() {
            let k = s.logit_rows.len();
            st.memcpy_htod(&s.logit_rows, &mut self.input(Buf::LogitRows).slice_mut(..k))?;
        }
        Ok(())
    }

    /// Remembers a device failure (the driver's or cuBLAS's): the context may be unusable
    /// and the KV cache wrong, so every later call fails at once, until the worker restarts.
    fn guard<T>(&mut self, r: Result<T, CudaError>) -> Result<T, CudaError> {
        if let Err(e @ (CudaError::Driver(_) | CudaError::Blas(_))) = &r {
            tracing::error!(error = %e, "the GPU failed; this worker's engine is out of service until it restarts");
            self.failed = Some(e.to_string());
        }
        r
    }

    /// Why the device is out of service, if it is.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Runs `f`, turning a panic inside cudarc (a symbol the loaded library lacks, first
    /// used here) into a failure of the device.
    fn shielded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T, CudaError>) -> Result<T, CudaError> {
        self.check_failed()?;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(self)))
            .unwrap_or_else(|p| Err(CudaError::Failed(panic_text(&p))));
        if let Err(CudaError::Failed(why)) = &r {
            self.failed.get_or_insert_with(|| why.clone());
        }
        self.guard(r)
    }

    fn check_failed(&self) -> Result<(), CudaError> {
        match &self.failed {
            Some(why) => Err(CudaError::Failed(why.clone())),
            None => Ok(()),
        }
    }

    /// One forward step (see [`Model::forward_batch`]): K/V of every row written into
    /// the device pool; the logits of `b.logit_rows` returned, in that order.
    pub fn forward(&mut self, b: &Batch<'_>) -> Result<Vec<f32>, CudaError> {
        if b.adapters.iter().any(Option::is_some) {
            return Err(CudaError::Model(
                "LoRA adapters are computed on the CPU backend only".into(),
            ));
        }
        self.shielded(|c| c.step(b))
    }

    fn step(&mut self, b: &Batch<'_>) -> Result<Vec<f32>, CudaError> {
        let t = b.tokens.len();
        if t == 0 {
            return Ok(Vec::new());
        }
        // The engine thread is not the one that loaded the model: cuBLAS uses the thread's
        // current context.
        self.stream.context().bind_to_thread()?;
        if t > self.shape.max_rows {
            return Err(CudaError::Model(format!(
                "a step of {t} rows is larger than the device buffers ({})",
                self.shape.max_rows
            )));
        }
        let pad = self.num_blocks() as u32;
        let step = program::step(b, &self.shape, pad, self.report.graphs).map_err(CudaError::Model)?;
        self.upload(&step.inputs)?;
        match step.bucket {
            Some(bucket) if self.graphs.contains_key(&bucket) => self.graphs[&bucket].0.launch()?,
            Some(bucket) => {
                // A first eager run computes this step and settles cuBLAS's plans for these
                // shapes; then the same work is captured for the next steps of this size.
                self.enqueue(step.rows, step.n_logits)?;
                self.stream.synchronize()?;
                match self.capture(bucket) {
                    Ok(graph) => {
                        tracing::debug!(rows = bucket, "captured a decode graph");
                        self.graphs.insert(bucket, Graph(graph));
                    }
                    Err(e) => {
                        // This step's logits are already computed; later steps run eagerly.
                        tracing::warn!(error = %e, rows = bucket, "capturing a decode graph failed; CUDA graphs are off");
                        self.set_graphs(false);
                    }
                }
            }
            None => self.enqueue(step.rows, step.n_logits)?,
        }
        let n_logits = b.logit_rows.len();
        let vocab = self.cfg.vocab_size;
        let mut out = vec![0f32; n_logits * vocab];
        match self.bufs.get(&Buf::Logits) {
            Some(DevBuf::F32(l)) if n_logits > 0 => self.stream.memcpy_dtoh(&l.slice(..n_logits * vocab), &mut out)?,
            _ => self.stream.synchronize()?,
        }
        Ok(out)
    }

    /// Captures the forward pass of `bucket` rows into a graph; capture always ends, even
    /// when queueing failed.
    fn capture(&self, bucket: usize) -> Result<CudaGraph, CudaError> {
        let captured = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let queued = self.enqueue(bucket, bucket);
            let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            queued?;
            graph?.ok_or_else(|| CudaError::Model("the decode graph captured nothing".into()))
        }));
        captured.unwrap_or_else(|p| {
            // A panic inside cudarc (a missing graph symbol): end the capture if it is still
            // open, so that the stream runs eagerly again.
            if let Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE) = self.stream.capture_status() {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.stream.end_capture(sys::CUgraphInstantiate_flags(0))
                }));
            }
            Err(CudaError::Model(format!("capturing panicked: {}", panic_text(&p))))
        })
    }

    fn pool(&self) -> &CudaSlice<u16> {
        match self.bufs.get(&Buf::Pool) {
            Some(DevBuf::F16(p)) => p,
            _ => unreachable!("the pool is an f16 buffer"),
        }
    }

    fn block_range(&self, block: u32) -> std::ops::Range<usize> {
        let n = self.block_elems();
        let at = block as usize * n;
        at..at + n
    }

    /// A whole block's bytes, as [`crate::kv::pool::KvPool::read_block`] gives them (f16).
    pub fn read_block(&mut self, block: u32) -> Result<Vec<u8>, CudaError> {
        self.shielded(|c| c.read_block_inner(block))
    }

    fn read_block_inner(&self, block: u32) -> Result<Vec<u8>, CudaError> {
        if block as usize >= self.num_blocks() {
            return Err(CudaError::Model(format!("no KV block {block}")));
        }
        let mut h = vec![0u16; self.block_elems()];
        self.stream
            .memcpy_dtoh(&self.pool().slice(self.block_range(block)), &mut h)?;
        Ok(crate::kv::pool::as_bytes(&h).to_vec())
    }

    /// Overwrites a block with [`CudaCompute::read_block`]'s (or an f16 CPU pool's) bytes;
    /// false if the length differs.
    pub fn write_block(&mut self, block: u32, bytes: &[u8]) -> Result<bool, CudaError> {
        self.shielded(|c| c.write_block_inner(block, bytes))
    }

    fn write_block_inner(&mut self, block: u32, bytes: &[u8]) -> Result<bool, CudaError> {
        if bytes.len() != self.block_elems() * 2 || block as usize >= self.num_blocks() {
            return Ok(false);
        }
        let mut h = vec![0u16; self.block_elems()];
        crate::kv::pool::as_bytes_mut(&mut h).copy_from_slice(bytes);
        let range = self.block_range(block);
        let st = self.stream.clone();
        match self.bufs.get_mut(&Buf::Pool) {
            Some(DevBuf::F16(p)) => st.memcpy_htod(&h, &mut p.slice_mut(range))?,
            _ => unreachable!("the pool is an f16 buffer"),
        }
        Ok(true)
    }

    /// Copies a block (the prefix cache's copy-on-write).
    pub fn copy_block(&mut self, from: u32, to: u32) -> Result<(), CudaError> {
        self.shielded(|c| c.copy_block_inner(from, to))
    }

    fn copy_block_inner(&self, from: u32, to: u32) -> Result<(), CudaError> {
        if from as usize >= self.num_blocks() || to as usize >= self.num_blocks() {
            return Err(CudaError::Model(format!("no KV block {}", from.max(to))));
        }
        self.stream.context().bind_to_thread()?;
        let base = self.addr(Buf::Pool)?;
        let (f, t) = (self.block_range(from).start, self.block_range(to).start);
        // SAFETY: both blocks are inside the pool (checked above) and distinct blocks do
        // not overlap.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                base + 2 * t as u64,
                base + 2 * f as u64,
                self.block_elems() * 2,
                self.stream.cu_stream(),
            )?;
        }
        Ok(())
    }
}
