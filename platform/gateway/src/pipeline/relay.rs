//! Phase `relay`: forwards the worker's events towards the response and closes the
//! request's books — the usage record is written through the [`Meter`] before the final
//! event reaches the client (write-before-ack), or as soon as the client goes away
//! (recording what was generated). The relay runs as its own task, so a vanished client
//! cannot lose a record; dropping the worker's stream cancels the generation.
//!
//! With tenant processors the answer is not final when the worker finishes: their
//! post-processing (and its time, which is metered) comes after. Then the relay passes the
//! worker's last event on, waits for the post-processing's [`PostDone`], records the request
//! with the processors' time, and only then lets the answer's end go out — still
//! write-before-ack.

use std::sync::Arc;
use std::time::Instant;

use futures_util::StreamExt;
use hearth_billing::{Pending, UsageRecord, UsageStatus};
use hearth_protocol::{FinishReason, GenerateEvent};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use super::dispatch::{Dispatched, Failover, Resumed};
use super::limit::Admitted;
use super::meter::Meter;
use super::route::Placement;
use super::RequestContext;
use crate::api::respond::worker_error;
use crate::policy::processors::PostDone;
use crate::server::error::ApiError;
use crate::server::metrics::{FinishLabels, Metrics, ModelLabel, TenantClassLabels};
use crate::state::AppState;
use crate::upstream::workers::EventStream;

/// How long the relay waits for post-processing (bounded by the processors' own limits).
const POST_WAIT: Duration = Duration::from_secs(120);

/// Starts the relay and waits for the first event, so that a refusal by the worker becomes
/// an HTTP error rather than a broken stream. Returns the events for the response.
pub async fn start(
    state: Arc<AppState>,
    meter: Arc<dyn Meter>,
    ctx: &mut RequestContext,
    dispatched: Dispatched,
) -> Result<EventStream, ApiError> {
    // From here on the relay alone meters this request (a later failure, such as a
    // post-processor's refusal, must not record a second, stale copy).
    let rec = ctx
        .usage
        .take()
        .ok_or_else(|| ApiError::internal("pipeline phase 'authenticate' did not run"))?;
    let tenant = match ctx.tenant.as_ref() {
        Some(t) => Some(super::admit::labels(ctx.model()?, &t.tenant_name, ctx.qos.priority)),
        None => None,
    };
    let timing = Timing {
        model: Metrics::model(&ctx.model()?.id),
        tenant,
        received: ctx.received,
        last_token: None,
        span: ctx.span.clone(),
    };
    let (tx, mut rx) = mpsc::channel(64);
    let processor_time = ctx.chain.as_ref().map(|c| c.spent_handle());
    let post = ctx.chain.is_some().then(|| {
        let (post_tx, post_rx) = oneshot::channel();
        ctx.post_done = Some(post_tx);
        post_rx
    });
    let span = tracing::info_span!(parent: &ctx.span, "relay");
    let holds = Holds {
        lease: ctx.lease.take(),
        budget: ctx.budget_hold.take(),
        post,
        processor_time,
    };
    let unrecorded = ctx.unrecorded.take().unwrap_or_else(|| state.unrecorded.start());
    tokio::spawn(
        async move {
            let _unrecorded = unrecorded; // until the usage is recorded
            relay(state, meter, rec, timing, dispatched, holds, tx).await;
        }
        .instrument(span),
    );
    let first = rx
        .recv()
        .await
        .ok_or_else(|| ApiError::internal("the relay ended early"))?;
    if let GenerateEvent::Error { code, message } = &first {
        // The relay has recorded this failure.
        let mut e = worker_error(code, message);
        if code.ends_with("_schema") {
            // The grammar came from the tools (required / named tool_choice), not response_format.
            let by_tools = ctx
                .request()
                .is_ok_and(|r| r.common.tools.as_ref().is_some_and(|t| t.active() && t.forced()));
            if by_tools {
                e.param = Some("tools".into());
            }
        }
        if code == "overloaded" {
            // The worker's own queue refused it (another gateway filled it first): retry
            // once what is queued now has drained.
            let model = ctx.model()?;
            let queued = super::admit::pool_queue(model, &ctx.qos.tenant).queued;
            e.retry_after = Some(model.queues.retry_after(queued));
        }
        return Err(e);
    }
    Ok(futures_util::stream::iter([first])
        .chain(ReceiverStream::new(rx))
        .boxed())
}

/// What a dispatched request holds until its books are closed.
struct Holds {
    /// Rate-limit admission (in-flight slots; completion tokens charged at the end).
    lease: Option<Admitted>,
    /// The reservation against a hard budget, released once the real cost is counted.
    budget: Option<crate::policy::budget::BudgetHold>,
    /// With processors: post-processing's report (see [`PostDone`]), and the processors'
    /// running time (for a request that ends another way, e.g. a chunk hook's refusal).
    post: Option<oneshot::Receiver<PostDone>>,
    processor_time: Option<Arc<std::sync::atomic::AtomicU64>>,
}

