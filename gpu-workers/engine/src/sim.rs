//! The `sim` backend: the real scheduler, KV cache and prefix cache, with the model maths
//! replaced by a cost model, in virtual time. Many simulated workers and hours of traffic
//! fit on one small machine in seconds (`hearth bench routing`).
//!
//! Default cost model (stated, not measured here): a 70B-class model on one 8-GPU node with
//! vLLM — prefill ≈ 12,000 tokens/s, a decode step ≈ 30 ms + 0.25 ms per running sequence,
//! 250,000 tokens of KV cache. These are round numbers of the order published for Llama 3.1
//! 70B on 8×H100/A100 nodes; only their ratios matter for comparing routing policies.

use std::collections::HashMap;

use hearth_protocol::{BlockHash, LoadReport};

use crate::kv::BlockEvents;
use crate::scheduler::{Scheduler, SchedulerConfig};

#[derive(Debug, Clone, Copy)]
pub struct CostModel {
    pub prefill_tok_s: f64,
    pub decode_step_s: f64,
    pub decode_per_seq_s: f64,
    pub kv_tokens: usize,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            prefill_tok_s: 12_000.0,
            decode_step_s: 0.030,
            decode_per_seq_s: 0.000_25,
            kv_tokens: 250_000,
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
}

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
}

impl SimWorker {
    pub fn new(cost: CostModel) -> Self {
        let bt = hearth_protocol::DEFAULT_BLOCK_TOKENS;
        let cfg = SchedulerConfig {
            block_tokens: bt,
            max_batch_tokens: 8192,
            max_running: 256,
        };
        Self {
            sched: Scheduler::new(cfg, cost.kv_tokens / bt),
            cost,
            requests: HashMap::new(),
        }
    }

    pub fn submit(&mut self, id: u64, prompt: Vec<u32>, root: BlockHash, max_tokens: usize) {
        self.requests.insert(
            id,
            SimRequest {
                max_tokens: max_tokens.max(1),
                generated: 0,
                cached_tokens: 0,
            },
        );
        self.sched.add(id, prompt, root);
    }

    pub fn is_idle(&self) -> bool {
        self.sched.is_idle()
    }

    pub fn load(&self) -> LoadReport {
        self.sched.load()
    }

    pub fn take_events(&mut self) -> BlockEvents {
        self.sched.blocks.take_events()
    }

    /// Runs one step; `None` when there is nothing to do.
    pub fn step(&mut self) -> Option<SimStep> {
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
            seconds: prefill as f64 / self.cost.prefill_tok_s
                + if decodes > 0 {
                    self.cost.decode_step_s + decodes as f64 * self.cost.decode_per_seq_s
                } else {
                    0.0
                },
            ..Default::default()
        };
        self.sched.complete(&items);
        for it in items.iter().filter(|i| i.sample) {
            let Some(r) = self.requests.get_mut(&it.seq) else {
                continue;
            };
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
