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
use crate::upstream::registry::{PdCounts, ServedModel};
use crate::upstream::workers::{EventStream, WorkerClient, WorkerError};

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
    let (Some(prefill), Some(decode)) = (model.client(p_slot), model.client(d_slot)) else {
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
                mark_unhealthy(model, p_slot, &prefill);
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
        decode: decode.clone(),
        tx,
    };
    let span = tracing::info_span!("disaggregate", prefill = prefill.name(), decode = decode.name());
    tokio::spawn(stitch.run(events, pd.prefill, pd.decode).instrument(span));
    Ok(Dispatched {
        events: ReceiverStream::new(rx).boxed(),
        placement: None,
        failover: None,
    })
}

struct Stitch {
    model: Arc<ServedModel>,
    req: GenerateRequest,
    routed: RouteRequest,
    /// Where the decode worker fetches the blocks (the prefill worker's address).
    source: String,
    prefill: Arc<dyn WorkerClient>,
    /// The decode worker placed (held here: its slot may change hands meanwhile).
    decode: Arc<dyn WorkerClient>,
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
                tokens: 0,
            });
        }
        let client = self.decode.clone();
        let sent = tokio::select! {
            r = client.generate(rest) => r.map_err(|e| {
                if matches!(e, WorkerError::Unavailable { .. }) {
                    mark_unhealthy(&self.model, d_slot, &client);
                }
                e.to_string()
            }),
            () = self.tx.closed() => {
                if handed_off.is_some() {
                    self.release_hold();
                }
                return;
            }
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

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Mutex;
    use std::time::Duration;

    use futures_util::future::BoxFuture;
    use futures_util::FutureExt;
    use hearth_protocol::{SamplingParams, WorkerInfo};

    use super::*;
    use crate::pipeline::route::tests::Stateful;
    use crate::pipeline::route::{self, RouteHints};
    use crate::upstream::registry::{ModelRegistry, RoutingConfig};
    use crate::upstream::workers::KvEventStream;

    /// A worker answering each `generate` with the next scripted stream (or refusal), and
    /// recording the requests it got and the holds it was asked to release.
    struct Scripted {
        info: Stateful,
        script: Mutex<VecDeque<Result<Vec<GenerateEvent>, ()>>>,
        got: Mutex<Vec<GenerateRequest>>,
        released: Mutex<Vec<String>>,
    }

    impl WorkerClient for Scripted {
        fn name(&self) -> &str {
            &self.info.name
        }
        fn info(&self) -> BoxFuture<'_, Result<WorkerInfo, WorkerError>> {
            self.info.info()
        }
        fn generate(&self, req: GenerateRequest) -> BoxFuture<'_, Result<EventStream, WorkerError>> {
            self.got.lock().unwrap().push(req);
            let next = self.script.lock().unwrap().pop_front().unwrap_or(Err(()));
            async move {
                next.map(|evs| futures_util::stream::iter(evs).boxed())
                    .map_err(|()| WorkerError::Unavailable {
                        worker: self.info.name.clone(),
                        detail: "scripted".into(),
                    })
            }
            .boxed()
        }
        fn kv_events(&self) -> BoxFuture<'_, Result<KvEventStream, WorkerError>> {
            async move { Ok(futures_util::stream::pending().boxed()) }.boxed()
        }
        fn health(&self) -> BoxFuture<'_, Result<(), WorkerError>> {
            async move { Ok(()) }.boxed()
        }
        fn kv_address(&self) -> Option<String> {
            Some(self.info.name.clone())
        }
        fn release_hold(&self, hold: &str) -> BoxFuture<'_, ()> {
            self.released.lock().unwrap().push(hold.to_string());
            async {}.boxed()
        }
    }

    fn worker(name: &str, role: &'static str, script: Vec<Result<Vec<GenerateEvent>, ()>>) -> Arc<Scripted> {
        Arc::new(Scripted {
            info: Stateful {
                name: name.into(),
                state: Mutex::new(None),
                preloads: Default::default(),
                role,
            },
            script: Mutex::new(script.into()),
            got: Mutex::new(Vec::new()),
            released: Mutex::new(Vec::new()),
        })
    }

    fn token(id: u32) -> GenerateEvent {
        GenerateEvent::Token {
            index: 0,
            id,
            text: format!("t{id}"),
            logprob: None,
            top_logprobs: Vec::new(),
        }
    }

    fn done(reason: FinishReason, prompt: u32, cached: u32, completion: u32) -> Vec<GenerateEvent> {
        vec![
            GenerateEvent::Finish {
                index: 0,
                finish_reason: reason,
            },
            GenerateEvent::Done {
                finish_reason: reason,
                usage: Usage {
                    prompt_tokens: prompt,
                    cached_tokens: cached,
                    completion_tokens: completion,
                },
                timings: Default::default(),
            },
        ]
    }

    /// Runs one request of 300 prompt tokens through `start` on (prefill, decode) workers.
    async fn stitched(prefill: &Arc<Scripted>, decode: &Arc<Scripted>) -> (Vec<GenerateEvent>, Arc<ServedModel>) {
        let clients: Vec<Arc<dyn WorkerClient>> = vec![prefill.clone(), decode.clone()];
        let reg = ModelRegistry::discover(clients, Duration::ZERO, &RoutingConfig::default())
            .await
            .unwrap();
        let model = reg.get("m").unwrap();
        let req = GenerateRequest {
            request_id: "req_1".into(),
            model: "m".into(),
            prompt: (0..300).map(|i| 17 + i % 200).collect(),
            sampling: SamplingParams {
                max_tokens: 3,
                ..Default::default()
            },
            cache_namespace: String::new(),
            n: 1,
            prefill_only: false,
            resume: Vec::new(),
            kv_source: None,
            qos: Default::default(),
            constraint: None,
            adapter: None,
        };
        let hints = RouteHints {
            session: None,
            region: None,
            prefix_key: 0,
            tenant: String::new(),
            pinned: None,
            shared: None,
            adapter: None,
        };
        let routed = RouteRequest::new(&model, &req.prompt, "", hints);
        let pd = route::run_pd(&model, &routed, 0).expect("a long prompt is disaggregated");
        let Ok(d) = start(&model, req, routed, pd).await else {
            panic!("the prefill half was taken")
        };
        let events = tokio::time::timeout(Duration::from_secs(10), d.events.collect::<Vec<_>>())
            .await
            .expect("the stitched stream ends");
        (events, model)
    }

    fn final_usage(events: &[GenerateEvent]) -> Usage {
        match events.last() {
            Some(GenerateEvent::Done { usage, .. }) => *usage,
            other => panic!("ends with {other:?}"),
        }
    }

    /// A worker whose own queue refuses (another gateway filled it) is skipped for the next;
    /// when every worker refuses, the client gets 503 `overloaded` with a `retry-after`. Either
    /// way the refused placements are released.
    #[tokio::test]
    async fn a_worker_refusing_for_a_full_queue_is_skipped() {
        let overloaded = || {
            Ok(vec![GenerateEvent::Error {
                code: "overloaded".into(),
                message: "full".into(),
            }])
        };
        let mut served = vec![token(5)];
        served.extend(done(FinishReason::Length, 10, 0, 1));
        let full = worker("full", "both", vec![overloaded(), overloaded()]);
        let open = worker("open", "both", vec![Ok(served), overloaded()]);
        let clients: Vec<Arc<dyn WorkerClient>> = vec![full.clone(), open.clone()];
        let reg = ModelRegistry::discover(clients, Duration::ZERO, &RoutingConfig::default())
            .await
            .unwrap();
        let model = reg.get("m").unwrap();
        let mut req = GenerateRequest {
            request_id: "req_1".into(),
            model: "m".into(),
            prompt: (17..27).collect(),
            sampling: SamplingParams::default(),
            cache_namespace: String::new(),
            n: 1,
            prefill_only: false,
            resume: Vec::new(),
            kv_source: None,
            qos: Default::default(),
            constraint: None,
            adapter: None,
        };
        req.qos.tenant = "t".into();
        let routed = |req: &GenerateRequest| {
            let hints = RouteHints {
                session: None,
                region: None,
                prefix_key: 0,
                tenant: "t".into(),
                pinned: None,
                shared: None,
                adapter: None,
            };
            RouteRequest::new(&model, &req.prompt, "", hints)
        };
        let Ok(d) = crate::pipeline::dispatch::colocated(&model, &req, &routed(&req), 0).await else {
            panic!("the open worker serves it")
        };
        let events: Vec<GenerateEvent> = d.events.collect().await;
        assert_eq!(events.first(), Some(&token(5)), "{events:?}");
        drop(d.placement);
        // Both refuse now.
        let e = crate::pipeline::dispatch::colocated(&model, &req, &routed(&req), 0)
            .await
            .err()
            .expect("every worker refused");
        assert_eq!((e.status.as_u16(), e.code), (503, Some("overloaded")));
        assert!(e.retry_after.is_some_and(|s| s >= 1));
        let r = model.router();
        assert!(r
            .workers()
            .all(|(_, w)| w.outstanding == 0 && w.inflight_prefill_tokens == 0));
        drop(r);
        assert_eq!(model.queues.tenant("t"), (0, 0));
    }

    #[tokio::test]
    async fn the_first_token_from_prefill_the_rest_from_decode_one_usage() {
        let mut head = vec![token(5)];
        head.extend(done(FinishReason::Handoff, 300, 32, 1));
        let prefill = worker("p", "prefill", vec![Ok(head)]);
        let mut rest = vec![token(6), token(7)];
        rest.extend(done(FinishReason::Length, 300, 288, 3));
        let decode = worker("d", "decode", vec![Ok(rest)]);
        let (events, model) = stitched(&prefill, &decode).await;
        let ids: Vec<u32> = events
            .iter()
            .filter_map(|e| match e {
                GenerateEvent::Token { id, .. } => Some(*id),
                _ => None,
            })
            .collect();
        assert_eq!(ids, [5, 6, 7]);
        assert!(!events.iter().any(|e| matches!(
            e,
            GenerateEvent::Finish {
                finish_reason: FinishReason::Handoff,
                ..
            }
        )));
        let u = final_usage(&events);
        assert_eq!((u.prompt_tokens, u.cached_tokens, u.completion_tokens), (300, 32, 3));
        let sent = decode.got.lock().unwrap()[0].clone();
        assert_eq!(sent.resume, [5]);
        assert_eq!(
            sent.kv_source,
            Some(KvSource {
                worker: "p".into(),
                hold: "req_1".into(),
                tokens: 0,
            })
        );
        assert!(prefill.got.lock().unwrap()[0].prefill_only);
        assert_eq!(model.pd.snapshot()[0], ("disaggregated", 1));
        assert!(
            prefill.released.lock().unwrap().is_empty(),
            "the decode side's fetch releases it"
        );
    }

    #[tokio::test]
    async fn a_decode_worker_that_fails_first_leaves_the_rest_to_one_worker() {
        // The prefill worker hands off, then serves the rest itself (after the first token).
        let mut head = vec![token(5)];
        head.extend(done(FinishReason::Handoff, 300, 32, 1));
        let mut rest = vec![token(6), token(7)];
        rest.extend(done(FinishReason::Length, 300, 0, 3));
        let prefill = worker("p", "prefill", vec![Ok(head), Ok(rest)]);
        let decode = worker("d", "decode", vec![Err(())]);
        let (events, model) = stitched(&prefill, &decode).await;
        assert_eq!(
            events
                .iter()
                .filter(|e| matches!(e, GenerateEvent::Token { .. }))
                .count(),
            3
        );
        let u = final_usage(&events);
        assert_eq!((u.prompt_tokens, u.cached_tokens, u.completion_tokens), (300, 32, 3));
        let retry = prefill.got.lock().unwrap()[1].clone();
        assert_eq!(
            (retry.resume.clone(), retry.kv_source.clone(), retry.prefill_only),
            (vec![5], None, false)
        );
        assert_eq!(*prefill.released.lock().unwrap(), ["req_1"], "its hold is released");
        assert_eq!(model.pd.snapshot()[2], ("retried_colocated", 1));
        let load: u32 = model.router().workers().map(|(_, w)| w.outstanding).sum();
        assert_eq!(load, 0, "both placements released");
    }

    #[tokio::test]
    async fn a_prefill_worker_that_fails_before_its_token_is_retried_whole() {
        let prefill = worker(
            "p",
            "prefill",
            vec![Ok(vec![GenerateEvent::Error {
                code: "engine_error".into(),
                message: "boom".into(),
            }])],
        );
        let mut whole = vec![token(5), token(6), token(7)];
        whole.extend(done(FinishReason::Length, 300, 0, 3));
        let decode = worker("d", "decode", vec![Ok(whole)]);
        let (events, model) = stitched(&prefill, &decode).await;
        assert_eq!(
            events
                .iter()
                .filter(|e| matches!(e, GenerateEvent::Token { .. }))
                .count(),
            3
        );
        let u = final_usage(&events);
        assert_eq!((u.prompt_tokens, u.completion_tokens), (300, 3));
        let sent = decode.got.lock().unwrap()[0].clone();
        assert!(sent.resume.is_empty() && sent.kv_source.is_none() && !sent.prefill_only);
        assert_eq!(model.pd.snapshot()[2], ("retried_colocated", 1));
    }

    #[tokio::test]
    async fn when_every_worker_fails_the_client_gets_the_error_not_a_hang() {
        let mut head = vec![token(5)];
        head.extend(done(FinishReason::Handoff, 300, 0, 1));
        let prefill = worker(
            "p",
            "prefill",
            vec![
                Ok(head),
                Ok(vec![GenerateEvent::Error {
                    code: "model_loading".into(),
                    message: "still loading".into(),
                }]),
            ],
        );
        let decode = worker("d", "decode", vec![Err(())]);
        let (events, _) = stitched(&prefill, &decode).await;
        assert!(matches!(events.first(), Some(GenerateEvent::Token { id: 5, .. })));
        match events.last() {
            Some(GenerateEvent::Error { code, .. }) => assert_eq!(code, "model_loading", "the worker's own code"),
            other => panic!("ends with {other:?}"),
        }
    }
}
