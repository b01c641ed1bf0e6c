//! The engine loop: one thread that owns the model and runs requests, streaming
//! [`GenerateEvent`]s back over a channel. A request whose receiver is dropped is
//! cancelled at the next step (between prefill chunks or decode steps).
//!
//! This first engine runs one sequence at a time, in arrival order; continuous batching
//! and the paged prefix cache replace the loop body in the engine issue, behind the same
//! [`EngineHandle::generate`] surface.

use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use hearth_protocol::{
    FinishReason, GenerateEvent, GenerateRequest, Tokenizer, TokenizerSpec, Usage, WorkerInfo,
};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::gguf::{GgufError, GgufFile};
use crate::models::llama::{ForwardScratch, LlamaModel, ModelError};
use crate::sampling::Sampler;
use crate::text::TextStream;

/// Prompt tokens per forward call while prefilling (bounds scratch memory and lets a
/// cancelled request stop between chunks).
const PREFILL_CHUNK: usize = 256;

/// Tokens that end generation besides the declared EOS, when the vocabulary has them.
const END_OF_GENERATION: [&str; 5] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "</s>",
];

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] hearth_protocol::TokenizeError),
    #[error("cannot start the engine: {0}")]
    Start(String),
}

/// Reads the tokenizer description from GGUF metadata.
pub fn tokenizer_spec(g: &GgufFile) -> Result<TokenizerSpec, GgufError> {
    let id = |k: &str| g.get_u64(k).ok().map(|v| v as u32);
    Ok(TokenizerSpec {
        model: g.get_str("tokenizer.ggml.model")?.to_string(),
        pre: g
            .get_str("tokenizer.ggml.pre")
            .unwrap_or("default")
            .to_string(),
        tokens: g.get_str_array("tokenizer.ggml.tokens")?,
        token_types: g
            .get_i64_array("tokenizer.ggml.token_type")?
            .into_iter()
            .map(|t| t as i32)
            .collect(),
        merges: g.get_str_array("tokenizer.ggml.merges")?,
        bos_id: id("tokenizer.ggml.bos_token_id"),
        eos_id: id("tokenizer.ggml.eos_token_id"),
        add_bos: matches!(
            g.get("tokenizer.ggml.add_bos_token"),
            Some(crate::gguf::MetaValue::Bool(true))
        ),
        chat_template: g
            .get_str("tokenizer.chat_template")
            .ok()
            .map(str::to_string),
    })
}

struct Job {
    req: GenerateRequest,
    tx: UnboundedSender<GenerateEvent>,
}

/// What the engine thread owns.
struct Runner {
    model: LlamaModel,
    tokenizer: Tokenizer,
    model_id: String,
    end_of_generation: Vec<u32>,
}

/// A cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    info: Arc<WorkerInfo>,
    jobs: mpsc::Sender<Job>,
    load_seconds: f64,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("model", &self.info.model)
            .finish()
    }
}

impl EngineHandle {
    /// Loads a GGUF model and starts the engine thread with `threads` compute threads.
    pub fn load(path: &Path, model_id: &str, threads: usize) -> Result<Self, EngineError> {
        let started = Instant::now();
        let file = GgufFile::open(path)?;
        let spec = tokenizer_spec(&file)?;
        let tokenizer = Tokenizer::from_spec(&spec)?;
        let model = LlamaModel::load(file)?;
        let end_of_generation: Vec<u32> = tokenizer
            .eos_id()
            .into_iter()
            .chain(
                END_OF_GENERATION
                    .iter()
                    .filter_map(|t| tokenizer.token_id(t)),
            )
            .collect();
        let info = WorkerInfo {
            model: model_id.to_string(),
            architecture: "llama".into(),
            context_length: model.config.context_length as u32,
            parameters: model.n_params(),
            tokenizer: spec,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("hearth-compute-{i}"))
            .build()
            .map_err(|e| EngineError::Start(e.to_string()))?;
        let runner = Runner {
            model,
            tokenizer,
            model_id: model_id.to_string(),
            end_of_generation,
        };
        let (jobs, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("hearth-engine".into())
            .spawn(move || {
                // Ends when every handle is dropped.
                while let Ok(job) = rx.recv() {
                    let tx = job.tx.clone();
                    let id = job.req.request_id.clone();
                    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| pool.install(|| runner.run(job))));
                    if outcome.is_err() {
                        tracing::error!(request_id = %id, "engine panicked on a request; it failed alone");
                        let _ = tx.send(GenerateEvent::Error {
                            code: "engine_error".into(),
                            message: "the engine failed on this request".into(),
                        });
                    }
                }
            })
            .map_err(|e| EngineError::Start(e.to_string()))?;
        Ok(Self {
            info: Arc::new(info),
            jobs,
            load_seconds: started.elapsed().as_secs_f64(),
        })
    }

    pub fn info(&self) -> &WorkerInfo {
        &self.info
    }

    /// Seconds from opening the file to ready.
    pub fn load_seconds(&self) -> f64 {
        self.load_seconds
    }

    /// Queues a request; events arrive on the returned channel, ending with `Done` or
    /// `Error`. Dropping the receiver cancels the request.
    pub fn generate(&self, req: GenerateRequest) -> UnboundedReceiver<GenerateEvent> {
        let (tx, rx) = unbounded_channel();
        if let Err(mpsc::SendError(job)) = self.jobs.send(Job { req, tx }) {
            let _ = job.tx.send(GenerateEvent::Error {
                code: "engine_stopped".into(),
                message: "the engine is not running".into(),
            });
        }
        rx
    }
}

