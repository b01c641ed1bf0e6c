//! Where the forward pass runs ([`Compute`]): on the CPU with the KV pool in memory, or on
//! a CUDA device that holds its own weights and pool; reading, writing and copying KV
//! blocks wherever the pool is.

use crate::cuda::Device;
use crate::engine::config::{kv_blocks, EngineConfig, EngineError};
use crate::kv::pool::KvPool;
use crate::models::{Batch, ForwardScratch, Model};
use crate::pipeline::link::{StageLink, Ticket};
use crate::pipeline::wire::Setup;

/// Where the forward pass runs, with the KV pool it writes.
pub(super) enum Compute {
    Cpu {
        pool: KvPool,
        scratch: ForwardScratch,
    },
    /// A pipeline's leader: its layers here, the rest on the stages after it.
    Pipeline {
        pool: KvPool,
        scratch: ForwardScratch,
        link: Box<StageLink>,
    },
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::CudaCompute>),
}

impl Compute {
    /// The compute for `cfg.device`, its KV cache's MiB and blocks.
    pub(super) fn new(
        model: &Model,
        cfg: &EngineConfig,
        bt: usize,
        context: usize,
    ) -> Result<(Self, usize, usize), EngineError> {
        match cfg.device {
            Device::Cpu if cfg.pipeline.is_some() || !model.span().is_whole() => {
                let Some(p) = cfg.pipeline.clone() else {
                    return Err(EngineError::Start(format!(
                        "this engine computes {} only: a follower stage serves with `hearth worker --stage` and --stage-listen",
                        model.span()
                    )));
                };
                if !model.span().first() {
                    return Err(EngineError::Start(
                        "a pipeline's leader computes its first stage".into(),
                    ));
                }
                let fingerprint = crate::models::stage::fingerprint(model.file());
                let (mut link, most_layers) = StageLink::connect(p, model, fingerprint).map_err(EngineError::Start)?;
                // Every stage holds the same block ids: as many as the largest stage's
                // layers fit in the KV budget.
                let widest = crate::kv::pool::KvShape {
                    n_layers: most_layers.max(1),
                    ..model.kv_shape(bt)
                };
                let (mib, num_blocks) = kv_blocks(widest, cfg);
                link.set_up(Setup {
                    num_blocks,
                    block_tokens: bt,
                    kv_dtype: cfg.kv_dtype.name().into(),
                })
                .map_err(EngineError::Start)?;
                let pool = KvPool::new(model.kv_shape(bt), cfg.kv_dtype, num_blocks);
                Ok((
                    Compute::Pipeline {
                        pool,
                        scratch: ForwardScratch::default(),
                        link: Box::new(link),
                    },
                    mib,
                    num_blocks,
                ))
            }
            Device::Cpu => {
                let (mib, num_blocks) = kv_blocks(model.kv_shape(bt), cfg);
                let pool = KvPool::new(model.kv_shape(bt), cfg.kv_dtype, num_blocks);
                Ok((
                    Compute::Cpu {
                        pool,
                        scratch: ForwardScratch::default(),
                    },
                    mib,
                    num_blocks,
                ))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                if cfg.kv_dtype != crate::kv::pool::KvDtype::F16 {
                    return Err(EngineError::Start("the CUDA backend keeps its KV cache in f16".into()));
                }
                // Rows a step carries: at most the token budget (draft tokens share it).
                let max_rows = cfg.max_batch_tokens.max(1);
                let options = crate::cuda::CudaOptions {
                    ordinal,
                    kv_cache_mib: cfg.kv_cache_mib,
                    max_rows,
                    context,
                    block_tokens: bt,
                    graphs: cfg.cuda_graphs,
                };
                let c =
                    crate::cuda::CudaCompute::new(model, &options).map_err(|e| EngineError::Start(e.to_string()))?;
                let (mib, blocks) = (c.report().kv_cache_mib, c.num_blocks());
                Ok((Compute::Cuda(Box::new(c)), mib, blocks))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => {
                let _ = context; // what the CUDA backend would size its block tables by
                Err(EngineError::Start(
                    "this build has no CUDA backend (build hearth with `--features cuda`)".into(),
                ))
            }
        }
    }

    /// One step; `Ok(None)` if `stop` gave it up between layers (the CPU backend asks
    /// before each layer; a GPU step is short and runs whole).
    pub(super) fn forward(
        &mut self,
        model: &Model,
        batch: &Batch<'_>,
        stop: &mut dyn FnMut(usize) -> bool,
    ) -> Result<Option<Vec<f32>>, String> {
        match self {
            Compute::Cpu { pool, scratch } => Ok(model.forward_batch_until(batch, pool, scratch, stop)),
            // A step in flight on other processes is not cut.
            Compute::Pipeline { pool, scratch, link } => link.forward(model, pool, scratch, batch).map(Some),
            #[cfg(feature = "cuda")]
            Compute::Cuda(c) => {
                let _ = stop;
                c.forward(batch).map(Some).map_err(|e| e.to_string())
            }
        }
    }

    /// Steps a pipeline's leader keeps in flight (its stages); 1 elsewhere.
    pub(super) fn depth(&self) -> usize {
        match self {
            Compute::Pipeline { link, .. } => link.depth(),
            _ => 1,
        }
    }

    /// Starts a pipeline step (the leader's layers, sent on); its logits come from
    /// [`Self::finish`], in launch order.
    pub(super) fn launch(&mut self, model: &Model, batch: &Batch<'_>) -> Result<Ticket, String> {
        match self {
            Compute::Pipeline { pool, scratch, link } => link.launch(model, pool, scratch, batch),
            _ => unreachable!("only a pipeline's leader launches steps"),
        }
    }

    /// Gives a pipeline's group up (a step failed part-way): reconnected and set up afresh.
    pub(super) fn lose(&mut self, why: &str) {
        if let Compute::Pipeline { link, .. } = self {
            link.lose(why);
        }
    }

    pub(super) fn finish(&mut self, ticket: &Ticket, vocab: usize) -> Result<Vec<f32>, String> {
        match self {
            Compute::Pipeline { link, .. } => link.finish(ticket, vocab),
            _ => unreachable!("only a pipeline's leader launches steps"),
        }
    }

    /// Whether the device is out of service (see [`crate::cuda::CudaCompute`]).
    pub(super) fn failed(&self) -> bool {
        match self {
            Compute::Cpu { .. } => false,
            Compute::Pipeline { link, .. } => !link.connected(),
            #[cfg(feature = "cuda")]
            Compute::Cuda(c) => c.failure().is_some(),
        }
    }

    /// Whether [`Self::upkeep`] has work while the engine is idle.
    pub(super) fn needs_upkeep(&self) -> bool {
        matches!(self, Compute::Pipeline { .. })
    }

    /// A pipeline's leader notices a lost group and reconnects it; true once after the
    /// group was lost (every request is then failed and the prefix cache forgotten: the
    /// other stages' KV is gone).
    pub(super) fn upkeep(&mut self) -> bool {
        match self {
            Compute::Pipeline { link, .. } => {
                link.upkeep();
                link.take_lost()
            }
            _ => false,
        }
    }

    /// A block's bytes (None: the device failed to give them).
    pub(super) fn read_block(&mut self, block: u32) -> Option<Vec<u8>> {
        match self {
            Compute::Cpu { pool, .. } => Some(pool.read_block(block)),
            // A block's layers are spread over the stages.
            Compute::Pipeline { .. } => None,
            #[cfg(feature = "cuda")]
            Compute::Cuda(c) => c
                .read_block(block)
                .inspect_err(|e| tracing::error!(error = %e, "reading a KV block from the device failed"))
                .ok(),
        }
    }

    pub(super) fn write_block(&mut self, block: u32, data: &crate::kv::block::BlockData) -> bool {
        match self {
            Compute::Cpu { pool, .. } => pool.write_block(block, data.parts()),
            Compute::Pipeline { .. } => false,
            #[cfg(feature = "cuda")]
            Compute::Cuda(c) => c
                .write_block(block, &data.to_vec())
                .inspect_err(|e| tracing::error!(error = %e, "writing a KV block to the device failed"))
                .unwrap_or(false),
        }
    }

    /// A failed copy on the device puts the device out of service, so the next step fails
    /// its requests instead of computing on a block that was not copied.
    pub(super) fn copy_block(&mut self, from: u32, to: u32) {
        match self {
            Compute::Cpu { pool, .. } => pool.copy_block(from, to),
            Compute::Pipeline { pool, link, .. } => {
                pool.copy_block(from, to);
                link.copy_block(from, to);
            }
            #[cfg(feature = "cuda")]
            Compute::Cuda(c) => {
                if let Err(e) = c.copy_block(from, to) {
                    tracing::error!(error = %e, "copying a KV block on the device failed");
                }
            }
        }
    }
}
