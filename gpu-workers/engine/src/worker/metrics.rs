//! The worker's Prometheus metrics: what only the engine knows. Served on `hearth worker`'s
//! `GET /metrics`; `hearth serve` adds the same collector to its gateway's registry.
//!
//! vLLM's names with Hearth's namespace where the meaning is the same:
//! `hearth:request_queue_time_seconds` (arrival at the engine → first scheduled step),
//! `hearth:request_prefill_time_seconds` (first scheduled step → first token),
//! `hearth:request_decode_time_seconds` (first token → last), `hearth:num_requests_running`,
//! `hearth:num_requests_waiting`, `hearth:kv_cache_usage_perc` (0–1; cached-idle blocks
//! count as free, as vLLM's do), `hearth:prefix_cache_queries_total` and
//! `hearth:prefix_cache_hits_total` (in tokens), `hearth:num_preemptions_total`. Hearth's
//! own: `hearth_model_load_seconds`, the load's progress (`hearth_model_weights_bytes`,
//! `hearth_model_weights_ready_bytes`, `hearth_model_layers`, `hearth_model_layers_ready`,
//! `hearth_model_weights_source{source}`), `hearth_engine_shed_total{priority}` (requests refused
//! because the queue was full), `hearth_spec_draft_tokens_total` and
//! `hearth_spec_accepted_tokens_total` (speculative decoding's acceptance rate is their
//! ratio), `hearth_moe_expert_tokens_total{layer,expert}` (rows routed to each expert), `hearth_grammar_masks_total` and `hearth_grammar_mask_seconds_total`
//! (constrained decoding), `hearth_engine_steps_cut_total` (steps cut short between layers
//! for an interactive request arriving during prompt work it outranks),
//! `hearth_engine_step_seconds{kind}` and `hearth_engine_step_rows_total{kind}` (forward steps
//! of decodes only, or with prompt tokens: time and rows), `hearth_engine_thread_seconds_total{phase}`
//! (where the engine thread's time goes). Every series carries a `worker` label.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;

use hearth_protocol::Priority;

use crate::engine::metrics::{EngineMetrics, Phase, StepKind};
use crate::kernels::pack_cache::{LoadProgress, WeightsSource};
use crate::kv::tier::TierMetrics;
use crate::worker::backend::Backend;

/// The engines to report, as (`worker` label, backend), read at every scrape (a catalogue
/// worker's models change at runtime).
type EngineList = Box<dyn Fn() -> Vec<(String, Arc<dyn Backend>)> + Send + Sync>;

/// Encodes the engines of this process at scrape time, one `worker` label each.
pub struct EngineCollector {
    engines: EngineList,
}

impl std::fmt::Debug for EngineCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCollector")
            .field("engines", &(self.engines)().len())
            .finish()
    }
}

impl EngineCollector {
    /// A fixed set of (worker label, backend).
    pub fn new(engines: Vec<(String, Arc<dyn Backend>)>) -> Self {
        Self::dynamic(move || engines.clone())
    }

    /// A set read at every scrape.
    pub fn dynamic(engines: impl Fn() -> Vec<(String, Arc<dyn Backend>)> + Send + Sync + 'static) -> Self {
        Self {
            engines: Box::new(engines),
        }
    }
}

