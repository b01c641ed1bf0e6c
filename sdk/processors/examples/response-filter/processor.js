// Response filter: masks or blocks listed words in the model's answer, and can require the
// answer to be valid JSON.
//
// config: {"blocked_words": ["foo", "bar"], "mode": "mask" | "block", "require_json": false}
//   mask   — each listed word (case-insensitive, whole word) becomes "****";
//   block  — an answer containing one is refused (HTTP 451, or an error event when streamed);
//   require_json — a non-streamed answer that is not valid JSON is refused (HTTP 422); a
//   streamed one ends with an error event.
import { log, config } from 'hearth:processor/host@0.1.0';

const CONTINUE = { tag: 'continue' };
const cfg = () => JSON.parse(config() || '{}');

function pattern(words) {
  const esc = words.filter((w) => w).map((w) => w.replace(/[.*+?^${}()|[\]\\]/g, '\\$&'));
  return esc.length ? new RegExp(`\\b(${esc.join('|')})\\b`, 'gi') : null;
}

// Apply the policy to a piece of text: [newText, rejection or null].
function filter(text, c) {
  const re = pattern(c.blocked_words || []);
  if (!re || !re.test(text)) return [text, null];
  re.lastIndex = 0;
  if (c.mode === 'block') {
    log('warn', 'blocked an answer containing a listed word');
    return [text, { status: 451, message: 'The answer contained blocked content.' }];
  }
  return [text.replace(re, '****'), null];
}

export function onRequest(_req) {
  return CONTINUE;
}

export function onResponse(resp) {
  const c = cfg();
  const body = JSON.parse(resp.body);
  let changed = false;
  for (const choice of body.choices || []) {
    const holder = choice.message ? choice.message : choice;
    const key = choice.message ? 'content' : 'text';
    const text = holder[key];
    if (typeof text !== 'string') continue;
    if (c.require_json) {
      try {
        JSON.parse(text);
      } catch {
        return { tag: 'reject', val: { status: 422, message: 'The answer is not valid JSON.' } };
      }
    }
    const [out, reject] = filter(text, c);
    if (reject) return { tag: 'reject', val: reject };
    if (out !== text) {
      holder[key] = out;
      changed = true;
    }
  }
  return changed ? { tag: 'replace', val: JSON.stringify(body) } : CONTINUE;
}

// Streaming: words can straddle deltas, so hold back each choice's last partial word until
// the next delta (or the end), and keep the whole text when JSON is required.
const pending = new Map();
const whole = new Map();

export function onChunk(index, text) {
  const c = cfg();
  if (c.require_json) whole.set(index, (whole.get(index) || '') + text);
  const buf = (pending.get(index) || '') + text;
  const cut = Math.max(buf.lastIndexOf(' '), buf.lastIndexOf('\n'));
  const ready = cut >= 0 ? buf.slice(0, cut + 1) : '';
  pending.set(index, cut >= 0 ? buf.slice(cut + 1) : buf);
  const [out, reject] = filter(ready, c);
  if (reject) return { tag: 'reject', val: reject };
  return { tag: 'replace', val: out };
}

export function onStreamEnd() {
  const c = cfg();
  let tail = '';
  for (const [, rest] of pending) tail += rest;
  pending.clear();
  const [out, reject] = filter(tail, c);
  if (reject) return { tag: 'reject', val: reject };
  if (c.require_json) {
    for (const [, text] of whole) {
      try {
        JSON.parse(text);
      } catch {
        return { tag: 'reject', val: { status: 422, message: 'The answer is not valid JSON.' } };
      }
    }
  }
  return out ? { tag: 'replace', val: out } : CONTINUE;
}
