//! The runner admitting requests: validation, adapters (and requests waiting for one),
//! the prefix cache and the disk tier, the scheduler's queue; and dropping requests that
//! ended or whose receiver went away.

use std::time::Instant;

use hearth_protocol::{namespace_root, GenerateEvent, GenerateRequest};

use crate::engine::adapters::AdapterRefused;
use crate::engine::command::{Command, Job};
use crate::engine::compute::Compute;
use crate::engine::config::{MAX_N, MAX_TOP_LOGPROBS};
use crate::engine::runner::{error, shown_bytes, Choice, Request, Runner};
use crate::kv::block::BlockKey;
use crate::step::sampling::Sampler;
use crate::step::speculative::Speculation;
use crate::step::text::TextStream;

impl Runner {
    /// Once a request holding an adapter has ended, admits the requests that waited for
    /// room in the adapter cache, in order, until one finds none (it and those behind it
    /// wait on; those whose client left are dropped).
    pub(super) fn admit_adapter_waiting(&mut self) {
        if !std::mem::take(&mut self.adapter_released) {
            return;
        }
        self.adapter_retrying = true;
        for job in std::mem::take(&mut self.adapter_waiting) {
            if job.tx.is_closed() {
                continue;
            }
            if self.adapter_waiting.is_empty() {
                self.admit(job);
            } else {
                self.adapter_waiting.push_back(job);
            }
        }
        self.adapter_retrying = false;
    }