/// The label keys of each metric this collector encodes, for the metrics reference (the
/// collector writes every descriptor even with no engines, but series only for engines it
/// has). A unit test keeps the names in step with the descriptors.
pub const SERIES_LABELS: &[(&str, &[&str])] = &[
    ("hearth:num_requests_running", &["worker"]),
    ("hearth:num_requests_waiting", &["worker"]),
    ("hearth:kv_cache_usage_perc", &["worker"]),
    ("hearth:prefix_cache_queries", &["worker"]),
    ("hearth:prefix_cache_hits", &["worker"]),
    ("hearth:num_preemptions", &["worker"]),
    ("hearth_model_load_seconds", &["worker"]),
    ("hearth_model_weights_bytes", &["worker"]),
    ("hearth_model_weights_ready_bytes", &["worker"]),
    ("hearth_model_layers", &["worker"]),
    ("hearth_model_layers_ready", &["worker"]),
    ("hearth_model_weights_source", &["worker", "source"]),
    ("hearth_adapters_loaded", &["worker"]),
    ("hearth_adapter_bytes", &["worker"]),
    ("hearth_adapter_loads", &["worker"]),
    ("hearth_adapter_load_seconds", &["worker"]),
    ("hearth_kv_transfer_bytes", &["worker"]),
    ("hearth_kv_transfer_blocks", &["worker"]),
    ("hearth_kv_transfer_failures", &["worker"]),
    ("hearth_spec_draft_tokens", &["worker"]),
    ("hearth_spec_accepted_tokens", &["worker"]),
    ("hearth_grammar_masks", &["worker"]),
    ("hearth_engine_steps_cut", &["worker"]),
    ("hearth_kv_tier_hits", &["worker", "tier"]),
    ("hearth_kv_tier_read_bytes", &["worker", "tier"]),
    ("hearth_kv_tier_writes", &["worker", "tier"]),
    ("hearth_kv_tier_evictions", &["worker", "tier"]),
    ("hearth_kv_tier_quota_evictions", &["worker", "tier"]),
    ("hearth_kv_tier_dropped_writes", &["worker", "tier"]),
    ("hearth_kv_tier_corrupt", &["worker", "tier"]),
    ("hearth_kv_tier_blocks", &["worker", "tier"]),
    ("hearth_kv_tier_bytes", &["worker", "tier"]),
    ("hearth_kv_tier_read_seconds", &["worker", "tier"]),
    ("hearth_grammar_mask_seconds", &["worker"]),
    ("hearth_moe_expert_tokens", &["worker", "layer", "expert"]),
    ("hearth_engine_shed", &["worker", "priority"]),
    ("hearth:request_queue_time_seconds", &["worker"]),
    ("hearth:request_prefill_time_seconds", &["worker"]),
    ("hearth:request_decode_time_seconds", &["worker"]),
    ("hearth_kv_transfer_seconds", &["worker"]),
    ("hearth_engine_step_seconds", &["worker", "kind"]),
    ("hearth_engine_step_rows", &["worker", "kind"]),
    ("hearth_engine_thread_seconds", &["worker", "phase"]),
];

impl EngineCollector {
    /// Every descriptor this collector writes, in the text exposition (no series: no
    /// engines): the source of the metrics reference, with [`SERIES_LABELS`].
    pub fn reference_exposition() -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(Self::new(Vec::new())));
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
            .expect("encoding into a String cannot fail");
        out
    }
}

type Labels<'a> = [(&'static str, &'a str); 1];
/// A metric's name, help and how to read it from the engine's counters (and block size).
type FromStats<T> = (
    &'static str,
    &'static str,
    fn(&crate::engine::command::EngineStats, u64) -> T,
);
type FromHistograms = (&'static str, &'static str, fn(&EngineMetrics) -> &Histogram);
type FromCounters = (&'static str, &'static str, fn(&EngineMetrics) -> &Counter);
type FromTier = (&'static str, &'static str, fn(&TierMetrics) -> &Counter);
type FromTierGauge = (&'static str, &'static str, fn(&TierMetrics) -> &Gauge);

