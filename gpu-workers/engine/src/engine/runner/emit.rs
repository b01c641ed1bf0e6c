//! The runner's output: logits to tokens (sampling, grammar, drafts accepted), tokens to
//! streamed events, and what it publishes after a step (KV events, stats).

use std::time::{Duration, Instant};

use hearth_protocol::{EngineTimings, FinishReason, GenerateEvent, KvEvent, Tier, TokenLogprob, Usage};

use crate::engine::command::EngineStats;
use crate::engine::config::HOLD_TTL;
use crate::engine::metrics::{EngineMetrics, Phase};
use crate::engine::runner::{shown_bytes, Runner};
use crate::step::grammar::Grammar;
use crate::step::scheduler::StepItem;

impl Runner {
    /// A sequence reached its sampling point: `rows` are the logits after its last token
    /// and after each of its `draft` tokens.
    pub(super) fn on_logits(&mut self, it: &StepItem, rows: &[&[f32]], draft: &[u32]) {
        let Some(&(key, choice)) = self.owner.get(&it.seq) else {
            return;
        };
        let mut targets = vec![choice];
        if let Some(r) = self.requests.get_mut(&key) {
            if r.first_token.is_none() {
                let now = Instant::now();
                r.first_token = Some(now);
                EngineMetrics::observe(&self.metrics.prefill, now - r.scheduled.unwrap_or(r.started));
                r.cached_tokens = self.sched.get(it.seq).map_or(0, |s| s.cached_tokens).min(r.prompt_len);
            }
            if !r.forked {
                // n > 1: the other choices share this prompt's blocks from here on.
                r.forked = true;
                for j in 1..r.n as usize {
                    let child = self.next_id;
                    self.next_id += 1;
                    self.sched.fork(it.seq, child);
                    self.owner.insert(child, (key, j));
                    r.choices[j].seq = Some(child);
                    targets.push(j);
                }
            }
        }
        for c in targets {
            self.sample_choice(key, c, rows, draft);
        }
    }

    /// Emits the choice's next token, and with a draft, verifies it token by token: at each
    /// position the token is sampled exactly as without a draft, and kept as accepted when it
    /// equals the draft token (its K/V is already computed); the first disagreement is
    /// emitted and ends the step, and a fully accepted draft also gets the token after it.
    /// For a draft proposed with certainty (prompt lookup, grammar-forced tokens) this is
    /// rejection sampling — the draft kept with probability p(draft), else a draw from the
    /// rest — with one random draw per emitted token, so a seeded request gives the same
    /// text with speculation or without.
    fn sample_choice(&mut self, key: u64, ci: usize, rows: &[&[f32]], draft: &[u32]) {
        let mut accepted = 0;
        for (i, logits) in rows.iter().enumerate() {
            let proposal = draft.get(i).copied();
            let Some(tok) = self.choose(key, ci, logits) else {
                return;
            };
            let hit = proposal == Some(tok);
            let more = self.emit(key, ci, tok, logits, hit);
            if hit {
                accepted += 1;
            }
            if !more || !hit {
                break;
            }
        }
        if draft.is_empty() {
            return;
        }
        self.metrics.spec_drafted.inc_by(draft.len() as u64);
        self.metrics.spec_accepted.inc_by(accepted as u64);
        if let Some(r) = self.requests.get_mut(&key) {
            r.choices[ci].spec.record(draft.len(), accepted);
        }
    }

    /// The token to emit after `logits`: end-of-sequence suppressed where asked, the
    /// grammar's mask applied, then sampled.
    pub(super) fn choose(&mut self, key: u64, ci: usize, logits: &[f32]) -> Option<u32> {
        let r = self.requests.get_mut(&key)?;
        let params = &r.params;
        let ch = &mut r.choices[ci];
        ch.seq?;
        let suppress_eos = params.ignore_eos || ch.generated < params.min_tokens as usize;
        let mut masked = None;
        if let Some(g) = ch.grammar.as_mut() {
            let mut l = logits.to_vec();
            let remaining = r.max_tokens.saturating_sub(ch.generated);
            let took = g.mask_within(&mut l, remaining);
            self.metrics.grammar_masks.inc();
            self.metrics.grammar_mask_seconds.inc_by(took.as_secs_f64());
            masked = Some(l);
        }
        if suppress_eos {
            let l = masked.get_or_insert_with(|| logits.to_vec());
            let eog = &self.end_of_generation;
            // A grammar that allows nothing but the end wins over min_tokens / ignore_eos.
            let other = ch.grammar.is_none()
                || l.iter()
                    .enumerate()
                    .any(|(t, v)| v.is_finite() && !eog.contains(&(t as u32)));
            if other {
                for &e in eog {
                    l[e as usize] = f32::NEG_INFINITY;
                }
            }
        }
        let l = masked.as_deref().unwrap_or(logits);
        Some(ch.sampler.sample(l))
    }

