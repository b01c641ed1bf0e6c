//! The `sim` backend: the real scheduler, KV cache and prefix cache, with the model maths
//! replaced by a cost model, in virtual time. Many simulated workers and hours of traffic
//! fit on one small machine in seconds (`hearth bench routing`).
//!
//! Default cost model (stated, not measured here): a 70B-class model on one 8-GPU node with
//! vLLM — prefill ≈ 12,000 tokens/s, a decode step ≈ 30 ms + 0.25 ms per running sequence,
//! 250,000 tokens of KV cache. These are round numbers of the order published for Llama 3.1
//! 70B on 8×H100/A100 nodes; only their ratios matter for comparing routing policies.

use std::collections::HashMap;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use hearth_protocol::{
    namespace_root, BlockHash, FinishReason, GenerateEvent, GenerateRequest, KvEvent, LoadReport, Qos, Tokenizer,
    Usage, WorkerInfo,
};
use tokio::sync::broadcast;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::kv::pool::BlockEvents;
use crate::step::scheduler::{Scheduler, SchedulerConfig};

#[derive(Debug, Clone, Copy)]
pub struct CostModel {
    pub prefill_tok_s: f64,
    pub decode_step_s: f64,
    pub decode_per_seq_s: f64,
    pub kv_tokens: usize,
    /// How a step that both prefills and decodes is timed.
    pub mixed: MixedStep,
}

/// The time of a step holding prompt tokens and decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MixedStep {
    /// Prefill time plus decode time (no overlap): the model the published routing and PD
    /// figures were measured with, and the default.
    #[default]
    Sum,
    /// The longer of the two: on a GPU a mixed step's prompt tokens are compute-bound and
    /// its decodes bound by reading weights and KV, and one batched pass overlaps them.
    Overlap,
}

impl MixedStep {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "sum" => Some(Self::Sum),
            "overlap" => Some(Self::Overlap),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sum => "sum",
            Self::Overlap => "overlap",
        }
    }
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            prefill_tok_s: 12_000.0,
            decode_step_s: 0.030,
            decode_per_seq_s: 0.000_25,
            kv_tokens: 250_000,
            mixed: MixedStep::Sum,
        }
    }
}

impl CostModel {
    /// Seconds of a step computing `prefill` prompt tokens and `decodes` decodes.
    pub fn step_seconds(&self, prefill: usize, decodes: usize) -> f64 {
        let p = prefill as f64 / self.prefill_tok_s;
        let d = if decodes > 0 {
            self.decode_step_s + decodes as f64 * self.decode_per_seq_s
        } else {
            0.0
        };
        match self.mixed {
            MixedStep::Sum => p + d,
            MixedStep::Overlap => p.max(d),
        }
    }
}

struct SimRequest {
    max_tokens: usize,
    generated: usize,
    cached_tokens: usize,
}

/// What one simulated step did.
#[derive(Debug, Default)]
pub struct SimStep {
    pub seconds: f64,
    /// Requests that produced their first token: (id, prompt tokens served from cache).
    pub first_tokens: Vec<(u64, usize)>,
    pub finished: Vec<u64>,
    /// Requests that produced a token this step.
    pub sampled: Vec<u64>,
    /// The step was cut short for an arriving request ([`SimWorker::step_before`]): it
    /// took `seconds` and computed nothing.
    pub cut: bool,
}

/// Layers a simulated step is cut between (a 70B-class model's 80).
const SIM_LAYERS: f64 = 80.0;

/// The `g`-th (from 1) token a simulated request generates: distinct per request, so
/// generated blocks never collide across requests, and reproducible, so a conversation's
/// next turn can resend its history.
pub fn generated_token(id: u64, g: usize) -> u32 {
    (id.wrapping_mul(2_654_435_761).wrapping_add(g as u64) % 40_000) as u32 + 17
}

pub struct SimWorker {
    sched: Scheduler,
    cost: CostModel,
    requests: HashMap<u64, SimRequest>,
    cuts_in_a_row: u32,
}

impl SimWorker {
    pub fn new(cost: CostModel) -> Self {
        Self::with_batch_tokens(cost, 8192)
    }

