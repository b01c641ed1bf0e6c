//! Quality of service: who a request is for, its priority class and its tenant's share,
//! and the queue-admission rule the gateway and the engine both apply, so that they agree
//! on what "full" means.
//!
//! A queue is measured in **prompt tokens not yet computed** (the engine's
//! `LoadReport::inflight_prefill_tokens`, the router's per-worker account of the same),
//! against a limit in tokens each worker reports (`WorkerInfo::queue_tokens`).

use serde::{Deserialize, Serialize};

/// Priority classes, highest first. Scheduling is strict between classes (with a bounded
/// wait for the lowest, see the engine's scheduler) and fair between tenants inside one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum Priority {
    /// Someone is waiting for the answer.
    #[default]
    Interactive,
    /// Throughput work: admitted after interactive work, shed first when the pool is full.
    Batch,
}

impl Priority {
    pub const ALL: [Priority; 2] = [Priority::Interactive, Priority::Batch];

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Batch => "batch",
        }
    }

    /// `interactive` or `batch`; OpenAI's `service_tier` names map onto them (`flex` is
    /// batch; `auto`, `default`, `scale` and `priority` are interactive).
    pub fn parse(s: &str) -> Option<Priority> {
        match s.trim().to_ascii_lowercase().as_str() {
            "interactive" | "auto" | "default" | "priority" | "scale" => Some(Priority::Interactive),
            "batch" | "flex" => Some(Priority::Batch),
            _ => None,
        }
    }

    /// The lower of the two: a request may lower its class, never raise it.
    pub fn lowered_by(self, asked: Option<Priority>) -> Priority {
        asked.map_or(self, |a| self.max(a))
    }

    fn is_interactive(&self) -> bool {
        *self == Priority::Interactive
    }
}

impl std::fmt::Display for Priority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who a request is for and how it is scheduled, as the gateway sends it to a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Qos {
    /// The tenant (its id); requests of one tenant share one fairness account. Empty: an
    /// anonymous account shared by every request that names none.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub tenant: String,
    #[serde(skip_serializing_if = "Priority::is_interactive")]
    pub priority: Priority,
    /// The tenant's weight: with shares 3 and 1, two backlogged tenants get 3/4 and 1/4 of
    /// a saturated worker's weighted tokens.
    #[serde(skip_serializing_if = "is_one")]
    pub share: u32,
}

impl Default for Qos {
    fn default() -> Self {
        Self {
            tenant: String::new(),
            priority: Priority::Interactive,
            share: 1,
        }
    }
}

fn is_one(v: &u32) -> bool {
    *v == 1
}

/// At most this share of a queue may hold batch work: past it, batch requests are shed
/// while interactive ones are still queued.
pub const BATCH_QUEUE_FRACTION: f64 = 0.5;

/// The largest share a tenant may set.
pub const MAX_SHARE: u32 = 1000;

/// A queue's state when a request arrives, in prompt tokens not yet computed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueState {
    /// The limit (0: unbounded).
    pub limit: u64,
    /// Queued in total.
    pub queued: u64,
    /// Queued for the arriving request's tenant.
    pub tenant_queued: u64,
    /// Tenants with queued work, counting the arriving one.
    pub tenants: u64,
}

/// Why a queue refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shed {
    /// Tokens that must drain before the request would be admitted.
    pub excess: u64,
}

impl QueueState {
    /// Whether a request of `tokens` (at least 1) and `priority` may join the queue.
    ///
    /// - An empty queue (or no limit) takes any request.
    /// - Under its class's cap (the limit, or [`BATCH_QUEUE_FRACTION`] of it for batch
    ///   work), anything is admitted.
    /// - Past it, an interactive request is still admitted while its tenant holds less than
    ///   its fair part of the limit (limit ÷ tenants queued) and the queue is under twice the
    ///   limit: a flooding tenant fills the queue, then only it is shed.
    /// - Otherwise the request is shed; `excess` says how much must drain first.
    pub fn admit(&self, priority: Priority, tokens: u64) -> Result<(), Shed> {
        // Unbounded, or nothing queued: a request larger than the limit still runs alone.
        if self.limit == 0 || self.queued == 0 {
            return Ok(());
        }
        let tokens = tokens.max(1);
        let cap = match priority {
            Priority::Interactive => self.limit,
            Priority::Batch => ((self.limit as f64 * BATCH_QUEUE_FRACTION) as u64).max(1),
        };
        let after = self.queued.saturating_add(tokens);
        if after <= cap {
            return Ok(());
        }
        if priority == Priority::Interactive {
            let fair = self.limit / self.tenants.max(1);
            if self.tenant_queued.saturating_add(tokens) <= fair && after <= self.limit.saturating_mul(2) {
                return Ok(());
            }
        }
        Err(Shed { excess: after - cap })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_lower_never_raise() {
        assert_eq!(Priority::Interactive.lowered_by(Some(Priority::Batch)), Priority::Batch);
        assert_eq!(Priority::Batch.lowered_by(Some(Priority::Interactive)), Priority::Batch);
        assert_eq!(Priority::Batch.lowered_by(None), Priority::Batch);
        assert_eq!(Priority::parse("flex"), Some(Priority::Batch));
        assert_eq!(Priority::parse("Interactive"), Some(Priority::Interactive));
        assert_eq!(Priority::parse("urgent"), None);
    }

    #[test]
    fn batch_is_shed_first_and_a_flooder_before_its_victims() {
        let q = |queued, tenant_queued, tenants| QueueState {
            limit: 1000,
            queued,
            tenant_queued,
            tenants,
        };
        assert!(q(0, 0, 1).admit(Priority::Batch, 400).is_ok());
        // Past half the queue, batch is shed while interactive is still admitted.
        assert_eq!(q(400, 400, 1).admit(Priority::Batch, 200), Err(Shed { excess: 100 }));
        assert!(q(400, 400, 1).admit(Priority::Interactive, 200).is_ok());
        // Full: the flooder holding it all is shed, a newcomer under its part is not.
        assert!(q(1000, 1000, 2).admit(Priority::Interactive, 100).is_err());
        assert!(q(1000, 0, 2).admit(Priority::Interactive, 100).is_ok());
        // …but never past twice the limit.
        assert!(q(1950, 0, 2).admit(Priority::Interactive, 100).is_err());
        // Unbounded; and an empty queue takes anything.
        assert!(QueueState::default().admit(Priority::Batch, u64::MAX / 4).is_ok());
        assert!(q(0, 0, 1).admit(Priority::Batch, 5000).is_ok());
    }

    #[test]
    fn qos_serializes_compactly_and_defaults() {
        let q: Qos = serde_json::from_str("{}").unwrap();
        assert_eq!(q, Qos::default());
        assert_eq!(serde_json::to_string(&Qos::default()).unwrap(), "{}");
        let b = Qos {
            tenant: "t".into(),
            priority: Priority::Batch,
            share: 3,
        };
        let back: Qos = serde_json::from_str(&serde_json::to_string(&b).unwrap()).unwrap();
        assert_eq!(back, b);
    }
}