    /// Sends `tok` and advances the choice; `kv_ready`: it was a verified draft token (its
    /// K/V is computed). False when the choice has finished.
    pub(super) fn emit(&mut self, key: u64, ci: usize, tok: u32, logits: &[f32], kv_ready: bool) -> bool {
        let Some(r) = self.requests.get_mut(&key) else {
            return false;
        };
        let params = &r.params;
        let ch = &mut r.choices[ci];
        let Some(seq) = ch.seq else { return false };
        let suppress_eos = params.ignore_eos || ch.generated < params.min_tokens as usize;
        let (logprob, top_logprobs) = if params.logprobs || params.top_logprobs > 0 {
            log_probs(logits, tok, params.top_logprobs as usize)
        } else {
            (None, Vec::new())
        };
        ch.generated += 1;
        // (A grammar offers the end only when it allows nothing else.)
        let eog = (!suppress_eos || ch.grammar.is_some()) && self.end_of_generation.contains(&tok);
        let mut grammar_done = false;
        if let (Some(g), false) = (ch.grammar.as_mut(), eog) {
            g.advance(tok);
            grammar_done = g.is_stopped();
        }
        let bytes = if eog {
            &[][..]
        } else {
            shown_bytes(&self.tokenizer, tok, &r.params.special_text)
        };
        let released = ch.text.push(bytes);
        // A constrained answer closed early to fit its budget was cut short: `length`.
        let closed_early = ch.grammar.as_ref().is_some_and(Grammar::closing);
        let finish = if (eog || grammar_done) && closed_early {
            Some(FinishReason::Length)
        } else if released.stopped || eog || grammar_done {
            Some(FinishReason::Stop)
        } else if ch.generated >= r.max_tokens {
            Some(FinishReason::Length)
        } else if r.prefill_only {
            Some(FinishReason::Handoff)
        } else {
            None
        };
        let mut text = released.text;
        // A handed-off request's held-back text is the decode worker's to release.
        if finish.is_some_and(|f| f != FinishReason::Handoff) && !released.stopped {
            text.push_str(&ch.text.finish());
        }
        let _ = r.tx.send(GenerateEvent::Token {
            index: ci as u32,
            id: tok,
            text,
            logprob,
            top_logprobs,
        });
        let Some(reason) = finish else {
            if kv_ready {
                self.sched.accept_draft(seq, tok);
            } else {
                self.sched.push_token(seq, tok);
            }
            return true;
        };
        ch.finish = Some(reason);
        ch.seq = None;
        let _ = r.tx.send(GenerateEvent::Finish {
            index: ci as u32,
            finish_reason: reason,
        });
        if reason == FinishReason::Handoff {
            // The prompt's cached blocks stay referenced until the decode worker has them.
            let blocks = self.sched.cached_blocks(seq);
            for &b in &blocks {
                self.sched.blocks.share(b);
            }
            let until = Instant::now() + HOLD_TTL;
            if let Some((old, _)) = self.holds.insert(r.request_id.clone(), (blocks, until)) {
                for b in old.into_iter().rev() {
                    self.sched.blocks.release(b);
                }
            }
        }
        self.sched.remove(seq);
        self.owner.remove(&seq);
        if r.choices.iter().all(|c| c.finish.is_some()) {
            let completion: usize = r.choices.iter().map(|c| c.generated).sum();
            let now = Instant::now();
            let total = (now - r.started).as_secs_f64();
            let ttft = r.first_token.map_or(total, |t| (t - r.started).as_secs_f64());
            if let Some(t) = r.first_token.filter(|_| reason != FinishReason::Handoff) {
                EngineMetrics::observe(&self.metrics.decode, now - t);
            }
            let scheduled = r.scheduled.unwrap_or(r.started);
            let first = r.first_token.unwrap_or(now);
            let us = |d: Duration| d.as_micros() as u64;
            let timings = EngineTimings {
                queue_us: us(scheduled - r.started),
                prefill_us: us(first.saturating_duration_since(scheduled)),
                decode_us: us(now - first),
            };
            tracing::info!(
                request_id = %r.request_id,
                prompt_tokens = r.prompt_len,
                cached_tokens = r.cached_tokens,
                completion_tokens = completion,
                ttft_ms = (ttft * 1000.0) as u64,
                decode_tok_s = ((completion as f64 - 1.0).max(0.0) / (total - ttft).max(1e-9)) as u64,
                finish = r.choices[0].finish.map_or("", |f| f.as_str()),
                "request done"
            );
            let _ = r.tx.send(GenerateEvent::Done {
                finish_reason: r.choices[0].finish.unwrap_or(reason),
                usage: Usage {
                    prompt_tokens: r.prompt_len as u32,
                    cached_tokens: r.cached_tokens as u32,
                    completion_tokens: completion as u32,
                },
                timings,
            });
            if let Some(r) = self.requests.remove(&key) {
                self.adapter_released |= r.adapter.is_some();
            }
        }
        false
    }

