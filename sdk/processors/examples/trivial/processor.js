// The smallest JavaScript processor: every hook continues (the benchmark's JS guest).
const CONTINUE = { tag: 'continue' };
export function onRequest(_req) {
  return CONTINUE;
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