    /// A worker whose steps hold at most `max_batch_tokens` (decodes and prefill chunks).
    pub fn with_batch_tokens(cost: CostModel, max_batch_tokens: usize) -> Self {
        let bt = hearth_protocol::DEFAULT_BLOCK_TOKENS;
        Self::with_scheduler(
            cost,
            SchedulerConfig {
                block_tokens: bt,
                max_batch_tokens: max_batch_tokens.max(bt),
                max_running: 256,
                ..Default::default()
            },
        )
    }

    /// A worker with this scheduler configuration (its block size must divide the cost
    /// model's KV tokens sensibly; the default's does).
    pub fn with_scheduler(cost: CostModel, cfg: SchedulerConfig) -> Self {
        Self {
            sched: Scheduler::new(cfg, cost.kv_tokens / cfg.block_tokens.max(1)),
            cost,
            requests: HashMap::new(),
            cuts_in_a_row: 0,
        }
    }

    /// The scheduler (fairness accounts, queue state).
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    pub fn submit(&mut self, id: u64, prompt: Vec<u32>, root: BlockHash, max_tokens: usize) {
        self.submit_for(id, prompt, root, max_tokens, &Qos::default());
    }

    /// Queues a request of a tenant, in a class.
    pub fn submit_for(&mut self, id: u64, prompt: Vec<u32>, root: BlockHash, max_tokens: usize, qos: &Qos) {
        self.requests.insert(
            id,
            SimRequest {
                max_tokens: max_tokens.max(1),
                generated: 0,
                cached_tokens: 0,
            },
        );
        self.sched.add_for(id, prompt, root, qos);
    }

    pub fn is_idle(&self) -> bool {
        self.sched.is_idle()
    }

    /// A prompt's KV blocks arrived from another worker (disaggregated serving): its full
    /// blocks are cached here, unreferenced, as the engine's import leaves them.
    pub fn import_prefix(&mut self, prompt: &[u32], root: BlockHash) {
        let bt = self.sched.config().block_tokens;
        let hashes = hearth_protocol::block_hashes(root, &prompt[..prompt.len().saturating_sub(1)], bt);
        let mut held = Vec::new();
        for h in hashes {
            if self.sched.blocks.contains(h) {
                continue;
            }
            let Some(b) = self.sched.blocks.allocate() else { break };
            self.sched.blocks.register(b, h);
            held.push(b);
        }
        for b in held.into_iter().rev() {
            self.sched.blocks.release(b);
        }
    }

    pub fn load(&self) -> LoadReport {
        self.sched.load()
    }

    pub fn take_events(&mut self) -> BlockEvents {
        self.sched.blocks.take_events()
    }

    /// Runs one step; `None` when there is nothing to do.
    pub fn step(&mut self) -> Option<SimStep> {
        self.step_before(None)
    }

