//! Trace spans for a request's life on a worker: `worker.generate` with `queue`, `prefill`
//! and `decode` children, recorded when the request ends from the engine's own
//! [`EngineTimings`], under the gateway's span (from `traceparent`, or the in-process
//! caller's context). Spans go to the process's global OpenTelemetry tracer: a no-op unless
//! the binary installed an exporter (`--otlp-endpoint`).

use std::time::{Duration, SystemTime};

use hearth_protocol::{EngineTimings, TraceParent, Usage};
use opentelemetry::trace::{
    Span, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
};
use opentelemetry::{global, Context, KeyValue};

/// The parent context a `traceparent` header names (remote).
pub fn parent_from(tp: &TraceParent) -> Context {
    let sc = SpanContext::new(
        TraceId::from_bytes(tp.trace_id),
        SpanId::from_bytes(tp.span_id),
        if tp.sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        },
        true,
        TraceState::default(),
    );
    Context::new().with_remote_span_context(sc)
}

/// What one finished request tells the trace.
pub struct RequestTrace<'a> {
    pub worker: &'a str,
    pub model: &'a str,
    pub request_id: &'a str,
    /// When the worker received the request.
    pub received: SystemTime,
    pub usage: &'a Usage,
    pub timings: &'a EngineTimings,
}

/// Records `worker.generate` and its engine phases, ending now.
pub fn record(parent: &Context, t: &RequestTrace<'_>) {
    if !parent.span().span_context().is_valid() {
        return;
    }
    let tracer = global::tracer("hearth-engine");
    let end = SystemTime::now();
    let us = Duration::from_micros;
    let decode_start = end - us(t.timings.decode_us);
    let prefill_start = decode_start - us(t.timings.prefill_us);
    let queue_start = prefill_start - us(t.timings.queue_us);
    let start = t.received.min(queue_start);
    let span = tracer
        .span_builder("worker.generate")
        .with_kind(SpanKind::Server)
        .with_start_time(start)
        .with_attributes([
            KeyValue::new("hearth.worker", t.worker.to_string()),
            KeyValue::new("hearth.request_id", t.request_id.to_string()),
            KeyValue::new("gen_ai.request.model", t.model.to_string()),
            KeyValue::new("gen_ai.usage.input_tokens", i64::from(t.usage.prompt_tokens)),
            KeyValue::new("gen_ai.usage.output_tokens", i64::from(t.usage.completion_tokens)),
            KeyValue::new("hearth.usage.cached_tokens", i64::from(t.usage.cached_tokens)),
        ])
        .start_with_context(&tracer, parent);
    let cx = parent.with_span(span);
    for (name, from, to) in [
        ("queue", queue_start, prefill_start),
        ("prefill", prefill_start, decode_start),
        ("decode", decode_start, end),
    ] {
        let mut child = tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(from)
            .start_with_context(&tracer, &cx);
        child.end_with_timestamp(to);
    }
    cx.span().end_with_timestamp(end);
}

/// Records `worker.kv_transfer`: a disaggregated request's KV blocks fetched from its
/// prefill worker (`started` → now), with what moved and whether it broke.
pub fn record_transfer(
    parent: &Context,
    worker: &str,
    request_id: &str,
    started: SystemTime,
    report: &crate::kv::block::PullReport,
) {
    if !parent.span().span_context().is_valid() {
        return;
    }
    let tracer = global::tracer("hearth-engine");
    let mut attrs = vec![
        KeyValue::new("hearth.worker", worker.to_string()),
        KeyValue::new("hearth.request_id", request_id.to_string()),
        KeyValue::new("hearth.kv.blocks_missing", report.missing as i64),
        KeyValue::new("hearth.kv.blocks", report.import.imported as i64),
        KeyValue::new("hearth.kv.bytes", report.import.bytes as i64),
    ];
    if let Some(e) = &report.error {
        attrs.push(KeyValue::new("error.type", "kv_transfer"));
        attrs.push(KeyValue::new("hearth.kv.error", e.clone()));
    }
    let mut span = tracer
        .span_builder("worker.kv_transfer")
        .with_kind(SpanKind::Client)
        .with_start_time(started)
        .with_attributes(attrs)
        .start_with_context(&tracer, parent);
    span.end();
}

/// Wraps a worker's event stream so that its end records the request's spans.
pub fn traced<S>(
    events: S,
    parent: Context,
    worker: String,
    model: String,
    request_id: String,
) -> impl futures_util::Stream<Item = hearth_protocol::GenerateEvent>
where
    S: futures_util::Stream<Item = hearth_protocol::GenerateEvent>,
{
    use futures_util::StreamExt;
    let received = SystemTime::now();
    events.inspect(move |ev| {
        if let hearth_protocol::GenerateEvent::Done { usage, timings, .. } = ev {
            record(
                &parent,
                &RequestTrace {
                    worker: &worker,
                    model: &model,
                    request_id: &request_id,
                    received,
                    usage,
                    timings,
                },
            );
        }
    })
}
