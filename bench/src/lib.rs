//! Hearth's benchmarks, kept outside the production libraries and run through
//! `hearth bench …`: each prints a table and can write JSON.
//!
//! * [`gateway`] — what authentication, limits, budgets and metering add per request;
//! * [`processors`] — tenant processor overhead per guest language, and core scaling;
//! * [`routing`] — routing policies on simulated workers, and the router micro-benchmark;
//! * [`pd`] — prefill/decode disaggregation vs colocated serving, on real worker processes
//!   and on simulated workers;
//! * [`agent`] — agent workloads (extraction, tool calls, edits, chat) with and without
//!   speculative decoding, the grammar mask's cost and schema validity, on the engine;
//! * [`fairness`] — FIFO vs fair scheduling between tenants and classes on one saturated
//!   worker (sim and engine);
//! * [`tokenizer`] — Hearth's tokenizer against Hugging Face's `tokenizers`, side by side;
//! * [`batch`] — a large batch (OpenAI Batch API) beside interactive load on one engine:
//!   the batch's share of the idle capacity and the interactive TTFT it costs;
//! * [`soak`] — long mixed traffic through real processes, sampling memory, descriptors and
//!   tasks for leaks, and checking the usage books.
//!
//! * [`engine`] — the engine's hot paths in-process (step, TTFT, decode at batch), with its
//!   attention, cold-start, KV-tier, KV-transfer and LoRA benchmarks as submodules.
//!
//! Side-by-side
//! comparisons with other projects are the scripts beside this crate
//! (`llamacpp-compare`, `gateway-compare`), measured in the same run.

pub mod agent;
pub mod batch;
pub mod engine;
pub mod fairness;
pub mod gateway;
pub mod pd;
pub mod processors;
mod procs;
pub mod routing;
pub mod soak;
pub mod tokenizer;

/// The value at `p` (0–1) of ascending `sorted` samples (0 when there are none).
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The benchmarks' seeded xorshift generator (workloads must be the same run to run).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponential inter-arrival time at `rate` per second.
    pub(crate) fn gap(&mut self, rate: f64) -> f64 {
        -(1.0 - self.unit()).ln() / rate
    }

    pub(crate) fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[(self.next() % xs.len() as u64) as usize]
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}