    pub(super) fn validate(&self, req: &GenerateRequest) -> Result<(), GenerateEvent> {
        if req.model != self.model_id {
            return Err(error(
                "model_not_found",
                format!("this worker serves {:?}, not {:?}", self.model_id, req.model),
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
        let ctx = self.context.min(self.sched.capacity_tokens());
        if req.prompt.len() >= ctx {
            return Err(error(
                "context_length_exceeded",
                format!("the prompt has {} tokens; this worker can hold {ctx}", req.prompt.len()),
            ));
        }
        if req.n == 0 || req.n > MAX_N {
            return Err(error("invalid_request", format!("n must be between 1 and {MAX_N}")));
        }
        if (req.prefill_only || !req.resume.is_empty()) && req.n != 1 {
            return Err(error(
                "invalid_request",
                "a disaggregated request (prefill_only or resume) has n = 1".into(),
            ));
        }
        if let Some(bad) = req.resume.iter().find(|&&t| t >= vocab) {
            return Err(error(
                "invalid_request",
                format!("resumed token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
        if req.prompt.len() + req.resume.len() >= ctx || req.resume.len() >= req.sampling.max_tokens.max(1) as usize {
            return Err(error(
                "invalid_request",
                format!(
                    "{} resumed tokens leave nothing to generate (max_tokens {}, context {ctx})",
                    req.resume.len(),
                    req.sampling.max_tokens
                ),
            ));
        }
        if req.sampling.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(error(
                "invalid_request",
                format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"),
            ));
        }
        Ok(())
    }

    pub(super) fn admit(&mut self, mut job: Job) {
        if let Err(e) = self.validate(&job.req) {
            let _ = job.tx.send(e);
            return;
        }
        let pipeline = matches!(self.compute, Compute::Pipeline { .. });
        if pipeline && job.req.prefill_only {
            let _ = job.tx.send(error(
                "unsupported",
                "a pipeline group is not yet the prefill side of disaggregation: its KV is spread over its stages, and blocks move between single workers only".into(),
            ));
            return;
        }
        let adapter = match &job.req.adapter {
            None => None,
            Some(_) if pipeline => {
                let _ = job.tx.send(error(
                    "adapter_unavailable",
                    "LoRA adapters are not yet served by pipeline groups (every stage would load its layers of the adapter)".into(),
                ));
                return;
            }
            Some(_) if !matches!(self.compute, Compute::Cpu { .. }) => {
                let _ = job.tx.send(error(
                    "adapter_unavailable",
                    "LoRA adapters are served by CPU workers only".into(),
                ));
                return;
            }
            // Behind requests already waiting for room: arrival order is kept.
            Some(_) if !self.adapter_retrying && !self.adapter_waiting.is_empty() => {
                self.adapter_waiting.push_back(job);
                return;
            }
            Some(r) => match self.adapters.get(r, &self.model) {
                Ok(a) => Some(a),
                Err(AdapterRefused::Busy) => {
                    self.adapter_waiting.push_back(job);
                    return;
                }
                Err(AdapterRefused::Failed { code, message }) => {
                    tracing::warn!(request_id = %job.req.request_id, adapter = %r.name, code, error = %message, "adapter refused");
                    let _ = job.tx.send(error(code, message));
                    return;
                }
            },
        };
        if let (Some(tier), Some(resend)) = (self.tier.clone(), job.resend.take()) {
            let run = self.disk_run(&tier, &job.req);
            if !run.is_empty() {
                // The request waits for its blocks off this thread, then comes back.
                let job = Box::new(job);
                tier.read(
                    run,
                    Box::new(move |blocks| {
                        let _ = resend.send(Command::DiskRead(job, blocks));
                    }),
                );
                return;
            }
        }
        let Job { req, tx, .. } = job;
        let namespace = req.kv_namespace().into_owned();
        let queue = self.sched.queue_state(&req.qos.tenant, self.queue_tokens);
        if let Err(shed) = queue.admit(req.qos.priority, req.prompt.len() as u64) {
            self.metrics.shed(req.qos.priority).inc();
            let _ = tx.send(error(
                "overloaded",
                format!(
                    "this worker's queue is full for {} work ({} of {} prompt tokens queued; {} must drain first)",
                    req.qos.priority, queue.queued, queue.limit, shed.excess
                ),
            ));
            return;
        }
        let grammar = match &req.constraint {
            None => None,
            Some(c) => match self.grammars.compile(c) {
                Ok(g) => Some(g),
                Err(e) => {
                    let _ = tx.send(error(e.code(), e.to_string()));
                    return;
                }
            },
        };
        let ctx = self.context.min(self.sched.capacity_tokens());
        let max_tokens = (req.sampling.max_tokens as usize).min(ctx - req.prompt.len()).max(1);
        let id = self.next_id;
        self.next_id += 1;
        // Speculation serves one choice decoding on this worker.
        let draft_tokens = if req.sampling.speculative && req.n == 1 && !req.prefill_only {
            self.speculative_tokens
        } else {
            0
        };
        let mut choices: Vec<Choice> = (0..req.n)
            .map(|i| {
                let mut p = req.sampling.clone();
                p.seed = p.seed.map(|s| s.wrapping_add(i as u64));
                Choice {
                    seq: None,
                    sampler: Sampler::new(&p),
                    text: TextStream::new(&p.stop),
                    generated: 0,
                    finish: None,
                    grammar: grammar.clone(),
                    spec: Speculation::new(draft_tokens),
                }
            })
            .collect();
        // Resumed tokens were sent by the prefill worker: the text stream takes them in
        // (what it releases was sent), so it holds back exactly what the prefill worker's
        // stream held back.
        for &t in &req.resume {
            let c = &mut choices[0];
            c.generated += 1;
            c.sampler.skip();
            if let Some(g) = c.grammar.as_mut() {
                g.advance(t);
            }
            c.text.push(shown_bytes(&self.tokenizer, t, &req.sampling.special_text));
        }
        let mut r = Request {
            request_id: req.request_id,
            tx,
            params: req.sampling,
            max_tokens,
            prompt_len: req.prompt.len(),
            cached_tokens: 0,
            n: req.n,
            forked: req.n == 1,
            prefill_only: req.prefill_only,
            adapter,
            choices,
            started: Instant::now(),
            scheduled: None,
            first_token: None,
        };
        r.choices[0].seq = Some(id);
        self.owner.insert(id, (id, 0));
        let mut tokens = req.prompt;
        tokens.extend_from_slice(&req.resume);
        self.sched
            .add_for(id, tokens, namespace_root(&self.model_id, &namespace), &req.qos);
        if self.tier.is_some() {
            self.sched.set_key_root(id, BlockKey::root(&self.model_id, &namespace));
        }
        self.requests.insert(id, r);
    }

    pub(super) fn drop_request(&mut self, key: u64) {
        if let Some(r) = self.requests.remove(&key) {
            self.adapter_released |= r.adapter.is_some();
            for c in &r.choices {
                if let Some(s) = c.seq {
                    self.sched.remove(s);
                    self.owner.remove(&s);
                }
            }
        }
    }

    pub(super) fn reap_cancelled(&mut self) {
        // A sequence in a pipeline's step in flight is reaped once the step lands.
        let busy = self.in_flight();
        let gone: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| r.tx.is_closed() && !r.choices.iter().any(|c| c.seq.is_some_and(|s| busy.contains(&s))))
            .map(|(k, _)| *k)
            .collect();
        for key in gone {
            tracing::debug!(request_id = %self.requests[&key].request_id, "consumer gone; generation cancelled");
            self.drop_request(key);
        }
    }
}
