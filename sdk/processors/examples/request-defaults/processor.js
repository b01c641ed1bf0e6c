// Request defaults: fills in top-level fields a request left out — the same on every route
// (/v1/chat/completions, /v1/responses, /v1/messages all take `temperature`, `top_p`,
// `seed` at the top level), so a tenant can make an agent harness that sends no sampling
// parameters (Codex, Claude Code) decode greedily, or pin a seed.
//
// config: {"defaults": {"temperature": 0, …}, "override": false}
//   override — set the fields even when the request has them.
import { log, config } from 'hearth:processor/host@0.1.0';

const CONTINUE = { tag: 'continue' };

export function onRequest(req) {
  const cfg = JSON.parse(config() || '{}');
  const defaults = cfg.defaults || {};
  const body = JSON.parse(req.body);
  let changed = 0;
  for (const [k, v] of Object.entries(defaults)) {
    if (cfg.override || !(k in body)) {
      body[k] = v;
      changed += 1;
    }
  }
  if (changed === 0) return CONTINUE;
  log('info', `set ${changed} default field(s) on ${req.endpoint}`);
  return { tag: 'replace', val: JSON.stringify(body) };
}

export function onResponse(_resp) {
  return CONTINUE;
}

export function onChunk(_index, _text) {
  return CONTINUE;
}

export function onStreamEnd() {
  return CONTINUE;
}
