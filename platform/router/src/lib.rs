//! Hearth's request router: picks the worker for each request so that repeated prefixes
//! land where their KV blocks are cached *and* load stays even.
//!
//! * [`index::PrefixIndex`] — which worker holds which block hash (exact from KV events,
//!   approximate from the router's own decisions with a TTL).
//! * [`ring::HashRing`] — consistent hashing with bounded loads for `prefix_aware`.
//! * [`Router`] — the policies (`random`, `least_outstanding`, `prefix_aware`, `kv_aware`),
//!   session affinity, regions, and the load accounting they use.
//!
//! The router never sends work to a worker over its load bound because of a cache hit:
//! a hit only breaks ties among workers under the bound (no "death spiral"). When the
//! worker chosen lacks a prefix a peer holds in its pool, the decision names that peer
//! ([`Decision::fetch`]): the worker pulls the blocks from it instead of recomputing them.

pub mod index;
pub mod ring;

use std::collections::HashMap;

use hearth_protocol::BlockHash;
use serde::{Deserialize, Serialize};

pub use index::{PrefixIndex, MAX_WORKERS};
pub use ring::HashRing;

/// A routing policy (per model).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case")]
pub enum Policy {
    Random,
    LeastOutstanding,
    /// SageMaker's PREFIX_AWARE: hash of the first `prefix_length` characters (plus the
    /// cache id) on a bounded-load ring; past `concurrency_threshold` in-flight requests on
    /// the chosen worker, the least busy worker takes the request.
    PrefixAware {
        prefix_length: usize,
        concurrency_threshold: u32,
    },
    /// Cost in token units: uncached prompt tokens × `prefill_weight` + tokens the worker
    /// holds only in its disk tier × `prefill_weight` × `disk_weight` + tokens it would
    /// fetch from a peer × `prefill_weight` × `fetch_weight` + in-flight prefill tokens +
    /// running sequences × `decode_weight`; minimum among workers under the bound.
    /// (Dynamo's `prefill − c·device − w_disk·disk` shape: a pool hit costs nothing, a disk
    /// hit the read-back's share of recomputing it, a peer's blocks the transfer's share.)
    KvAware {
        prefill_weight: f64,
        decode_weight: f64,
        /// A disk-tier hit's cost per token as a fraction of prefilling it; measured by
        /// `hearth bench kv-tiers` (TTFT of a disk hit ÷ TTFT of recompute).
        #[serde(default = "default_disk_weight")]
        disk_weight: f64,
        /// A peer fetch's cost per token as a fraction of prefilling it; measured by
        /// `hearth bench kv-tiers` (TTFT of a pulled prefix ÷ TTFT of recompute).
        #[serde(default = "default_fetch_weight")]
        fetch_weight: f64,
    },
}

impl Policy {
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Random => "random",
            Policy::LeastOutstanding => "least_outstanding",
            Policy::PrefixAware { .. } => "prefix_aware",
            Policy::KvAware { .. } => "kv_aware",
        }
    }

    /// The defaults of each policy by name.
    pub fn parse(name: &str) -> Option<Policy> {
        Some(match name {
            "random" => Policy::Random,
            "least_outstanding" => Policy::LeastOutstanding,
            "prefix_aware" => Policy::PrefixAware {
                prefix_length: 2048,
                concurrency_threshold: 32,
            },
            "kv_aware" => Policy::KvAware {
                prefill_weight: 1.0,
                decode_weight: 8.0,
                disk_weight: default_disk_weight(),
                fetch_weight: default_fetch_weight(),
            },
            _ => return None,
        })
    }
}

/// For people (the operator console): the policy's name and its weights.
impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Policy::Random | Policy::LeastOutstanding => f.write_str(self.name()),
            Policy::PrefixAware {
                prefix_length,
                concurrency_threshold,
            } => write!(
                f,
                "{} (first {prefix_length} characters; the least busy worker past {concurrency_threshold} in flight)",
                self.name()
            ),
            Policy::KvAware {
                prefill_weight,
                decode_weight,
                disk_weight,
                fetch_weight,
            } => write!(
                f,
                "{} (prefill ×{prefill_weight}, decode ×{decode_weight}, disk hit ×{disk_weight}, peer fetch ×{fetch_weight})",
                self.name()
            ),
        }
    }
}

/// A disk-tier hit's cost as a share of recomputing it. `hearth bench kv-tiers` on the
/// default model, 2-core AVX2 CPU worker, page cache dropped: TTFT of a disk hit ÷ TTFT of
/// recompute = 0.05× at 64 and 256 tokens, 0.02× at 1,024, 0.01× at 4,096; the short end,
/// where the choice matters most, is taken.
pub fn default_disk_weight() -> f64 {
    0.05
}

/// A peer fetch's cost as a share of recomputing it. `hearth bench kv-tiers` (a), same
/// machine, pulled over loopback HTTP from an idle peer: 0.07–0.16× at 64 tokens, 0.05–0.07×
/// at 256, 0.03× at 1,024, 0.01× at 4,096; 0.1 is taken. Part (c), a fetch inside a
/// running workload (the receiving pool's pages touched for the first time), measured
/// ~0.24× for 512 tokens: on a real link the weight is optimistic.
pub fn default_fetch_weight() -> f64 {
    0.1
}