impl Collector for EngineCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let engines = (self.engines)();
        let with_stats: Vec<_> = engines
            .iter()
            .filter_map(|(name, b)| Some((name.as_str(), b.stats()?, b.info().block_tokens as u64)))
            .collect();
        let gauges: [FromStats<f64>; 3] = [
            (
                "hearth:num_requests_running",
                "Sequences being prefilled or decoded.",
                |s, _| s.load.running as f64,
            ),
            (
                "hearth:num_requests_waiting",
                "Sequences waiting for admission.",
                |s, _| s.load.waiting as f64,
            ),
            (
                "hearth:kv_cache_usage_perc",
                "Fraction of KV blocks in use (cached-idle blocks count as free).",
                |s, _| {
                    if s.load.total_blocks == 0 {
                        0.0
                    } else {
                        1.0 - s.load.free_blocks as f64 / s.load.total_blocks as f64
                    }
                },
            ),
        ];
        for (name, help, value) in gauges {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (worker, s, bt) in &with_stats {
                let labels: Labels = [("worker", worker)];
                ConstGauge::new(value(s, *bt)).encode(m.encode_family(&labels)?)?;
            }
        }
        let counters: [FromStats<u64>; 3] = [
            (
                "hearth:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                |s, bt| s.prefix_queries * bt,
            ),
            (
                "hearth:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                |s, bt| s.prefix_hits * bt,
            ),
            (
                "hearth:num_preemptions",
                "Sequences preempted for lack of KV blocks.",
                |s, _| s.preemptions,
            ),
        ];
        for (name, help, value) in counters {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (worker, s, bt) in &with_stats {
                let labels: Labels = [("worker", worker)];
                ConstCounter::new(value(s, *bt)).encode(m.encode_family(&labels)?)?;
            }
        }
        let adapter_gauges: [FromStats<f64>; 2] = [
            (
                "hearth_adapters_loaded",
                "LoRA adapters loaded in the engine's adapter cache.",
                |s, _| s.adapters_loaded as f64,
            ),
            (
                "hearth_adapter_bytes",
                "Memory the loaded LoRA adapters take, in bytes.",
                |s, _| s.adapter_bytes as f64,
            ),
        ];
        for (name, help, value) in adapter_gauges {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (worker, s, bt) in &with_stats {
                let labels: Labels = [("worker", worker)];
                ConstGauge::new(value(s, *bt)).encode(m.encode_family(&labels)?)?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "hearth_adapter_loads",
            "LoRA adapters read from the store and loaded (cold starts and reloads).",
            None,
            MetricType::Counter,
        )?;
        for (worker, s, _) in &with_stats {
            let labels: Labels = [("worker", worker)];
            ConstCounter::new(s.adapter_loads).encode(m.encode_family(&labels)?)?;
        }
        let mut m = encoder.encode_descriptor(
            "hearth_adapter_load_seconds",
            "Time spent loading LoRA adapters.",
            None,
            MetricType::Counter,
        )?;
        for (worker, s, _) in &with_stats {
            let labels: Labels = [("worker", worker)];
            ConstCounter::new(s.adapter_load_seconds).encode(m.encode_family(&labels)?)?;
        }
        let mut m = encoder.encode_descriptor(
            "hearth_model_load_seconds",
            "Time to load the model and start the engine.",
            None,
            MetricType::Gauge,
        )?;
        for (worker, b) in &engines {
            if let Some(s) = b.load_seconds() {
                let labels: Labels = [("worker", worker)];
                ConstGauge::new(s).encode(m.encode_family(&labels)?)?;
            }
        }
        let progress: Vec<_> = engines
            .iter()
            .filter_map(|(n, b)| Some((n.as_str(), b.load_progress()?)))
            .collect();
        type FromProgress = (&'static str, &'static str, fn(&LoadProgress) -> u64);
        let progress_gauges: [FromProgress; 4] = [
            (
                "hearth_model_weights_bytes",
                "Bytes of packed weights the model computes with (repacked in memory, or mapped from a pack).",
                |p| p.bytes().1,
            ),
            (
                "hearth_model_weights_ready_bytes",
                "Of which ready: repacked, or mapped and checked (a pack's check goes on after the load: a large model's read advancing).",
                |p| p.bytes().0,
            ),
            (
                "hearth_model_layers",
                "Layers with packed weights (the output counts as one).",
                |p| p.layers().1 as u64,
            ),
            ("hearth_model_layers_ready", "Of which ready.", |p| p.layers().0 as u64),
        ];
        for (name, help, value) in progress_gauges {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (worker, p) in &progress {
                let labels: Labels = [("worker", worker)];
                ConstGauge::new(value(p) as i64).encode(m.encode_family(&labels)?)?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "hearth_model_weights_source",
            "Where the compute weights come from: 1 for `pack` (mapped from a prepared pack), `repacked` (in memory at load) or `unpacked` (the model file's own), 0 for the others.",
            None,
            MetricType::Gauge,
        )?;
        for (worker, p) in &progress {
            for source in WeightsSource::ALL {
                let labels = [("worker", *worker), ("source", source.name())];
                ConstGauge::new(i64::from(p.source() == source)).encode(m.encode_family(&labels)?)?;
            }
        }
        let with_metrics: Vec<_> = engines
            .iter()
            .filter_map(|(n, b)| Some((n.as_str(), b.metrics()?)))
            .collect();
        let transfer_counters: [FromCounters; 7] = [
            (
                "hearth_kv_transfer_bytes",
                "KV cache bytes imported from other workers (disaggregated decode, peer fetch).",
                |m| &m.transfer_bytes,
            ),
            (
                "hearth_kv_transfer_blocks",
                "KV blocks imported from other workers.",
                |m| &m.transfer_blocks,
            ),
            (
                "hearth_kv_transfer_failures",
                "KV transfers that failed or were cut (the request computed the rest).",
                |m| &m.transfer_failures,
            ),
            (
                "hearth_spec_draft_tokens",
                "Speculative decoding: draft tokens verified.",
                |m| &m.spec_drafted,
            ),
            (
                "hearth_spec_accepted_tokens",
                "Speculative decoding: draft tokens accepted (acceptance rate = accepted / draft).",
                |m| &m.spec_accepted,
            ),
            (
                "hearth_grammar_masks",
                "Constrained decoding: token masks computed.",
                |m| &m.grammar_masks,
            ),
            (
                "hearth_engine_steps_cut",
                "Forward steps cut short between layers for an interactive request arriving while they computed prompt tokens of work it outranks: batch work, or a tenant it would preempt (fair scheduling).",
                |m| &m.steps_cut,
            ),
        ];
        for (name, help, pick) in transfer_counters {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (worker, em) in &with_metrics {
                let labels: Labels = [("worker", worker)];
                pick(em).encode(m.encode_family(&labels)?)?;
            }
        }
        // Only engines with a tier below the pool.
        let tiered: Vec<_> = with_metrics.iter().filter(|(_, em)| em.kv_disk.enabled()).collect();
        let tier_counters: [FromTier; 7] = [
            (
                "hearth_kv_tier_hits",
                "KV blocks read back from a tier below the pool instead of recomputed.",
                |t| &t.hits,
            ),
            (
                "hearth_kv_tier_read_bytes",
                "KV bytes read back from a tier below the pool.",
                |t| &t.read_bytes,
            ),
            (
                "hearth_kv_tier_writes",
                "KV blocks the pool evicted and a tier below it stored.",
                |t| &t.writes,
            ),
            (
                "hearth_kv_tier_evictions",
                "KV blocks a tier dropped for room (whole oldest segments first).",
                |t| &t.evicted,
            ),
            (
                "hearth_kv_tier_quota_evictions",
                "KV blocks a tier dropped to keep a tenant within its quota.",
                |t| &t.quota_evicted,
            ),
            (
                "hearth_kv_tier_dropped_writes",
                "Evicted KV blocks not stored (the write queue was full, or the write failed).",
                |t| &t.dropped_writes,
            ),
            (
                "hearth_kv_tier_corrupt",
                "KV records refused on read by their checksum (the block was recomputed).",
                |t| &t.corrupt,
            ),
        ];
        for (name, help, pick) in tier_counters {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (worker, em) in &tiered {
                let labels = [("worker", *worker), ("tier", "disk")];
                pick(&em.kv_disk).encode(m.encode_family(&labels)?)?;
            }
        }
        let tier_gauges: [FromTierGauge; 2] = [
            ("hearth_kv_tier_blocks", "KV blocks a tier below the pool holds.", |t| {
                &t.blocks
            }),
            (
                "hearth_kv_tier_bytes",
                "Bytes of a tier's files (live records and not yet reclaimed ones).",
                |t| &t.bytes,
            ),
        ];
        for (name, help, pick) in tier_gauges {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (worker, em) in &tiered {
                let labels = [("worker", *worker), ("tier", "disk")];
                pick(&em.kv_disk).encode(m.encode_family(&labels)?)?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "hearth_kv_tier_read_seconds",
            "Time to read one request's run of KV blocks back from a tier below the pool.",
            None,
            MetricType::Histogram,
        )?;
        for (worker, em) in &tiered {
            let labels = [("worker", *worker), ("tier", "disk")];
            em.kv_disk.read_seconds.encode(m.encode_family(&labels)?)?;
        }
        let mut m = encoder.encode_descriptor(
            "hearth_grammar_mask_seconds",
            "Constrained decoding: time spent in the grammar (token masks, and checking drafts against it).",
            None,
            MetricType::Counter,
        )?;
        for (worker, em) in &with_metrics {
            let labels: Labels = [("worker", worker)];
            em.grammar_mask_seconds.encode(m.encode_family(&labels)?)?;
        }
        let mut m = encoder.encode_descriptor(
            "hearth_moe_expert_tokens",
            "Mixture-of-experts: rows routed to each expert of each layer (the statistics expert placement uses).",
            None,
            MetricType::Counter,
        )?;
        for (worker, em) in &with_metrics {
            for (layer, counts) in em.expert_load.snapshot() {
                let layer = layer.to_string();
                for (expert, n) in counts.into_iter().enumerate() {
                    let expert = expert.to_string();
                    let labels = [
                        ("worker", *worker),
                        ("layer", layer.as_str()),
                        ("expert", expert.as_str()),
                    ];
                    ConstCounter::new(n).encode(m.encode_family(&labels)?)?;
                }
            }
        }
        let mut m = encoder.encode_descriptor(
            "hearth_engine_shed",
            "Requests refused because the worker's queue was full, by priority class.",
            None,
            MetricType::Counter,
        )?;
        for (worker, em) in &with_metrics {
            for p in Priority::ALL {
                let labels = [("worker", *worker), ("priority", p.as_str())];
                em.shed(p).encode(m.encode_family(&labels)?)?;
            }
        }
        let hists: [FromHistograms; 4] = [
            (
                "hearth:request_queue_time_seconds",
                "Time from arrival at the engine to the first scheduled step.",
                |m| &m.queue,
            ),
            (
                "hearth:request_prefill_time_seconds",
                "Time from the first scheduled step to the first token.",
                |m| &m.prefill,
            ),
            (
                "hearth:request_decode_time_seconds",
                "Time from the first token to the last.",
                |m| &m.decode,
            ),
            (
                "hearth_kv_transfer_seconds",
                "Time to fetch and import a request's missing KV blocks from another worker (its prefill worker, or a peer holding them).",
                |m| &m.transfer,
            ),
        ];
        for (name, help, pick) in hists {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
            for (worker, em) in &with_metrics {
                let labels: Labels = [("worker", worker)];
                pick(em).encode(m.encode_family(&labels)?)?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "hearth_engine_step_seconds",
            "Forward steps that ran to the end, by kind: `decode` (one token per sequence, with its draft tokens) or `prompt` (prompt tokens, with or without decodes beside them).",
            None,
            MetricType::Histogram,
        )?;
        for (worker, em) in &with_metrics {
            for k in StepKind::ALL {
                let labels = [("worker", *worker), ("kind", k.as_str())];
                em.step_seconds[k as usize].encode(m.encode_family(&labels)?)?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "hearth_engine_step_rows",
            "Rows (tokens, draft tokens included) computed by forward steps that ran to the end, by step kind; rows ÷ steps is the mean rows per step.",
            None,
            MetricType::Counter,
        )?;
        for (worker, em) in &with_metrics {
            for k in StepKind::ALL {
                let labels = [("worker", *worker), ("kind", k.as_str())];
                em.step_rows[k as usize].encode(m.encode_family(&labels)?)?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "hearth_engine_thread_seconds",
            "The engine thread's busy time by phase: plan (drafts, schedule, block copies, the batch), forward (steps cut short included), sample (sampling and sending tokens), commands (admissions, KV imports and exports, expired holds, cancelled requests), publish (cache events and load); together the thread's busy time.",
            None,
            MetricType::Counter,
        )?;
        for (worker, em) in &with_metrics {
            for p in Phase::ALL {
                let labels = [("worker", *worker), ("phase", p.as_str())];
                em.thread_seconds[p as usize].encode(m.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// The sum of a metrics exposition's series of `name` (exactly that name, any labels) whose
/// labels contain `label` (every series of the name for `""`).
pub fn series_sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
                && l.contains(label)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_labels_name_exactly_the_descriptors() {
        let text = EngineCollector::reference_exposition();
        let mut described: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# HELP ")?.split(' ').next())
            .map(|n| n.strip_suffix("_total").unwrap_or(n))
            .collect();
        let mut listed: Vec<&str> = SERIES_LABELS.iter().map(|(n, _)| *n).collect();
        described.sort_unstable();
        listed.sort_unstable();
        assert_eq!(described, listed);
    }
}