/// What the relay measures for the latency histograms.
struct Timing {
    model: ModelLabel,
    /// Per-tenant series (absent for an unauthenticated composition).
    tenant: Option<TenantClassLabels>,
    received: Instant,
    last_token: Option<Instant>,
    /// The request's root span, kept open until the relay ends; gets the usage.
    span: tracing::Span,
}

impl Timing {
    fn token(&mut self, m: &Metrics) {
        let now = Instant::now();
        match self.last_token {
            None => {
                let ttft = (now - self.received).as_secs_f64();
                m.ttft.get_or_create(&self.model).observe(ttft);
                if let Some(t) = &self.tenant {
                    m.tenant_ttft.get_or_create(t).observe(ttft);
                }
            }
            Some(last) => m.itl.get_or_create(&self.model).observe((now - last).as_secs_f64()),
        }
        self.last_token = Some(now);
    }

    fn done(&self, m: &Metrics, finish_reason: &str, usage: &hearth_protocol::Usage) {
        // Signed: OpenTelemetry's integers are i64 (unsigned ones are exported as text).
        self.span
            .record("gen_ai.usage.input_tokens", i64::from(usage.prompt_tokens));
        self.span
            .record("gen_ai.usage.output_tokens", i64::from(usage.completion_tokens));
        self.span
            .record("hearth.usage.cached_tokens", i64::from(usage.cached_tokens));
        self.span.record(
            "gen_ai.response.finish_reasons",
            tracing::field::display(format!("[\"{finish_reason}\"]")),
        );
        m.e2e
            .get_or_create(&self.model)
            .observe(self.received.elapsed().as_secs_f64());
        m.prompt_tokens
            .get_or_create(&self.model)
            .inc_by(usage.prompt_tokens.into());
        m.cached_tokens
            .get_or_create(&self.model)
            .inc_by(usage.cached_tokens.into());
        m.generation_tokens
            .get_or_create(&self.model)
            .inc_by(usage.completion_tokens.into());
        m.finished
            .get_or_create(&FinishLabels {
                model: self.model.model.clone(),
                finished_reason: finish_reason.to_string(),
            })
            .inc();
    }
}

/// Sends one event towards the client; false if the client is gone, or the drain timeout
/// (or the request's time limit) passed while a client was not reading.
async fn send(
    tx: &mpsc::Sender<GenerateEvent>,
    ev: GenerateEvent,
    abort: &mut tokio::sync::watch::Receiver<bool>,
    deadline: tokio::time::Instant,
) -> bool {
    // A send with room goes first, even after the abort: the error event that ends the
    // stream must still go out.
    tokio::select! {
        biased;
        r = tx.send(ev) => r.is_ok(),
        () = aborted(abort) => false,
        () = tokio::time::sleep_until(deadline) => false,
    }
}