/// Fewest tokens a peer fetch is asked for, by default. At one block (16 tokens) a pull over
/// loopback (9–35 ms, mostly round trips) beat recomputing it (24–56 ms) on this CPU, but
/// saves at most ~20 ms, less than a slower link's round trips; two blocks is a cautious
/// margin (`hearth bench kv-tiers` (a)), not the loopback break-even.
pub const DEFAULT_FETCH_MIN_TOKENS: usize = 32;

/// Why a worker was chosen (a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Cache-aware choice with cached blocks on the chosen worker.
    Hit,
    /// Cache-aware choice, nothing cached anywhere useful.
    Miss,
    Affinity,
    /// The preferred worker was too busy; the least busy took it.
    Overflow,
    /// No worker in the preferred region was under its bound.
    Spill,
    Random,
    LeastOutstanding,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Hit => "hit",
            Reason::Miss => "miss",
            Reason::Affinity => "affinity",
            Reason::Overflow => "overflow",
            Reason::Spill => "spill",
            Reason::Random => "random",
            Reason::LeastOutstanding => "least_outstanding",
        }
    }
}

/// What the router knows about one worker.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WorkerState {
    pub name: String,
    pub region: String,
    /// `both`, `prefill` or `decode`.
    pub role: String,
    /// Sequences the worker runs at once (0 = unknown).
    pub capacity: u32,
    /// Peers may pull KV blocks from it (the gateway holds the workers' token).
    pub kv_peer: bool,
    /// Its queue limit in prompt tokens not yet computed (0: unbounded).
    pub queue_tokens: u64,
    pub healthy: bool,
    pub draining: bool,
    /// The worker publishes KV events (exact index); otherwise the router assumes.
    pub exact_events: bool,
    pub outstanding: u32,
    pub inflight_prefill_tokens: u64,
    pub decoding: u32,
    /// Prompt tokens of the requests this worker finished, and how many of them its prefix
    /// cache served (the engine's `cached_tokens`): the worker's measured cache hit rate.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Requests placed here with a peer fetch ([`Decision::fetch`]).
    pub fetches: u64,
    /// Which worker holds this slot: slots are reused after a worker leaves, so whoever
    /// accounts for a request checks that its worker still holds the slot.
    pub serial: u64,
    /// Load other gateways placed on this worker (shared through Redis; see the gateway's
    /// `cluster` module): counted with this gateway's own in the load bound and the costs.
    pub remote_outstanding: u32,
    pub remote_prefill_tokens: u64,
    pub remote_decoding: u32,
    /// Digests of the LoRA adapters it has loaded (its KV events say).
    pub adapters: Vec<String>,
}

impl WorkerState {
    /// Requests in flight on the worker, from every gateway this one knows of.
    pub fn load(&self) -> u32 {
        self.outstanding + self.remote_outstanding
    }
}

#[derive(Debug, Clone)]
pub struct RouterConfig {
    pub policy: Policy,
    /// Load bound: a worker may take a request while its outstanding requests are at most
    /// `load_factor` × the average (plus one).
    pub load_factor: f64,
    pub home_region: String,
    /// Session-affinity entries expire after this long (router time units).
    pub affinity_ttl: u64,
    /// Approximate index entries expire after this long.
    pub approx_ttl: u64,
    pub block_tokens: usize,
    /// Peer fetch: a worker that lacks at least this many leading prompt tokens another
    /// worker (a `kv_peer`) holds in its pool pulls them from there; 0: never.
    pub fetch_min_tokens: usize,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            policy: Policy::parse("kv_aware").unwrap_or(Policy::Random),
            load_factor: 1.25,
            home_region: "local".into(),
            affinity_ttl: 600_000,
            approx_ttl: 120_000,
            block_tokens: hearth_protocol::DEFAULT_BLOCK_TOKENS,
            fetch_min_tokens: DEFAULT_FETCH_MIN_TOKENS,
        }
    }
}

/// One request, as the router sees it.
#[derive(Debug, Clone, Copy)]
pub struct RouteInput<'a> {
    pub hashes: &'a [BlockHash],
    pub prompt_tokens: usize,
    /// `prefix_aware`'s key: hash of the leading text and the cache id.
    pub prefix_key: u64,
    pub session: Option<&'a str>,
    pub region: Option<&'a str>,
    /// Workers not to use for this attempt (already failed).
    pub exclude: u64,
    /// Whether the chosen worker may pull a prefix from a peer ([`Decision::fetch`]).
    pub fetch: bool,
    /// The digest of the request's LoRA adapter: workers that have it loaded are preferred
    /// while one is under its load bound.
    pub adapter: Option<&'a str>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    pub worker: usize,
    pub reason: Reason,
    /// Prompt tokens the index expects the worker to have cached (fetched ones included).
    pub expected_cached_tokens: usize,
    /// The peer to pull the prompt's leading blocks from, when the worker lacks them.
    pub fetch: Option<Fetch>,
}