    /// Sends KV events and (at most every 50 ms, when it changed) the load report.
    /// [`Self::announce`], timed as the publish phase.
    pub(super) fn publish(&mut self) {
        let t = Instant::now();
        self.announce();
        self.metrics.spend(Phase::Publish, t.elapsed());
    }

    /// Sends the block events since the last call, the load (at most every 50 ms, or when
    /// idle) and the adapter set when it changed, and updates the stats.
    pub(super) fn announce(&mut self) {
        let ev = self.sched.blocks.take_events();
        if !ev.stored.is_empty() {
            let _ = self.kv_tx.send(KvEvent::Stored {
                blocks: ev.stored,
                tier: Tier::Device,
            });
        }
        if !ev.removed.is_empty() {
            let _ = self.kv_tx.send(KvEvent::Removed {
                blocks: ev.removed,
                tier: Tier::Device,
            });
        }
        let load = self.sched.load();
        if load != self.last_load.0 && (self.last_load.1.elapsed() >= Duration::from_millis(50) || self.sched.is_idle())
        {
            let _ = self.kv_tx.send(KvEvent::Load(load));
            self.last_load = (load, Instant::now());
        }
        let (adapter_loads, adapter_load_seconds) = self.adapters.loads();
        // The set changes only when an adapter is loaded or unloaded, each of which counts.
        let adapter_state = (adapter_loads, self.adapters.loaded());
        if adapter_state != self.last_adapters {
            self.last_adapters = adapter_state;
            let _ = self.kv_tx.send(KvEvent::Adapters {
                loaded: self.adapters.digests(),
            });
        }
        self.stats_tx.send_replace(EngineStats {
            load,
            prefix_queries: self.sched.blocks.queries,
            prefix_hits: self.sched.blocks.hits,
            preemptions: self.sched.preemptions,
            steps: self.steps,
            adapters_loaded: self.adapters.loaded(),
            adapter_bytes: self.adapters.bytes(),
            adapter_loads,
            adapter_load_seconds,
            device_failed: self.compute.failed() && self.compute.depth() == 1,
            stage_lost: self.compute.failed() && self.compute.depth() > 1,
        });
    }
}

/// The chosen token's log-probability and the `k` most likely alternatives.
fn log_probs(logits: &[f32], chosen: u32, k: usize) -> (Option<f32>, Vec<TokenLogprob>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let mut top = Vec::new();
    if k > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = k.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        idx.truncate(k);
        idx.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        top = idx
            .into_iter()
            .map(|id| TokenLogprob {
                id,
                logprob: logits[id as usize] - lse,
            })
            .collect();
    }
    (Some(logits[chosen as usize] - lse), top)
}
