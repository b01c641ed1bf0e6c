// System-prompt injector: puts the tenant's system prompt first in every chat request.
//
// config: {"system_prompt": "You are …", "mode": "prepend" | "enforce"}
//   prepend  — add it before the client's messages (the client may add its own);
//   enforce  — also drop any system/developer message the client sent.
import { log, config } from 'hearth:processor/host@0.1.0';

const CONTINUE = { tag: 'continue' };

export function onRequest(req) {
  const cfg = JSON.parse(config() || '{}');
  if (!cfg.system_prompt || req.endpoint !== '/v1/chat/completions') return CONTINUE;
  const body = JSON.parse(req.body);
  if (!Array.isArray(body.messages)) return CONTINUE;
  let messages = body.messages;
  if (cfg.mode === 'enforce') {
    const before = messages.length;
    messages = messages.filter((m) => m.role !== 'system' && m.role !== 'developer');
    if (messages.length !== before) log('info', `dropped ${before - messages.length} client system message(s)`);
  }
  body.messages = [{ role: 'system', content: String(cfg.system_prompt) }, ...messages];
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
