//! `GET /metrics`: Prometheus text exposition. Every metric is named here, once.
//!
//! Per worker: in-flight requests, in-flight prefill tokens, decoding sequences, cached
//! blocks in the router's index, health. Per model: routing decisions by policy and reason,
//! index size.

use std::fmt::Write;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use crate::gateway::Gateway;

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

pub async fn render(State(gw): State<Arc<Gateway>>) -> impl IntoResponse {
    let mut out = String::new();
    let gauges = [
        (
            "hearth_worker_inflight_requests",
            "Requests dispatched to the worker and not finished.",
        ),
        (
            "hearth_worker_inflight_prefill_tokens",
            "Prompt tokens dispatched to the worker and not yet computed (router estimate).",
        ),
        (
            "hearth_worker_decoding_sequences",
            "Requests past their first token on the worker.",
        ),
        (
            "hearth_worker_cached_blocks",
            "KV blocks the router's index says the worker holds.",
        ),
        ("hearth_worker_healthy", "1 when the worker passes its health check."),
        (
            "hearth_worker_exact_kv_events",
            "1 when the router follows the worker's KV events (else it assumes).",
        ),
    ];
    let mut rows: Vec<[String; 6]> = Vec::new();
    let mut labels = Vec::new();
    for m in gw.models.all() {
        let r = m.router();
        for (slot, w) in r.workers() {
            labels.push(format!(
                "model=\"{}\",worker=\"{}\",region=\"{}\"",
                escape(&m.id),
                escape(&w.name),
                escape(&w.region)
            ));
            rows.push([
                w.outstanding.to_string(),
                w.inflight_prefill_tokens.to_string(),
                w.decoding.to_string(),
                r.index.worker_blocks(slot).to_string(),
                u8::from(w.healthy).to_string(),
                u8::from(w.exact_events).to_string(),
            ]);
        }
    }
    for (i, (name, help)) in gauges.iter().enumerate() {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (l, row) in labels.iter().zip(&rows) {
            let _ = writeln!(out, "{name}{{{l}}} {}", row[i]);
        }
    }
    let _ = writeln!(out, "# HELP hearth_routing_decisions_total Routing decisions by policy and reason.\n# TYPE hearth_routing_decisions_total counter");
    for m in gw.models.all() {
        let r = m.router();
        let mut d: Vec<_> = r.decisions.iter().collect();
        d.sort_by_key(|((p, reason), _)| (*p, reason.as_str()));
        for ((policy, reason), n) in d {
            let _ = writeln!(
                out,
                "hearth_routing_decisions_total{{model=\"{}\",policy=\"{policy}\",reason=\"{}\"}} {n}",
                escape(&m.id),
                reason.as_str()
            );
        }
    }
    let _ = writeln!(out, "# HELP hearth_router_index_blocks Distinct KV blocks in the router's index.\n# TYPE hearth_router_index_blocks gauge");
    for m in gw.models.all() {
        let _ = writeln!(
            out,
            "hearth_router_index_blocks{{model=\"{}\"}} {}",
            escape(&m.id),
            m.router().index.len()
        );
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}
