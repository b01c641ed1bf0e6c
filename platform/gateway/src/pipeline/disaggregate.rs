//! Prefill/decode disaggregation, between [`dispatch`](super::dispatch) and the
//! [`relay`](super::relay): a long prompt is computed on a prefill worker, which sends the
//! first token and holds the prompt's KV blocks; a decode worker fetches the blocks it
//! lacks straight from it (worker to worker, never through the gateway) and continues
//! after that token. The two workers' events are stitched here into the one stream the
//! relay, the post-processors and the client see: the first token from prefill, the rest
//! from decode, one `Done` whose usage has the prompt's `prompt_tokens` and
//! `cached_tokens` from the prefill side and the completion's tokens from the decode side.
//!
//! Failures never lose the request:
//! - the prefill worker fails before its first token: the whole request is sent to one
//!   worker (colocated), as dispatch would have;
//! - it fails after the first token, or the decode worker fails (unreachable, or an error
//!   before its first event): one worker continues after the first token, computing the
//!   prompt itself (no transfer);
//! - a broken transfer is the decode worker's business: it computes what did not arrive;
//! - a failure after the decode worker's first event ends the stream with its error, as a
//!   colocated request's would.

use std::sync::Arc;

use futures_util::StreamExt;
use hearth_protocol::{FinishReason, GenerateEvent, GenerateRequest, KvSource, Usage};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use super::dispatch::{self, mark_unhealthy, Dispatched};
use super::route::{PdPlacement, Placement, RouteRequest};
use crate::registry::{PdCounts, ServedModel};
use crate::workers::{EventStream, WorkerClient, WorkerError};

/// What the caller gets back when disaggregation could not start: the request, and the
/// workers to leave out when serving it colocated.
pub type NotStarted = (GenerateRequest, RouteRequest, u64);

/// Sends the prefill half; once the prefill worker has taken it, a task stitches the rest.
pub async fn start(
    model: &Arc<ServedModel>,
    req: GenerateRequest,
    routed: RouteRequest,
    pd: PdPlacement,
) -> Result<Dispatched, NotStarted> {
    let (p_slot, d_slot) = (pd.prefill.slot, pd.decode.slot);
    let (Some(prefill), Some(decode)) = (model.client(p_slot).cloned(), model.client(d_slot).cloned()) else {
        return Err((req, routed, 0));
    };
    let Some(source) = prefill.kv_address() else {
        return Err((req, routed, 0));
    };
    let mut first_half = req.clone();
    first_half.prefill_only = true;
    let events = match prefill.generate(first_half).await {
        Ok(events) => events,
        Err(e) => {
            tracing::warn!(worker = prefill.name(), error = %e, "prefill worker unavailable; serving colocated");
            if matches!(e, WorkerError::Unavailable { .. }) {
                mark_unhealthy(model, p_slot);
            }
            PdCounts::count(&model.pd.retried_colocated);
            return Err((req, routed, 1 << p_slot));
        }
    };
    tracing::debug!(prefill = prefill.name(), decode = decode.name(), "disaggregated");
    let (tx, rx) = mpsc::channel(64);
    let stitch = Stitch {
        model: model.clone(),
        req,
        routed,
        source,
        prefill: prefill.clone(),
        tx,
    };
    let span = tracing::info_span!("disaggregate", prefill = prefill.name(), decode = decode.name());
    tokio::spawn(stitch.run(events, pd.prefill, pd.decode).instrument(span));
    Ok(Dispatched {
        events: ReceiverStream::new(rx).boxed(),
        placement: None,
    })
}

struct Stitch {
    model: Arc<ServedModel>,
    req: GenerateRequest,
    routed: RouteRequest,
    /// Where the decode worker fetches the blocks (the prefill worker's address).
    source: String,
    prefill: Arc<dyn WorkerClient>,
    tx: mpsc::Sender<GenerateEvent>,
}

