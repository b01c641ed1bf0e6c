//! Tracing glue: the request's root span with OpenTelemetry GenAI attributes, and the W3C
//! `traceparent` a worker needs to continue the trace. Spans are plain `tracing` spans;
//! the binary decides whether they are exported (`--otlp-endpoint`).

use hearth_protocol::TraceParent;
use opentelemetry::trace::TraceContextExt;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The root span of one API request: `operation` is the GenAI operation (`chat`,
/// `text_completion`, …; the span's name), `route` the HTTP route. The `gen_ai.*` fields
/// are recorded as the phases learn them.
pub fn request_span(operation: &'static str, route: &'static str, request_id: &str) -> tracing::Span {
    tracing::info_span!(
        "gen_ai.request",
        otel.name = operation,
        otel.kind = "server",
        gen_ai.operation.name = operation,
        gen_ai.provider.name = "hearth",
        gen_ai.request.model = Empty,
        gen_ai.request.max_tokens = Empty,
        gen_ai.request.temperature = Empty,
        gen_ai.request.top_p = Empty,
        gen_ai.request.seed = Empty,
        gen_ai.request.choice.count = Empty,
        gen_ai.response.id = request_id,
        gen_ai.response.model = Empty,
        gen_ai.response.finish_reasons = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        hearth.usage.cached_tokens = Empty,
        hearth.tenant = Empty,
        http.route = route,
        http.response.status_code = Empty,
        error.type = Empty,
    )
}

/// Renames an exported span (the GenAI convention: `{operation} {model}`, once the model
/// is known). A started span's name can only change through the OpenTelemetry API.
pub fn rename(span: &tracing::Span, name: String) {
    span.context().span().update_name(name);
}

/// `traceparent` for the current span, when it belongs to a recorded trace.
pub fn current_traceparent() -> Option<String> {
    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    sc.is_valid().then(|| {
        TraceParent {
            trace_id: sc.trace_id().to_bytes(),
            span_id: sc.span_id().to_bytes(),
            sampled: sc.is_sampled(),
        }
        .header()
    })
}