    /// Runs one step, as the engine does with a request arriving `after` seconds from its
    /// start: if the request arrives before the step's last layer and the engine would cut
    /// the step for it (an interactive request during prompt work it outranks:
    /// [`Scheduler::interrupts`]), the step is cut at the next layer boundary and computes
    /// nothing (at most [`crate::step::scheduler::MAX_CUTS_IN_A_ROW`] in a
    /// row). The caller then submits the request and steps again.
    pub fn step_before(&mut self, arrival: Option<(f64, &Qos)>) -> Option<SimStep> {
        if self.sched.is_idle() {
            return None;
        }
        let items = self.sched.schedule();
        self.sched.pending_copies.clear();
        if items.is_empty() {
            return None;
        }
        let prefill: usize = items
            .iter()
            .filter(|i| !(i.len == 1 && i.sample && self.requests.get(&i.seq).is_some_and(|r| r.generated > 0)))
            .map(|i| i.len)
            .sum();
        let decodes = items
            .iter()
            .filter(|i| i.len == 1 && self.requests.get(&i.seq).is_some_and(|r| r.generated > 0))
            .count();
        let mut out = SimStep {
            seconds: self.cost.step_seconds(prefill, decodes),
            ..Default::default()
        };
        if let Some((after, qos)) = arrival {
            // The engine asks before each layer after the first, never after the last.
            let layers = (after.max(0.0) / out.seconds * SIM_LAYERS).ceil().max(1.0);
            if layers < SIM_LAYERS
                && self.cuts_in_a_row < crate::step::scheduler::MAX_CUTS_IN_A_ROW
                && self.sched.interrupts(qos, &items)
            {
                self.cuts_in_a_row += 1;
                out.seconds *= layers / SIM_LAYERS;
                out.cut = true;
                return Some(out);
            }
        }
        self.cuts_in_a_row = 0;
        self.sched.complete(&items);
        for it in items.iter().filter(|i| i.sample) {
            let Some(r) = self.requests.get_mut(&it.seq) else {
                continue;
            };
            out.sampled.push(it.seq);
            if r.generated == 0 {
                r.cached_tokens = self.sched.get(it.seq).map_or(0, |s| s.cached_tokens);
                out.first_tokens.push((it.seq, r.cached_tokens));
            }
            r.generated += 1;
            if r.generated >= r.max_tokens {
                self.sched.remove(it.seq);
                self.requests.remove(&it.seq);
                out.finished.push(it.seq);
            } else {
                self.sched.push_token(it.seq, generated_token(it.seq, r.generated));
            }
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_protocol::namespace_root;

    #[test]
    fn a_repeated_prefix_is_cheaper_the_second_time() {
        let mut w = SimWorker::new(CostModel::default());
        let root = namespace_root("m", "t");
        let prompt: Vec<u32> = (0..8000).map(|i| (i % 1000) as u32 + 17).collect();
        let run = |id: u64, w: &mut SimWorker| {
            let mut p = prompt.clone();
            p.extend((0..50).map(|i| (id as u32 * 100 + i) + 17));
            w.submit(id, p, root, 4);
            let (mut t, mut ttft, mut cached) = (0.0, None, 0);
            while let Some(s) = w.step() {
                t += s.seconds;
                if let Some(&(_, c)) = s.first_tokens.first() {
                    ttft.get_or_insert(t);
                    cached = c;
                }
            }
            (ttft.unwrap(), cached)
        };
        let (cold, c0) = run(1, &mut w);
        let (warm, c1) = run(2, &mut w);
        assert_eq!(c0, 0);
        assert_eq!(c1, 8000);
        assert!(warm < cold / 10.0, "{warm} vs {cold}");
    }
}

enum SimCommand {
    Generate(Box<GenerateRequest>, UnboundedSender<GenerateEvent>),
    Subscribe(tokio::sync::oneshot::Sender<(KvEvent, broadcast::Receiver<KvEvent>)>),
}

/// A worker whose engine is a [`SimWorker`] run in (compressed) real time: it speaks the real
/// worker protocol (`hearth worker --backend sim`), so gateways and routers can be exercised
/// with many workers on one machine. Generated text is the decoded simulated token ids.
#[derive(Clone)]
pub struct SimHandle {
    info: Arc<WorkerInfo>,
    commands: mpsc::Sender<SimCommand>,
}

impl SimHandle {
    /// `info` describes the model being simulated (its tokenizer is used for text);
    /// `speedup` compresses time (2.0 = twice as fast as the cost model says).
    pub fn start(info: WorkerInfo, cost: CostModel, speedup: f64) -> Self {
        // The sim queues as much as its cache holds, as the engine does by default.
        let queue = cost.kv_tokens as u64;
        Self::start_with_queue(info, cost, speedup, queue)
    }

    /// [`Self::start`] with a queue limit in prompt tokens not yet computed (0: unbounded).
    pub fn start_with_queue(mut info: WorkerInfo, cost: CostModel, speedup: f64, queue_tokens: u64) -> Self {
        info.queue_tokens = queue_tokens;
        let tokenizer = Tokenizer::from_spec(&info.tokenizer).ok();
        let (commands, rx) = mpsc::channel::<SimCommand>();
        let model = info.model.clone();
        let context = info.context_length as usize;
        std::thread::Builder::new()
            .name("hearth-sim".into())
            .spawn(move || sim_loop(rx, cost, speedup.max(1e-3), model, context, tokenizer, queue_tokens))
            .ok();
        Self {
            info: Arc::new(info),
            commands,
        }
    }
}

struct SimOut {
    tx: UnboundedSender<GenerateEvent>,
    prompt: usize,
    cached: usize,
    /// Including the resumed tokens of a disaggregated decode half.
    generated: usize,
    /// `Handoff` for a prefill-only half, else `Length`.
    finish: FinishReason,
}

fn sim_loop(
    rx: mpsc::Receiver<SimCommand>,
    cost: CostModel,
    speedup: f64,
    model: String,
    context: usize,
    tokenizer: Option<Tokenizer>,
    queue_tokens: u64,
) {
    let mut w = SimWorker::new(cost);
    let (kv_tx, _) = broadcast::channel(4096);
    let mut outs: HashMap<u64, SimOut> = HashMap::new();
    let mut next = 0u64;
    loop {
        let cmd = if w.is_idle() {
            rx.recv().ok()
        } else {
            rx.try_recv().ok()
        };
        let mut cmds: Vec<SimCommand> = cmd.into_iter().collect();
        while let Ok(c) = rx.try_recv() {
            cmds.push(c);
        }
        if w.is_idle() && cmds.is_empty() {
            return; // every handle dropped
        }
        for c in cmds {
            match c {
                SimCommand::Generate(req, tx) => {
                    if req.model != model || req.prompt.is_empty() || req.prompt.len() >= context {
                        let _ = tx.send(GenerateEvent::Error {
                            code: "invalid_prompt".into(),
                            message: "the sim refused the request".into(),
                        });
                        continue;
                    }
                    let queue = w.sched.queue_state(&req.qos.tenant, queue_tokens);
                    if let Err(shed) = queue.admit(req.qos.priority, req.prompt.len() as u64) {
                        let _ = tx.send(GenerateEvent::Error {
                            code: "overloaded".into(),
                            message: format!(
                                "the sim's queue is full for {} work ({} must drain first)",
                                req.qos.priority, shed.excess
                            ),
                        });
                        continue;
                    }
                    let id = next;
                    next += 1;
                    let full = (req.sampling.max_tokens as usize).clamp(1, context - req.prompt.len());
                    // Disaggregated halves: the first token only, or the rest after it.
                    let resumed = req.resume.len();
                    let (max, finish) = if req.prefill_only && full > 1 {
                        (1, FinishReason::Handoff)
                    } else {
                        (full.saturating_sub(resumed).max(1), FinishReason::Length)
                    };
                    outs.insert(
                        id,
                        SimOut {
                            tx,
                            prompt: req.prompt.len(),
                            cached: 0,
                            generated: resumed,
                            finish,
                        },
                    );
                    let root = namespace_root(&model, &req.kv_namespace());
                    let mut tokens = req.prompt;
                    tokens.extend(req.resume);
                    w.submit_for(id, tokens, root, max, &req.qos);
                }
                SimCommand::Subscribe(reply) => {
                    let snap = KvEvent::Snapshot {
                        block_tokens: 16,
                        blocks: w.sched.blocks.cached_hashes(),
                        load: w.load(),
                        disk: Vec::new(),
                        adapters: Vec::new(),
                    };
                    let _ = reply.send((snap, kv_tx.subscribe()));
                }
            }
        }
        // Cancelled requests free their blocks at once.
        let gone: Vec<u64> = outs.iter().filter(|(_, o)| o.tx.is_closed()).map(|(k, _)| *k).collect();
        for id in gone {
            outs.remove(&id);
            w.sched.remove(id);
            w.requests.remove(&id);
        }
        let started = Instant::now();
        let Some(step) = w.step() else { continue };
        let ev = w.take_events();
        if !ev.stored.is_empty() {
            let _ = kv_tx.send(KvEvent::Stored {
                blocks: ev.stored,
                tier: Default::default(),
            });
        }
        if !ev.removed.is_empty() {
            let _ = kv_tx.send(KvEvent::Removed {
                blocks: ev.removed,
                tier: Default::default(),
            });
        }
        let _ = kv_tx.send(KvEvent::Load(w.load()));
        let wait = Duration::from_secs_f64(step.seconds / speedup).saturating_sub(started.elapsed());
        std::thread::sleep(wait);
        for (id, cached) in &step.first_tokens {
            if let Some(o) = outs.get_mut(id) {
                o.cached = *cached;
            }
        }
        // Every running request produced one token this step (those still in `outs`).
        let finished: std::collections::HashSet<u64> = step.finished.iter().copied().collect();
        for id in step.sampled {
            let Some(o) = outs.get_mut(&id) else { continue };
            o.generated += 1;
            let tok = generated_token(id, o.generated);
            let text = tokenizer
                .as_ref()
                .and_then(|t| t.token_bytes(tok).ok())
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default();
            let _ = o.tx.send(GenerateEvent::Token {
                index: 0,
                id: tok,
                text,
                logprob: None,
                top_logprobs: Vec::new(),
            });
            if finished.contains(&id) {
                let _ = o.tx.send(GenerateEvent::Finish {
                    index: 0,
                    finish_reason: o.finish,
                });
                let _ = o.tx.send(GenerateEvent::Done {
                    finish_reason: o.finish,
                    usage: Usage {
                        prompt_tokens: o.prompt as u32,
                        cached_tokens: o.cached.min(o.prompt) as u32,
                        completion_tokens: o.generated as u32,
                    },
                    timings: Default::default(),
                });
                outs.remove(&id);
            }
        }
    }
}

impl crate::worker::backend::Backend for SimHandle {
    fn info(&self) -> &WorkerInfo {
        &self.info
    }

    fn generate(&self, req: GenerateRequest) -> UnboundedReceiver<GenerateEvent> {
        let (tx, rx) = unbounded_channel();
        if let Err(mpsc::SendError(SimCommand::Generate(_, tx))) =
            self.commands.send(SimCommand::Generate(Box::new(req), tx))
        {
            let _ = tx.send(GenerateEvent::Error {
                code: "engine_stopped".into(),
                message: "the sim is not running".into(),
            });
        }
        rx
    }

    fn subscribe_kv(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = crate::worker::backend::KvSubscription> + Send + '_>> {
        Box::pin(async move {
            let (tx, rx) = tokio::sync::oneshot::channel();
            self.commands.send(SimCommand::Subscribe(tx)).ok()?;
            rx.await.ok()
        })
    }
}

/// Describes a model for the sim from its GGUF file (tokenizer and context only; the
/// weights are never read).
pub fn sim_info(
    path: &std::path::Path,
    model_id: &str,
    region: &str,
) -> Result<WorkerInfo, crate::engine::config::EngineError> {
    Ok(WorkerInfo {
        architecture: "sim".into(),
        parameters: 0,
        capacity: 256,
        ..crate::engine::config::file_info(path, model_id, region)?
    })
}

#[cfg(test)]
pub(crate) mod handle_tests {
    use super::*;
    use crate::worker::backend::Backend;

    /// A sim worker's info, for tests here and in `server`.
    pub(crate) fn info() -> WorkerInfo {
        let mut tokens: Vec<String> = (0..256u32)
            .map(|b| char::from_u32(b + 256).unwrap().to_string())
            .collect();
        tokens.resize(50_000, "x".into());
        WorkerInfo {
            model: "m".into(),
            architecture: "sim".into(),
            context_length: 4096,
            parameters: 0,
            block_tokens: 16,
            region: "local".into(),
            role: "both".into(),
            capacity: 256,
            queue_tokens: 0,
            tokenizer: hearth_protocol::TokenizerSpec {
                model: "none".into(),
                pre: "default".into(),
                token_types: vec![1; tokens.len()],
                tokens,
                ..Default::default()
            },
            tenants: Vec::new(),
            kv: None,
        }
    }

    #[tokio::test]
    async fn the_sim_handle_streams_tokens_and_usage() {
        let h = SimHandle::start(info(), CostModel::default(), 1000.0);
        let (snap, _rx) = tokio::time::timeout(Duration::from_secs(5), h.subscribe_kv())
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(snap, KvEvent::Snapshot { .. }));
        let req = GenerateRequest {
            request_id: "r".into(),
            model: "m".into(),
            prompt: (17..60).collect(),
            sampling: hearth_protocol::SamplingParams {
                max_tokens: 5,
                ..Default::default()
            },
            cache_namespace: "t".into(),
            n: 1,
            prefill_only: false,
            resume: Vec::new(),
            kv_source: None,
            qos: Qos::default(),
            constraint: None,
            adapter: None,
        };
        let mut rx = h.generate(req);
        let mut tokens = 0;
        loop {
            match tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("sim stalled")
            {
                Some(GenerateEvent::Token { .. }) => tokens += 1,
                Some(GenerateEvent::Done { usage, .. }) => {
                    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (43, 5));
                    break;
                }
                Some(_) => {}
                None => panic!("stream ended"),
            }
        }
        assert_eq!(tokens, 5);
    }
}