/// A peer fetch: the chosen worker pulls the prompt's leading blocks from `from`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fetch {
    /// The holder's slot.
    pub from: usize,
    /// Leading prompt tokens the holder has in its pool (whole blocks): what to ask for.
    pub held_tokens: usize,
    /// Of those, the tokens the chosen worker lacks.
    pub tokens: usize,
}

/// The router for one model's pool.
#[derive(Debug)]
pub struct Router {
    pub cfg: RouterConfig,
    pub index: PrefixIndex,
    workers: Vec<Option<WorkerState>>,
    ring: HashRing,
    affinity: HashMap<String, (usize, u64)>,
    rng: u64,
    pub decisions: HashMap<(&'static str, Reason), u64>,
    /// Decisions naming a peer to fetch from ([`Decision::fetch`]).
    pub fetches: u64,
    /// The last slot serial handed out.
    serials: u64,
}

impl Router {
    pub fn new(cfg: RouterConfig) -> Self {
        Self {
            cfg,
            index: PrefixIndex::new(),
            workers: Vec::new(),
            ring: HashRing::default(),
            affinity: HashMap::new(),
            rng: 0x9E37_79B9_7F4A_7C15,
            decisions: HashMap::new(),
            fetches: 0,
            serials: 0,
        }
    }

    /// Adds a worker; returns its slot (None when the pool is full).
    pub fn add_worker(&mut self, name: &str, region: &str, exact_events: bool) -> Option<usize> {
        let slot = match self.workers.iter().position(Option::is_none) {
            Some(s) => s,
            None if self.workers.len() < MAX_WORKERS => {
                self.workers.push(None);
                self.workers.len() - 1
            }
            None => return None,
        };
        self.serials += 1;
        self.workers[slot] = Some(WorkerState {
            name: name.into(),
            region: region.into(),
            role: "both".into(),
            healthy: true,
            exact_events,
            serial: self.serials,
            ..Default::default()
        });
        self.rebuild_ring();
        Some(slot)
    }

    /// Removes a worker: its blocks leave the index, its sessions are re-routed.
    pub fn remove_worker(&mut self, slot: usize) {
        if let Some(w) = self.workers.get_mut(slot) {
            *w = None;
        }
        self.index.reset_worker(slot, &[]);
        self.affinity.retain(|_, (w, _)| *w != slot);
        self.rebuild_ring();
    }

    fn rebuild_ring(&mut self) {
        self.ring = HashRing::new(
            self.workers
                .iter()
                .enumerate()
                .filter_map(|(i, w)| w.as_ref().map(|w| (i, w.name.as_str()))),
        );
    }

    pub fn worker(&self, slot: usize) -> Option<&WorkerState> {
        self.workers.get(slot).and_then(Option::as_ref)
    }

    pub fn worker_mut(&mut self, slot: usize) -> Option<&mut WorkerState> {
        self.workers.get_mut(slot).and_then(Option::as_mut)
    }

    pub fn workers(&self) -> impl Iterator<Item = (usize, &WorkerState)> {
        self.workers
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.as_ref().map(|w| (i, w)))
    }

