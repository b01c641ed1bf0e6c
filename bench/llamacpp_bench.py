"""llama.cpp (through llama-cpp-python's low-level API) on the same measurements as
`hearth bench engine`: load, prefill of a 512-token prompt, decode of 1 stream, aggregate
decode of 8 and 32 sequences in one batch (like llama-batched-bench), TTFT of a 1000-token
prompt cold and with its first 900 tokens already in the KV cache, peak RSS.
Usage: llamacpp_bench.py MODEL.gguf --threads N [--quick] [--json OUT]"""
import argparse, ctypes, json, random, resource, time

import llama_cpp

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--quick", action="store_true")
ap.add_argument("--json")
ap.add_argument("--smoke", action="store_true", help="one short prompt, then exit (build check)")
ap.add_argument("--coldstart", type=int, metavar="N",
                help="only time process-local load + first token of an N-token prompt")
a = ap.parse_args()

decode_tokens, stream_tokens = (32, 16) if a.quick else (128, 64)
rng = random.Random(20261129)

t0 = time.time()
llm = llama_cpp.Llama(model_path=a.model, n_ctx=512, n_threads=a.threads, verbose=False)
# The high-level constructor does not expose n_seq_max: build the context ourselves, with a
# unified KV cache shared by up to 32 sequences (as llama-batched-bench does).
params = llama_cpp.llama_context_default_params()
params.n_ctx = 4096
params.n_batch = 512
params.n_ubatch = 512
params.n_seq_max = 32
params.n_threads = a.threads
params.n_threads_batch = a.threads
if hasattr(params, "kv_unified"):
    params.kv_unified = True
init = getattr(llama_cpp, "llama_init_from_model", None) or llama_cpp.llama_new_context_with_model
ctx = init(llm._model.model, params)
load_s = time.time() - t0
vocab = llm.n_vocab()


def prompt(n):
    return [rng.randrange(17, vocab) for _ in range(n)]


if a.coldstart:
    # Load → first token: the model and context were just created; one prefill of the
    # prompt (the same deterministic ids as `hearth bench coldstart`) gives the first token.
    toks = [17 + (i * 7919) % 40000 for i in range(a.coldstart)]
    batch = llama_cpp.llama_batch_init(len(toks), 0, 1)
    batch.n_tokens = len(toks)
    for j, tok in enumerate(toks):
        batch.token[j] = tok
        batch.pos[j] = j
        batch.n_seq_id[j] = 1
        batch.seq_id[j][0] = 0
        batch.logits[j] = 1 if j == len(toks) - 1 else 0
    t = time.time()
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")
    prefill_s = time.time() - t
    report = {"engine": "llama.cpp", "load_s": load_s, "prefill_ms": prefill_s * 1000,
              "load_plus_first_token_ms": (load_s + prefill_s) * 1000}
    print(json.dumps(report, indent=2))
    if a.json:
        json.dump(report, open(a.json, "w"), indent=2)
    raise SystemExit(0)


def clear():
    if hasattr(llama_cpp, "llama_memory_clear"):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    else:
        llama_cpp.llama_kv_cache_clear(ctx)


def decode(entries):
    """entries: list of (token, pos, seq, want_logits); split into n_batch chunks."""
    for i in range(0, len(entries), 512):
        part = entries[i:i + 512]
        batch = llama_cpp.llama_batch_init(len(part), 0, 32)
        batch.n_tokens = len(part)
        for j, (tok, pos, seq, logits) in enumerate(part):
            batch.token[j] = tok
            batch.pos[j] = pos
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = seq
            batch.logits[j] = 1 if logits else 0
        rc = llama_cpp.llama_decode(ctx, batch)
        llama_cpp.llama_batch_free(batch)
        if rc != 0:
            raise SystemExit(f"llama_decode failed: {rc}")


def seq_prompt(toks, seq=0, start=0):
    return [(t, start + i, seq, i == len(toks) - 1) for i, t in enumerate(toks)]


# Warm up.
clear(); decode(seq_prompt(prompt(32)))
if a.smoke:
    decode(seq_prompt(prompt(64), start=32))
    raise SystemExit(0)

prefill = 0.0
for _ in range(1 if a.quick else 3):
    clear()
    p = prompt(512)
    t = time.time(); decode(seq_prompt(p)); dt = time.time() - t
    prefill = max(prefill, 512 / dt)

clear()
p = prompt(16)
decode(seq_prompt(p))
pos = len(p)
t = time.time()
for _ in range(decode_tokens - 1):
    decode([(rng.randrange(17, vocab), pos, 0, True)])
    pos += 1
decode_1 = (decode_tokens - 1) / (time.time() - t)


def streams(n):
    clear()
    entries = []
    for s in range(n):
        entries += seq_prompt(prompt(16), seq=s)
    decode(entries)
    pos = 16
    t = time.time()
    for _ in range(stream_tokens - 1):
        decode([(rng.randrange(17, vocab), pos, s, True) for s in range(n)])
        pos += 1
    return n * (stream_tokens - 1) / (time.time() - t)


decode_8 = streams(8)
decode_32 = streams(32)

prefix = prompt(900)
clear()
t = time.time(); decode(seq_prompt(prefix + prompt(100))); cold = time.time() - t
# Cached: the 900-token prefix stays in the KV cache; only the new 100 tokens are computed.
clear(); decode(seq_prompt(prefix))
t = time.time(); decode(seq_prompt(prompt(100), start=900)); warm = time.time() - t

info = llama_cpp.llama_print_system_info()
info = info.decode() if isinstance(info, bytes) else str(info)
# The instruction sets ggml was built with ("AVX512 = 1 | AVX512_VNNI = 1 | …").
features = [part.split("=")[0].strip() for part in info.replace(";", "|").split("|")
            if part.strip().endswith("= 1") or part.strip().endswith("=1")]
report = {
    "engine": "llama.cpp (llama-cpp-python " + llama_cpp.__version__ + ")",
    "isa": " ".join(f.split(":")[-1].strip() for f in features),
    "threads": a.threads,
    "load_s": load_s,
    "prefill_512_tok_s": prefill,
    "decode_1_tok_s": decode_1,
    "decode_8_tok_s": decode_8,
    "decode_32_tok_s": decode_32,
    "ttft_1000_cold_ms": cold * 1000,
    "ttft_1000_cached_900_ms": warm * 1000,
    "ttft_cached_over_cold": warm / cold,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}
print(json.dumps(report, indent=2))
if a.json:
    with open(a.json, "w") as f:
        json.dump(report, f, indent=2)
