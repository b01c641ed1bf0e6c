//! Phase `route`: which worker gets the request — the model's policy (`kv_aware` by
//! default), session affinity (`x-session-affinity`), region (`x-hearth-region`, else the
//! gateway's), skipping workers already tried. The decision is a [`Placement`], which keeps
//! the router's load accounting until the request ends.

use std::sync::Arc;

use hearth_protocol::{block_hashes, namespace_root, BlockHash};
use hearth_router::{Policy, RouteInput};

use crate::registry::ServedModel;

/// What the router may use besides the tokens.
pub struct RouteHints {
    /// `x-session-affinity`.
    pub session: Option<String>,
    /// `x-hearth-region`, else the gateway's region.
    pub region: Option<String>,
    /// `prefix_aware`'s key: the leading text of the request and its cache namespace.
    pub prefix_key: u64,
}

/// The request as the router sees it: its prompt's block hashes and hints.
pub struct RouteRequest {
    pub hashes: Vec<BlockHash>,
    pub prompt_tokens: usize,
    pub hints: RouteHints,
}

impl RouteRequest {
    pub fn new(model: &ServedModel, prompt: &[u32], namespace: &str, hints: RouteHints) -> Self {
        let root = namespace_root(&model.id, namespace);
        // The engine reuses whole blocks and always computes the last prompt token.
        let hashes = block_hashes(root, &prompt[..prompt.len().saturating_sub(1)], model.block_tokens);
        Self {
            hashes,
            prompt_tokens: prompt.len(),
            hints,
        }
    }
}

/// A request's place on a worker, for the router's load accounting; released on drop
/// (completion, failure, cancellation alike).
pub struct Placement {
    model: Arc<ServedModel>,
    pub slot: usize,
    uncached: usize,
    started: bool,
}

impl Placement {
    /// The worker produced its first token: its prefill is done.
    pub fn first_token(&mut self) {
        if !self.started {
            self.started = true;
            self.model.router().on_first_token(self.slot, self.uncached);
        }
    }
}

impl Drop for Placement {
    fn drop(&mut self) {
        self.model.router().on_finish(self.slot, self.uncached, self.started);
    }
}

/// The best worker not in `exclude` (a bit mask of router slots), or None when none is left.
pub fn run(model: &Arc<ServedModel>, req: &RouteRequest, exclude: u64) -> Option<Placement> {
    let mut r = model.router();
    let input = RouteInput {
        hashes: &req.hashes,
        prompt_tokens: req.prompt_tokens,
        prefix_key: req.hints.prefix_key,
        session: req.hints.session.as_deref(),
        region: req.hints.region.as_deref(),
        exclude,
    };
    let d = r.route(&input, model.now_ms())?;
    let uncached = req.prompt_tokens - d.expected_cached_tokens;
    r.on_dispatch(d.worker, uncached);
    tracing::debug!(
        worker = d.worker,
        reason = d.reason.as_str(),
        expected_cached = d.expected_cached_tokens,
        "routed"
    );
    Some(Placement {
        model: model.clone(),
        slot: d.worker,
        uncached,
        started: false,
    })
}

/// `prefix_aware`'s key: the first `prefix_length` characters of the request's text and
/// its cache namespace (SageMaker's semantics).
pub fn prefix_key(model: &ServedModel, text: &str, namespace: &str) -> u64 {
    let len = match model.router().cfg.policy {
        Policy::PrefixAware { prefix_length, .. } => prefix_length,
        _ => 2048,
    };
    let lead: String = text.chars().take(len).collect();
    xxhash_rust::xxh3::xxh3_64(format!("{namespace}\0{lead}").as_bytes())
}