    fn next_rand(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The outstanding-request bound every worker is held to: `load_factor` × the average
    /// over all usable workers (counting this request), plus one request of slack so that
    /// trivial loads do not scatter sessions.
    fn bound(&self, usable: u64) -> u32 {
        let n = usable.count_ones().max(1) as f64;
        let total: u32 = self
            .workers()
            .filter(|(i, _)| usable & (1 << i) != 0)
            .map(|(_, w)| w.load())
            .sum();
        (self.cfg.load_factor * (total as f64 + 1.0) / n).ceil() as u32 + 1
    }

    fn under(&self, slot: usize, bound: u32) -> bool {
        self.worker(slot).is_some_and(|w| w.load() < bound)
    }

    fn least_outstanding(&mut self, set: u64) -> Option<usize> {
        let mut best: Option<(u32, u64, usize)> = None;
        let mut bits = set;
        while bits != 0 {
            let i = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            let load = self.worker(i).map_or(u32::MAX, WorkerState::load);
            let tie = self.next_rand();
            if best.is_none_or(|(l, t, _)| (load, tie) < (l, t)) {
                best = Some((load, tie, i));
            }
        }
        best.map(|b| b.2)
    }

    /// Picks a worker. `now` is in the same units as the TTLs.
    pub fn route(&mut self, input: &RouteInput<'_>, now: u64) -> Option<Decision> {
        let usable: u64 = self
            .workers()
            .filter(|(_, w)| w.healthy && !w.draining)
            .fold(0, |acc, (i, _)| acc | (1 << i))
            & !input.exclude;
        if usable == 0 {
            return None;
        }
        // Regions: prefer the request's (or the gateway's) region; spill when it is full.
        let region = input.region.unwrap_or(&self.cfg.home_region).to_string();
        let local: u64 = self
            .workers()
            .filter(|(i, w)| usable & (1 << i) != 0 && w.region == region)
            .fold(0, |a, (i, _)| a | (1 << i));
        let bound = self.bound(usable);
        let mut spilled = false;
        let mut candidates = if local != 0 { local } else { usable };
        if local != 0
            && local != usable
            && (0..MAX_WORKERS)
                .filter(|i| local & (1 << i) != 0)
                .all(|i| !self.under(i, bound))
        {
            candidates = usable;
            spilled = true;
        }
        // An adapter: the workers that have it loaded, while one of them has room (loading
        // it elsewhere costs a read and a check; its cached prefixes are there too).
        if let Some(a) = input.adapter {
            let warm = (0..MAX_WORKERS)
                .filter(|&i| candidates & (1 << i) != 0 && self.under(i, bound))
                .filter(|&i| self.worker(i).is_some_and(|w| w.adapters.iter().any(|d| d == a)))
                .fold(0u64, |m, i| m | (1 << i));
            if warm != 0 {
                candidates = warm;
            }
        }
        let bt = self.cfg.block_tokens;
        let most = input.prompt_tokens.saturating_sub(1);
        // Every usable worker's matches, not only the candidates': a peer in another region
        // (or over its bound) may still hand its blocks over.
        let (in_pool, matched) = self.index.matches_tiers(input.hashes, usable, now);
        let cached_on = |w: usize| (matched[w] as usize * bt).min(most);
        // The peer holding the longest run in its pool, and that run in tokens.
        let holder = if input.fetch {
            self.fetch_holder(&in_pool, usable)
        } else {
            None
        };
        let min_fetch = self.cfg.fetch_min_tokens.max(1);
        let fetchable = |w: usize| match holder {
            Some((from, held)) if from != w && held.min(most) >= cached_on(w) + min_fetch => Some(Fetch {
                from,
                held_tokens: held,
                tokens: held.min(most) - cached_on(w),
            }),
            _ => None,
        };
        let decide = |worker: usize, reason: Reason| {
            let fetch = fetchable(worker);
            Decision {
                worker,
                reason,
                expected_cached_tokens: cached_on(worker) + fetch.map_or(0, |f| f.tokens),
                fetch,
            }
        };

        // Session affinity, while the pinned worker is usable and under its bound — in any
        // region: the session's cache is there (a session pinned by a gateway of another
        // region stays where it is).
        if let Some(s) = input.session {
            if let Some(&(w, exp)) = self.affinity.get(s) {
                if exp >= now && usable & (1 << w) != 0 && self.under(w, bound) {
                    self.affinity.insert(s.to_string(), (w, now + self.cfg.affinity_ttl));
                    return Some(self.finish(decide(w, Reason::Affinity), input, now));
                }
            }
        }

        let policy = self.cfg.policy;
        let mut d = match policy {
            Policy::Random => {
                let under: Vec<usize> = (0..MAX_WORKERS)
                    .filter(|&i| candidates & (1 << i) != 0 && self.under(i, bound))
                    .collect();
                let pool: Vec<usize> = if under.is_empty() {
                    (0..MAX_WORKERS).filter(|&i| candidates & (1 << i) != 0).collect()
                } else {
                    under
                };
                let w = pool[(self.next_rand() % pool.len() as u64) as usize];
                decide(w, Reason::Random)
            }
            Policy::LeastOutstanding => decide(self.least_outstanding(candidates)?, Reason::LeastOutstanding),
            Policy::PrefixAware {
                concurrency_threshold, ..
            } => {
                let owner = self
                    .ring
                    .walk(input.prefix_key)
                    .find(|&w| candidates & (1 << w) != 0 && self.under(w, bound));
                match owner {
                    Some(w) if self.worker(w).is_some_and(|s| s.load() < concurrency_threshold) => {
                        decide(w, if matched[w] > 0 { Reason::Hit } else { Reason::Miss })
                    }
                    _ => decide(self.least_outstanding(candidates)?, Reason::Overflow),
                }
            }
            Policy::KvAware {
                prefill_weight,
                decode_weight,
                disk_weight,
                fetch_weight,
            } => {
                let mut best: Option<(f64, u64, usize)> = None;
                let mut bits = candidates;
                while bits != 0 {
                    let i = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    if !self.under(i, bound) {
                        continue;
                    }
                    let Some(w) = self.worker(i) else { continue };
                    let cached = cached_on(i);
                    let pooled = (in_pool[i] as usize * bt).min(cached);
                    let fetched = fetchable(i).map_or(0, |f| f.tokens);
                    let cost = (input.prompt_tokens - cached - fetched) as f64 * prefill_weight
                        + (cached - pooled) as f64 * prefill_weight * disk_weight
                        + fetched as f64 * prefill_weight * fetch_weight
                        + (w.inflight_prefill_tokens + w.remote_prefill_tokens) as f64
                        + (w.decoding + w.remote_decoding) as f64 * decode_weight;
                    let tie = self.next_rand();
                    if best.is_none_or(|(c, t, _)| (cost, tie) < (c, t)) {
                        best = Some((cost, tie, i));
                    }
                }
                match best {
                    Some((_, _, w)) => decide(w, if matched[w] > 0 { Reason::Hit } else { Reason::Miss }),
                    None => decide(self.least_outstanding(candidates)?, Reason::Overflow),
                }
            }
        };
        if spilled {
            d.reason = Reason::Spill;
        }
        if let Some(s) = input.session {
            self.affinity
                .insert(s.to_string(), (d.worker, now + self.cfg.affinity_ttl));
        }
        Some(self.finish(d, input, now))
    }

    /// Peer fetch's source: the `kv_peer` among `usable` holding the longest run of the
    /// prompt's blocks in its pool (not its disk tier: peers export from the pool only), in
    /// tokens; among equal runs the least loaded, so that no one holder serves every export.
    fn fetch_holder(&self, in_pool: &[u32; MAX_WORKERS], usable: u64) -> Option<(usize, usize)> {
        if self.cfg.fetch_min_tokens == 0 {
            return None;
        }
        let mut best: Option<(u32, std::cmp::Reverse<u32>, usize)> = None;
        let mut bits = usable;
        while bits != 0 {
            let i = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if in_pool[i] == 0 || best.is_some_and(|b| in_pool[i] < b.0) {
                continue;
            }
            // Only a worker whose events the index follows: an assumed entry may be wrong.
            let Some(w) = self.worker(i).filter(|w| w.kv_peer && w.exact_events) else {
                continue;
            };
            let key = (in_pool[i], std::cmp::Reverse(w.load()), i);
            if best.is_none_or(|b| (key.0, key.1) > (b.0, b.1)) {
                best = Some(key);
            }
        }
        best.map(|(n, _, i)| (i, n as usize * self.cfg.block_tokens))
    }

    fn finish(&mut self, d: Decision, input: &RouteInput<'_>, now: u64) -> Decision {
        *self.decisions.entry((self.cfg.policy.name(), d.reason)).or_default() += 1;
        if let (Some(_), Some(w)) = (d.fetch, self.worker_mut(d.worker)) {
            w.fetches += 1;
            self.fetches += 1;
        }
        if self.worker(d.worker).is_some_and(|w| !w.exact_events) {
            self.index.assume(d.worker, input.hashes, now, self.cfg.approx_ttl);
        }
        d
    }

    /// Pins `session` to `slot` (another gateway's decision, shared through Redis): the next
    /// [`Router::route`] for it goes there while the worker is usable and under its bound.
    pub fn pin(&mut self, session: &str, slot: usize, now: u64) {
        if self.worker(slot).is_some() {
            self.affinity
                .insert(session.to_string(), (slot, now + self.cfg.affinity_ttl));
        }
    }

    /// The slot of the worker named `name`.
    pub fn slot_of(&self, name: &str) -> Option<usize> {
        self.workers().find(|(_, w)| w.name == name).map(|(i, _)| i)
    }

    /// Load accounting: a request was sent (`uncached` prompt tokens to compute).
    pub fn on_dispatch(&mut self, slot: usize, uncached: usize) {
        if let Some(w) = self.worker_mut(slot) {
            w.outstanding += 1;
            w.inflight_prefill_tokens += uncached as u64;
        }
    }

    /// The request's first token arrived: its prefill is done, it decodes now.
    pub fn on_first_token(&mut self, slot: usize, uncached: usize) {
        if let Some(w) = self.worker_mut(slot) {
            w.inflight_prefill_tokens = w.inflight_prefill_tokens.saturating_sub(uncached as u64);
            w.decoding += 1;
        }
    }

    /// The request ended (`started`: whether it got past prefill).
    pub fn on_finish(&mut self, slot: usize, uncached: usize, started: bool) {
        if let Some(w) = self.worker_mut(slot) {
            w.outstanding = w.outstanding.saturating_sub(1);
            if started {
                w.decoding = w.decoding.saturating_sub(1);
            } else {
                w.inflight_prefill_tokens = w.inflight_prefill_tokens.saturating_sub(uncached as u64);
            }
        }
    }

    /// A request on `slot` reported its usage: counts its prompt and cached tokens.
    pub fn on_usage(&mut self, slot: usize, prompt_tokens: u32, cached_tokens: u32) {
        if let Some(w) = self.worker_mut(slot) {
            w.prompt_tokens += u64::from(prompt_tokens);
            w.cached_tokens += u64::from(cached_tokens.min(prompt_tokens));
        }
    }

    /// Drops expired affinity and approximate index entries.
    pub fn sweep(&mut self, now: u64) {
        self.affinity.retain(|_, (_, exp)| *exp >= now);
        self.index.sweep(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router(policy: &str, n: usize) -> Router {
        let mut r = Router::new(RouterConfig {
            policy: Policy::parse(policy).unwrap(),
            ..Default::default()
        });
        for i in 0..n {
            r.add_worker(&format!("w{i}"), "local", true);
        }
        r
    }

    #[test]
    fn policies_display_for_people() {
        assert_eq!(
            Policy::parse("kv_aware").unwrap().to_string(),
            "kv_aware (prefill ×1, decode ×8, disk hit ×0.05, peer fetch ×0.1)"
        );
        assert_eq!(Policy::parse("random").unwrap().to_string(), "random");
        assert!(!Policy::parse("prefix_aware").unwrap().to_string().contains('{'));
    }

    fn input<'a>(hashes: &'a [BlockHash], session: Option<&'a str>) -> RouteInput<'a> {
        RouteInput {
            hashes,
            prompt_tokens: hashes.len() * 16 + 5,
            prefix_key: 7,
            session,
            region: None,
            exclude: 0,
            fetch: true,
            adapter: None,
        }
    }

    #[test]
    fn kv_aware_follows_the_cache_but_never_past_the_bound() {
        let mut r = router("kv_aware", 4);
        let hashes: Vec<BlockHash> = (0..10).map(BlockHash).collect();
        r.index.stored(2, &hashes);
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_eq!((d.worker, d.reason, d.expected_cached_tokens), (2, Reason::Hit, 160));
        // Worker 2 becomes overloaded: the hit no longer wins.
        r.worker_mut(2).unwrap().outstanding = 50;
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_ne!(d.worker, 2);
        assert_eq!(d.reason, Reason::Miss);
    }

    #[test]
    fn a_disk_hit_costs_a_share_of_recomputing() {
        use hearth_protocol::Tier;
        let mut r = router("kv_aware", 3);
        let hashes: Vec<BlockHash> = (0..10).map(BlockHash).collect();
        r.index.stored_in(1, &hashes, Tier::Disk);
        r.index.stored_in(2, &hashes, Tier::Device);
        // The pool hit wins over the disk hit.
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_eq!((d.worker, d.expected_cached_tokens), (2, 160));
        // With three sequences decoding there (24 tokens of cost), the disk hit (160 × 0.05)
        // wins; it never loses to recomputing the prompt on worker 0.
        r.worker_mut(2).unwrap().decoding = 3;
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_eq!((d.worker, d.reason, d.expected_cached_tokens), (1, Reason::Hit, 160));
        // A block in both tiers counts once, as pooled; removing it from the pool leaves it
        // on disk.
        r.index.stored_in(1, &hashes, Tier::Device);
        assert_eq!(r.index.worker_disk_blocks(1), 10);
        r.index.removed_from(1, &hashes, Tier::Device);
        assert_eq!((r.index.worker_blocks(1), r.index.worker_disk_blocks(1)), (0, 10));
        r.index.removed_from(1, &hashes, Tier::Disk);
        assert_eq!(r.index.worker_disk_blocks(1), 0);
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_ne!(d.worker, 1);
    }

    #[test]
    fn a_worker_lacking_a_peers_prefix_fetches_it() {
        let mut r = router("kv_aware", 3);
        let hashes: Vec<BlockHash> = (0..10).map(BlockHash).collect();
        r.index.stored(1, &hashes);
        // Peers must be reachable for KV (the gateway's token): until then, no fetch.
        r.worker_mut(1).unwrap().outstanding = 50;
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_ne!(d.worker, 1);
        assert_eq!((d.reason, d.fetch, d.expected_cached_tokens), (Reason::Miss, None, 0));
        for w in 0..3 {
            r.worker_mut(w).unwrap().kv_peer = true;
        }
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_ne!(d.worker, 1);
        let fetch = Fetch {
            from: 1,
            held_tokens: 160,
            tokens: 160,
        };
        assert_eq!(
            (d.reason, d.fetch, d.expected_cached_tokens),
            (Reason::Miss, Some(fetch), 160)
        );
        assert_eq!((r.fetches, r.worker(d.worker).unwrap().fetches), (1, 1));
        // Not for the halves of a disaggregated request (they move the blocks themselves).
        let d = r
            .route(
                &RouteInput {
                    fetch: false,
                    adapter: None,
                    ..input(&hashes, None)
                },
                0,
            )
            .unwrap();
        assert_eq!((d.fetch, d.expected_cached_tokens, r.fetches), (None, 0, 1));
        // A worker holding part of the prefix is asked only for the rest; the peer is
        // still asked for its whole run (the receiver skips what it holds).
        r.index.stored(0, &hashes[..4]);
        r.index.stored(2, &hashes[..4]);
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_eq!(
            (d.fetch, d.expected_cached_tokens),
            (Some(Fetch { tokens: 96, ..fetch }), 160)
        );
        r.index.removed(0, &hashes[..4]);
        r.index.removed(2, &hashes[..4]);
        // The holder under its bound keeps the request (nothing to fetch there).
        r.worker_mut(1).unwrap().outstanding = 0;
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_eq!((d.worker, d.reason, d.fetch), (1, Reason::Hit, None));
        // A worker holding all but one block: the rest (16 tokens) is below the break-even.
        r.worker_mut(1).unwrap().outstanding = 50;
        r.index.stored(0, &hashes[..9]);
        r.worker_mut(2).unwrap().outstanding = 50;
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_eq!(
            (d.worker, d.reason, d.fetch, d.expected_cached_tokens),
            (0, Reason::Hit, None, 144)
        );
        // Off: never.
        r.cfg.fetch_min_tokens = 0;
        r.worker_mut(2).unwrap().outstanding = 0;
        r.worker_mut(0).unwrap().outstanding = 50;
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_eq!((d.worker, d.fetch), (2, None));
    }

    #[test]
    fn fetch_follows_any_policy_and_kv_aware_counts_its_cost() {
        // Random placement: wherever the request lands without the prefix, it fetches.
        let mut r = router("random", 2);
        let hashes: Vec<BlockHash> = (0..10).map(BlockHash).collect();
        r.index.stored(0, &hashes);
        r.worker_mut(0).unwrap().kv_peer = true;
        let mut fetched = 0;
        for _ in 0..32 {
            let d = r.route(&input(&hashes, None), 0).unwrap();
            match d.worker {
                0 => assert_eq!(d.fetch, None),
                _ => {
                    let f = d.fetch.unwrap();
                    assert_eq!((f.from, f.tokens, d.reason), (0, 160, Reason::Random));
                    fetched += 1;
                }
            }
        }
        assert!(fetched > 0);
        // kv_aware: three decoding sequences on the holder (24) outweigh a fetch of 160
        // tokens (160 × 0.1 = 16), not a recompute (165).
        let mut r = router("kv_aware", 2);
        r.index.stored(0, &hashes);
        r.worker_mut(0).unwrap().kv_peer = true;
        r.worker_mut(0).unwrap().decoding = 3;
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_eq!((d.worker, d.fetch.map(|f| f.from)), (1, Some(0)));
        r.worker_mut(0).unwrap().kv_peer = false;
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_eq!((d.worker, d.fetch), (0, None));
    }

    #[test]
    fn equal_holders_share_the_exports_by_load() {
        let mut r = router("kv_aware", 3);
        let hashes: Vec<BlockHash> = (0..10).map(BlockHash).collect();
        for w in 0..3 {
            r.worker_mut(w).unwrap().kv_peer = true;
        }
        r.index.stored(0, &hashes);
        r.index.stored(1, &hashes);
        // Both over the load bound; the less loaded one sends.
        r.worker_mut(0).unwrap().outstanding = 40;
        r.worker_mut(1).unwrap().outstanding = 35;
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_eq!((d.worker, d.fetch.map(|f| f.from)), (2, Some(1)));
        r.worker_mut(1).unwrap().outstanding = 45;
        let d = r.route(&input(&hashes, None), 0).unwrap();
        assert_eq!((d.worker, d.fetch.map(|f| f.from)), (2, Some(0)));
    }

    #[test]
    fn affinity_holds_and_breaks_only_on_overload() {
        let mut r = router("least_outstanding", 3);
        let first = r.route(&input(&[], Some("s1")), 0).unwrap().worker;
        r.on_dispatch(first, 10);
        for _ in 0..3 {
            let d = r.route(&input(&[], Some("s1")), 1).unwrap();
            assert_eq!((d.worker, d.reason), (first, Reason::Affinity));
        }
        r.worker_mut(first).unwrap().outstanding = 100;
        let d = r.route(&input(&[], Some("s1")), 2).unwrap();
        assert_ne!(d.worker, first);
        // The session now sticks to its new worker.
        r.worker_mut(first).unwrap().outstanding = 0;
        assert_eq!(r.route(&input(&[], Some("s1")), 3).unwrap().worker, d.worker);
        // Entries expire.
        assert_ne!(
            r.route(&input(&[], Some("s1")), 10_000_000).unwrap().reason,
            Reason::Affinity
        );
    }

    #[test]
    fn other_gateways_load_counts_and_their_pins_hold() {
        let mut r = router("least_outstanding", 2);
        // Another gateway keeps worker 0 busy: this one's own counts are equal, yet it
        // sends new work to worker 1.
        r.worker_mut(0).unwrap().remote_outstanding = 20;
        for t in 0..3 {
            assert_eq!(r.route(&input(&[], None), t).unwrap().worker, 1);
        }
        // A session another gateway pinned to worker 0 stays there once worker 0 is under
        // the bound again.
        r.worker_mut(0).unwrap().remote_outstanding = 0;
        r.pin("s", 0, 5);
        let d = r.route(&input(&[], Some("s")), 6).unwrap();
        assert_eq!((d.worker, d.reason), (0, Reason::Affinity));
        // Slots are reused with a new serial; names find them.
        let serial = r.worker(0).unwrap().serial;
        r.remove_worker(0);
        assert_eq!(r.add_worker("w9", "local", true), Some(0));
        assert_ne!(r.worker(0).unwrap().serial, serial);
        assert_eq!((r.slot_of("w9"), r.slot_of("w0")), (Some(0), None));
    }

    #[test]
    fn workers_with_the_adapter_loaded_are_preferred_within_the_bound() {
        for policy in ["kv_aware", "least_outstanding", "prefix_aware", "random"] {
            let mut r = router(policy, 3);
            r.worker_mut(2).unwrap().adapters = vec!["d1".into(), "d2".into()];
            // The least loaded worker lacks the adapter: the warm one is chosen anyway.
            r.worker_mut(2).unwrap().outstanding = 2;
            let warm = RouteInput {
                adapter: Some("d2"),
                ..input(&[], None)
            };
            for t in 0..5 {
                assert_eq!(r.route(&warm, t).unwrap().worker, 2, "{policy}");
            }
            // An adapter nobody has loaded: the usual choice (the least loaded).
            if matches!(policy, "kv_aware" | "least_outstanding") {
                let cold = RouteInput {
                    adapter: Some("d3"),
                    ..input(&[], None)
                };
                assert_ne!(r.route(&cold, 5).unwrap().worker, 2, "{policy}");
            }
            // Over the load bound, the warm worker yields.
            r.worker_mut(2).unwrap().outstanding = 50;
            assert_ne!(r.route(&warm, 6).unwrap().worker, 2, "{policy}");
        }
    }

    #[test]
    fn prefix_keys_separate_and_overflow() {
        let mut r = router("prefix_aware", 5);
        let a = RouteInput {
            hashes: &[],
            prompt_tokens: 10,
            prefix_key: 1,
            session: None,
            region: None,
            exclude: 0,
            fetch: true,
            adapter: None,
        };
        let w = r.route(&a, 0).unwrap().worker;
        assert_eq!(r.route(&a, 0).unwrap().worker, w, "same key, same worker");
        let spread: std::collections::HashSet<usize> = (0..200u64)
            .map(|k| {
                r.route(
                    &RouteInput {
                        prefix_key: xxhash_rust::xxh3::xxh3_64(&k.to_le_bytes()),
                        ..a
                    },
                    0,
                )
                .unwrap()
                .worker
            })
            .collect();
        assert!(spread.len() >= 4, "keys spread over the workers: {spread:?}");
        r.worker_mut(w).unwrap().outstanding = 40; // past concurrency_threshold (32)
        let d = r.route(&a, 0).unwrap();
        assert_ne!(d.worker, w);
    }

    #[test]
    fn regions_are_preferred_and_spill_when_full() {
        let mut r = Router::new(RouterConfig {
            policy: Policy::LeastOutstanding,
            home_region: "eu".into(),
            ..Default::default()
        });
        let eu = r.add_worker("eu-1", "eu", true).unwrap();
        let us = r.add_worker("us-1", "us", true).unwrap();
        assert_eq!(r.route(&input(&[], None), 0).unwrap().worker, eu);
        let d = r
            .route(
                &RouteInput {
                    region: Some("us"),
                    ..input(&[], None)
                },
                0,
            )
            .unwrap();
        assert_eq!(d.worker, us);
        r.worker_mut(eu).unwrap().outstanding = 10;
        let d = r.route(&input(&[], None), 0).unwrap();
        assert_eq!((d.worker, d.reason), (us, Reason::Spill));
        r.worker_mut(us).unwrap().healthy = false;
        assert_eq!(
            r.route(&input(&[], None), 0).unwrap().worker,
            eu,
            "an unhealthy worker is never chosen"
        );
    }

    #[test]
    fn tenant_namespaces_separate_equal_prefixes() {
        use hearth_protocol::{block_hashes, cache_namespace, namespace_root};
        let mut r = router("kv_aware", 3);
        let prompt: Vec<u32> = (0..160).collect();
        let a = block_hashes(namespace_root("m", &cache_namespace("tenant-a", None)), &prompt, 16);
        let b = block_hashes(namespace_root("m", &cache_namespace("tenant-b", None)), &prompt, 16);
        r.index.stored(1, &a);
        assert_eq!(r.route(&input(&a, None), 0).unwrap().reason, Reason::Hit);
        let d = r.route(&input(&b, None), 0).unwrap();
        assert_eq!(
            (d.reason, d.expected_cached_tokens),
            (Reason::Miss, 0),
            "tenant b must not see tenant a's blocks"
        );
    }

    #[test]
    fn approximate_mode_remembers_its_own_decisions() {
        let mut r = Router::new(RouterConfig {
            approx_ttl: 100,
            ..Default::default()
        });
        for i in 0..3 {
            r.add_worker(&format!("w{i}"), "local", false);
        }
        let hashes: Vec<BlockHash> = (0..5).map(BlockHash).collect();
        let first = r.route(&input(&hashes, None), 0).unwrap().worker;
        let d = r.route(&input(&hashes, None), 50).unwrap();
        assert_eq!((d.worker, d.reason), (first, Reason::Hit));
        // After the TTL the assumption is gone.
        assert_eq!(r.route(&input(&hashes, None), 1000).unwrap().reason, Reason::Miss);
    }
}