/// Returns when the gateway's drain timeout has passed.
async fn aborted(rx: &mut tokio::sync::watch::Receiver<bool>) {
    if rx.wait_for(|a| *a).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// One generation being relayed: the worker's stream, where it runs, and what has passed so
/// far (for the usage record, and for a failover to continue from).
struct Relay {
    state: Arc<AppState>,
    meter: Arc<dyn Meter>,
    rec: UsageRecord,
    timing: Timing,
    events: EventStream,
    placement: Option<Placement>,
    failover: Option<Failover>,
    holds: Holds,
    tx: mpsc::Sender<GenerateEvent>,
    abort: tokio::sync::watch::Receiver<bool>,
    deadline: tokio::time::Instant,
    /// Tokens generated, over every choice.
    generated: u32,
    /// Choice 0's tokens passed on: where a failover continues from.
    sent: Vec<u32>,
    /// Why choice 0 ended, once its `Finish` was passed on.
    finished: Option<FinishReason>,
    /// Whether the current worker has sent anything: before its first event the request may
    /// be queued or prefilling, which the idle timeout does not cover.
    streaming: bool,
    /// The request's admission mark, from its first token on (see `Meter::admit`).
    admitted: Option<hearth_billing::Admitted>,
}

/// What [`Relay::recover`] made of an event: the event to pass on (as it came, or the end a
/// lost worker owed), the generation resumed on another worker, or the client gone while
/// the lost worker's `Finish` was sent.
enum Recovery {
    Event(GenerateEvent),
    Resumed,
    ClientGone,
}

async fn relay(
    state: Arc<AppState>,
    meter: Arc<dyn Meter>,
    rec: UsageRecord,
    timing: Timing,
    Dispatched {
        events,
        placement,
        failover,
    }: Dispatched,
    holds: Holds,
    tx: mpsc::Sender<GenerateEvent>,
) {
    let abort = state.abort.subscribe();
    let deadline = tokio::time::Instant::from_std(timing.received + state.request_limits.max_duration);
    let mut relay = Relay {
        state,
        meter,
        rec,
        timing,
        events,
        placement,
        failover,
        holds,
        tx,
        abort,
        deadline,
        generated: 0,
        sent: Vec::new(),
        finished: None,
        streaming: false,
        admitted: None,
    };
    let ended = relay.run().await;
    relay.settle(ended).await;
}

impl Relay {
    /// Passes events on until the request ends; its usage record is then written
    /// (`Some`), or the client went away first (`None`).
    async fn run(&mut self) -> Option<Option<Pending>> {
        loop {
            let ev = self.next_event().await?;
            self.streaming = true;
            let ev = match self.recover(ev).await {
                Recovery::Event(ev) => ev,
                Recovery::Resumed => continue,
                Recovery::ClientGone => return None,
            };
            if self.observe(&ev) {
                return Some(self.close(ev).await);
            }
            if !self.send(ev).await {
                return None;
            }
        }
    }

    /// The worker's next event, or the error that ends the request instead (a silent or
    /// vanished worker, the drain timeout, the request's time limit); `None`: the client
    /// is gone.
    async fn next_event(&mut self) -> Option<GenerateEvent> {
        let limits = self.state.request_limits;
        let streaming = self.streaming;
        let events = &mut self.events;
        let next = async {
            if streaming {
                tokio::time::timeout(limits.stream_idle, events.next()).await
            } else {
                Ok(events.next().await)
            }
        };
        let ev = tokio::select! {
            ev = next => match ev {
                Ok(Some(ev)) => ev,
                Ok(None) => GenerateEvent::Error {
                    code: "worker_disconnected".into(),
                    message: "the worker ended the stream without finishing".into(),
                },
                Err(_) => GenerateEvent::Error {
                    code: "stream_idle_timeout".into(),
                    message: format!("the worker sent nothing for {} s", limits.stream_idle.as_secs()),
                },
            },
            () = self.tx.closed() => return None,
            () = aborted(&mut self.abort) => GenerateEvent::Error {
                code: "shutting_down".into(),
                message: "the gateway is shutting down and its drain timeout passed".into(),
            },
            () = tokio::time::sleep_until(self.deadline) => GenerateEvent::Error {
                code: "request_timeout".into(),
                message: format!("the request ran longer than {} s", limits.max_duration.as_secs()),
            },
        };
        Some(ev)
    }

    /// A lost worker: the generation continues on another one after what was sent.
    async fn recover(&mut self, ev: GenerateEvent) -> Recovery {
        let (GenerateEvent::Error { code, .. }, Some(f)) = (&ev, self.failover.as_mut()) else {
            return Recovery::Event(ev);
        };
        if !super::dispatch::worker_lost(code) {
            return Recovery::Event(ev);
        }
        drop(std::mem::replace(
            &mut self.events,
            futures_util::stream::empty().boxed(),
        ));
        let resumed = match self.finished {
            // The answer was complete; only its `Done` was lost.
            Some(_) => Resumed::Complete,
            None => f.resume(&self.sent, self.placement.as_ref()).await,
        };
        match resumed {
            Resumed::On(d) => {
                self.state.metrics.failovers.inc();
                self.events = d.events;
                self.placement = d.placement;
                self.streaming = false;
                Recovery::Resumed
            }
            Resumed::Complete => {
                // The usage the worker would have reported: the prompt (none of it known to
                // be cached) and every token generated.
                let finish_reason = self.finished.unwrap_or(FinishReason::Length);
                let finish = GenerateEvent::Finish {
                    index: 0,
                    finish_reason,
                };
                if self.finished.is_none() && !self.send(finish).await {
                    return Recovery::ClientGone;
                }
                Recovery::Event(GenerateEvent::Done {
                    finish_reason,
                    usage: hearth_protocol::Usage {
                        prompt_tokens: self.rec.prompt_tokens,
                        cached_tokens: 0,
                        completion_tokens: self.generated,
                    },
                    timings: Default::default(),
                })
            }
            Resumed::Unavailable => Recovery::Event(ev),
        }
    }

    /// Takes one event into the record and the metrics; true when it ends the request.
    fn observe(&mut self, ev: &GenerateEvent) -> bool {
        let state = &self.state;
        let rec = &mut self.rec;
        match ev {
            GenerateEvent::Token { index, id, .. } => {
                if self.admitted.is_none() {
                    // Durable from the first token on: if this process dies before the
                    // final record, the next one records the request as interrupted.
                    self.admitted = self.meter.admit(rec);
                }
                if *index == 0 {
                    self.sent.push(*id);
                }
                self.generated += 1;
                if rec.ttft_ms.is_none() {
                    rec.ttft_ms = Some(u32::try_from(self.timing.received.elapsed().as_millis()).unwrap_or(u32::MAX));
                }
                self.timing.token(&state.metrics);
                if let Some(p) = self.placement.as_mut() {
                    p.first_token();
                }
                false
            }
            GenerateEvent::Finish { index, finish_reason } => {
                if *index == 0 {
                    self.finished = Some(*finish_reason);
                }
                false
            }
            GenerateEvent::Done {
                finish_reason,
                usage,
                timings,
            } => {
                rec.prompt_tokens = usage.prompt_tokens;
                rec.cached_tokens = usage.cached_tokens;
                rec.completion_tokens = usage.completion_tokens;
                if let Some(p) = &self.placement {
                    p.usage(usage.prompt_tokens, usage.cached_tokens);
                }
                rec.status = UsageStatus::Completed.as_str().into();
                rec.finish_reason = Some(finish_reason.as_str().into());
                self.timing.done(&state.metrics, finish_reason.as_str(), usage);
                if let (Some(t), false) = (&self.timing.tenant, timings.is_empty()) {
                    let queue = timings.queue_us as f64 / 1e6;
                    state.metrics.tenant_queue.get_or_create(t).observe(queue);
                }
                true
            }
            GenerateEvent::Error { code, message } => {
                tracing::warn!(request_id = %rec.request_id, code = %code, message = %message, "generation failed");
                rec.completion_tokens = self.generated;
                if self.generated == 0 {
                    // Refused or failed before anything was served: billed nothing.
                    rec.prompt_tokens = 0;
                    rec.cached_tokens = 0;
                    rec.processor_us = 0;
                }
                rec.status = UsageStatus::Failed.as_str().into();
                rec.error_code = Some(code.clone());
                true
            }
        }
    }

    /// The request's last event: its usage is recorded before the event goes out
    /// (write-before-ack); with processors, after their post-processing reports its time.
    async fn close(&mut self, ev: GenerateEvent) -> Option<Pending> {
        let finished = matches!(ev, GenerateEvent::Done { .. });
        if let (true, Some(post)) = (finished, self.holds.post.take()) {
            // Post-processing needs the worker's last event before its time is known.
            self.send(ev).await;
            let report = tokio::select! {
                r = tokio::time::timeout(POST_WAIT, post) => r.ok().and_then(Result::ok),
                () = aborted(&mut self.abort) => None,
            };
            if let Some(r) = &report {
                self.rec.processor_us = r.processor_us;
            }
            let pending = self
                .meter
                .record(&mut self.rec)
                .instrument(tracing::info_span!("meter"))
                .await;
            if let Some(r) = report {
                let _ = r.written.send(());
            }
            return pending;
        }
        let pending = self
            .meter
            .record(&mut self.rec)
            .instrument(tracing::info_span!("meter"))
            .await;
        self.send(ev).await;
        pending
    }

    /// After the client's response has ended: the limits' lease settled, the record of a
    /// request the client left, the admission mark, the budget's hold.
    async fn settle(mut self, ended: Option<Option<Pending>>) {
        drop(self.tx);
        drop(self.placement);
        if let Some(lease) = self.holds.lease {
            // Settles the token reservation to what was used; releases the in-flight slots.
            let used = self
                .rec
                .prompt_tokens
                .saturating_add(self.rec.completion_tokens.max(self.generated));
            lease.finish(used).await;
        }
        let pending = match ended {
            Some(p) => p,
            None => {
                drop(self.events); // cancels the generation
                self.rec.completion_tokens = self.generated;
                if let Some(t) = &self.holds.processor_time {
                    self.rec.processor_us = t.load(std::sync::atomic::Ordering::Relaxed);
                }
                self.rec.status = UsageStatus::Cancelled.as_str().into();
                self.rec.finish_reason = Some(FinishReason::Cancelled.as_str().into());
                self.meter
                    .record(&mut self.rec)
                    .instrument(tracing::info_span!("meter"))
                    .await
            }
        };
        match (pending.is_some(), self.admitted) {
            // Neither the outbox nor the database took the final record: the mark stays, so
            // the request is recorded as interrupted on replay rather than lost.
            (false, Some(a)) => a.abandon(),
            (_, a) => drop(a),
        }
        self.meter.settle(&self.rec, pending).await;
        // The real cost is now in the budget's spend: the worst case no longer needs holding.
        drop(self.holds.budget);
    }

    /// [`send`] with this request's abort and deadline.
    async fn send(&mut self, ev: GenerateEvent) -> bool {
        send(&self.tx, ev, &mut self.abort, self.deadline).await
    }
}