fn error(code: &str, message: String) -> GenerateEvent {
    GenerateEvent::Error {
        code: code.into(),
        message,
    }
}

impl Runner {
    fn validate(&self, req: &GenerateRequest) -> Result<(), GenerateEvent> {
        if req.model != self.model_id {
            return Err(error(
                "model_not_found",
                format!(
                    "this worker serves {:?}, not {:?}",
                    self.model_id, req.model
                ),
            ));
        }
        if req.prompt.is_empty() {
            return Err(error("invalid_prompt", "the prompt is empty".into()));
        }
        let vocab = self.model.config.vocab_size as u32;
        if let Some(bad) = req.prompt.iter().find(|&&t| t >= vocab) {
            return Err(error(
                "invalid_prompt",
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
        let ctx = self.model.config.context_length;
        if req.prompt.len() >= ctx {
            return Err(error(
                "context_length_exceeded",
                format!(
                    "the prompt has {} tokens; the model's context is {ctx}",
                    req.prompt.len()
                ),
            ));
        }
        Ok(())
    }

    fn run(&self, Job { req, tx }: Job) {
        if let Err(e) = self.validate(&req) {
            let _ = tx.send(e);
            return;
        }
        let started = Instant::now();
        let ctx = self.model.config.context_length;
        let max_tokens = (req.sampling.max_tokens as usize).min(ctx - req.prompt.len());
        let mut kv = self.model.new_cache();
        let mut scratch = ForwardScratch::default();
        let mut sampler = Sampler::new(&req.sampling);
        let mut text = TextStream::new(&req.sampling.stop);
        let mut logits = Vec::new();
        for chunk in req.prompt.chunks(PREFILL_CHUNK) {
            if tx.is_closed() {
                return;
            }
            logits = self.model.forward(chunk, &mut kv, &mut scratch);
        }
        let prefill_s = started.elapsed().as_secs_f64();
        let mut generated = 0usize;
        let finish = loop {
            if tx.is_closed() {
                tracing::debug!(request_id = %req.request_id, generated, "consumer gone; generation cancelled");
                return;
            }
            let tok = sampler.sample(&logits);
            generated += 1;
            let eog = self.end_of_generation.contains(&tok);
            let bytes = if eog || self.tokenizer.is_special(tok) {
                &[][..]
            } else {
                self.tokenizer.token_bytes(tok).unwrap_or(&[])
            };
            let released = text.push(bytes);
            let finish = if released.stopped || eog {
                Some(FinishReason::Stop)
            } else if generated >= max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            let mut piece = released.text;
            if finish.is_some() && !released.stopped {
                piece.push_str(&text.finish());
            }
            let _ = tx.send(GenerateEvent::Token {
                id: tok,
                text: piece,
            });
            if let Some(f) = finish {
                break f;
            }
            logits = self.model.forward(&[tok], &mut kv, &mut scratch);
        };
        let total_s = started.elapsed().as_secs_f64();
        tracing::info!(
            request_id = %req.request_id,
            prompt_tokens = req.prompt.len(),
            completion_tokens = generated,
            prefill_tok_s = (req.prompt.len() as f64 / prefill_s) as u64,
            decode_tok_s = (generated as f64 / (total_s - prefill_s).max(1e-9)) as u64,
            finish = finish.as_str(),
            "request done"
        );
        let _ = tx.send(GenerateEvent::Done {
            finish_reason: finish,
            usage: Usage {
                prompt_tokens: req.prompt.len() as u32,
                cached_tokens: 0,
                completion_tokens: generated as u32,
            },
        });
    }
}