/// How forwarding one worker's stream ended.
enum Forwarded {
    /// Its `Done` went out.
    Done,
    /// It failed before sending anything (its error code and message): nothing reached the
    /// client, a retry is safe.
    FailedEarly(String, String),
    /// It failed after sending events (the client got its error).
    Failed,
    /// The client went away (the worker's stream is dropped: its generation is cancelled).
    Gone,
}

impl Stitch {
    /// The next event, or None when the client has gone (dropping the worker's stream then
    /// cancels its generation).
    async fn next(&self, events: &mut EventStream) -> Option<Option<GenerateEvent>> {
        tokio::select! {
            ev = events.next() => Some(ev),
            () = self.tx.closed() => None,
        }
    }

    /// The prefill worker need not keep the prompt's blocks any longer.
    fn release_hold(&self) {
        let (prefill, hold) = (self.prefill.clone(), self.req.request_id.clone());
        tokio::spawn(async move { prefill.release_hold(&hold).await });
    }

    async fn run(self, mut events: EventStream, mut prefill: Placement, decode: Placement) {
        let mut first = None;
        let mut handed_off = None;
        // The prefill half: the first token, then `Handoff`.
        loop {
            let Some(ev) = self.next(&mut events).await else { return };
            match ev {
                Some(GenerateEvent::Token { id, .. }) if first.is_some() => {
                    // A prefill worker sends one token; anything else is a broken stream.
                    tracing::warn!(token = id, "the prefill worker sent a second token");
                    break;
                }
                Some(ev @ GenerateEvent::Token { .. }) => {
                    if let GenerateEvent::Token { id, .. } = &ev {
                        first = Some(*id);
                    }
                    prefill.first_token();
                    if self.tx.send(ev).await.is_err() {
                        return;
                    }
                }
                Some(GenerateEvent::Finish {
                    finish_reason: FinishReason::Handoff,
                    ..
                }) => {}
                Some(GenerateEvent::Done {
                    finish_reason: FinishReason::Handoff,
                    usage,
                    ..
                }) => {
                    handed_off = Some(usage);
                    break;
                }
                Some(ev @ GenerateEvent::Finish { .. }) => {
                    if self.tx.send(ev).await.is_err() {
                        return;
                    }
                }
                Some(ev @ GenerateEvent::Done { .. }) => {
                    // Finished at its first token: nothing for a decode worker.
                    PdCounts::count(&self.model.pd.prefill_only);
                    let _ = self.tx.send(ev).await;
                    return;
                }
                Some(GenerateEvent::Error { code, message }) => {
                    tracing::warn!(code = %code, message = %message, "the prefill worker failed");
                    break;
                }
                None => {
                    tracing::warn!("the prefill worker's stream ended early");
                    break;
                }
            }
        }
        drop(events);
        let p_slot = prefill.slot;
        drop(prefill);
        let Some(first) = first else {
            // Nothing was sent: the whole request goes to one worker.
            drop(decode);
            PdCounts::count(&self.model.pd.retried_colocated);
            self.colocated(Vec::new(), None, 1 << p_slot).await;
            return;
        };
        if self.tx.is_closed() {
            if handed_off.is_some() {
                self.release_hold();
            }
            return;
        }
        // The decode half: after the first token, with the blocks from the prefill worker.
        let d_slot = decode.slot;
        let mut rest = self.req.clone();
        rest.resume = vec![first];
        if handed_off.is_some() {
            rest.kv_source = Some(KvSource {
                worker: self.source.clone(),
                hold: self.req.request_id.clone(),
            });
        }
        let sent = match self.model.client(d_slot).cloned() {
            Some(client) => {
                tokio::select! {
                    r = client.generate(rest) => r.map_err(|e| {
                        if matches!(e, WorkerError::Unavailable { .. }) {
                            mark_unhealthy(&self.model, d_slot);
                        }
                        e.to_string()
                    }),
                    () = self.tx.closed() => {
                        if handed_off.is_some() {
                            self.release_hold();
                        }
                        return;
                    }
                }
            }
            None => Err("the decode worker was removed".into()),
        };
        let why = match sent {
            Ok(events) => match self.forward(events, handed_off, Some(decode)).await {
                Forwarded::Done => {
                    // Without a handoff the decode worker computed the prompt itself.
                    let outcome = if handed_off.is_some() {
                        &self.model.pd.disaggregated
                    } else {
                        &self.model.pd.retried_colocated
                    };
                    PdCounts::count(outcome);
                    return;
                }
                Forwarded::Failed => {
                    PdCounts::count(&self.model.pd.failed);
                    return;
                }
                Forwarded::Gone => return,
                Forwarded::FailedEarly(code, message) => format!("{code}: {message}"),
            },
            Err(e) => {
                drop(decode);
                e
            }
        };
        tracing::warn!(error = %why, "the decode worker failed before its first token; continuing on one worker");
        if handed_off.is_some() {
            self.release_hold();
        }
        PdCounts::count(&self.model.pd.retried_colocated);
        self.colocated(vec![first], handed_off, 1 << d_slot).await;
    }

    /// Serves the request (after `resume`, the tokens already sent) on one worker not in
    /// `exclude`, which computes the prompt itself.
    async fn colocated(&self, resume: Vec<u32>, prompt_usage: Option<Usage>, exclude: u64) {
        let mut req = self.req.clone();
        req.resume = resume;
        let (code, message) = match dispatch::colocated(&self.model, &req, &self.routed, exclude).await {
            Ok(d) => match self.forward(d.events, prompt_usage, d.placement).await {
                Forwarded::FailedEarly(code, message) => (code, message),
                Forwarded::Failed => {
                    PdCounts::count(&self.model.pd.failed);
                    return;
                }
                Forwarded::Done | Forwarded::Gone => return,
            },
            Err(e) => ("worker_unavailable".to_string(), e.message),
        };
        // The worker's own code, so that the client gets the status it would have colocated.
        let _ = self.tx.send(GenerateEvent::Error { code, message }).await;
    }

    /// Passes one worker's events on; its `Done` gets the prompt's usage from the prefill
    /// side, when there was one.
    async fn forward(
        &self,
        mut events: EventStream,
        prompt_usage: Option<Usage>,
        mut place: Option<Placement>,
    ) -> Forwarded {
        let mut sent = false;
        loop {
            let Some(ev) = self.next(&mut events).await else {
                return Forwarded::Gone;
            };
            let ev = match ev {
                Some(GenerateEvent::Error { code, message }) if !sent => {
                    return Forwarded::FailedEarly(code, message);
                }
                None if !sent => {
                    return Forwarded::FailedEarly(
                        "worker_disconnected".into(),
                        "the worker ended the stream before any event".into(),
                    )
                }
                // The relay reports a stream cut short.
                None => return Forwarded::Failed,
                Some(ev) => ev,
            };
            if let (GenerateEvent::Token { .. }, Some(p)) = (&ev, place.as_mut()) {
                p.first_token();
            }
            let ev = match (ev, prompt_usage) {
                (
                    GenerateEvent::Done {
                        finish_reason,
                        mut usage,
                        timings,
                    },
                    Some(p),
                ) => {
                    usage.prompt_tokens = p.prompt_tokens;
                    usage.cached_tokens = p.cached_tokens;
                    GenerateEvent::Done {
                        finish_reason,
                        usage,
                        timings,
                    }
                }
                (ev, _) => ev,
            };
            let end = match &ev {
                GenerateEvent::Done { .. } => Some(Forwarded::Done),
                GenerateEvent::Error { .. } => Some(Forwarded::Failed),
                _ => None,
            };
            sent = true;
            if self.tx.send(ev).await.is_err() {
                return Forwarded::Gone;
            }
            if let Some(end) = end {
                return end;
            }
        }
    }
}
