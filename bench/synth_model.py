"""Synthetic models for differential tests and benchmarks: seeded random weights with a real
tokenizer, written as GGUF with the `gguf` package, then quantized by llama.cpp's own
quantizer (`llama_model_quantize`, through llama-cpp-python).

Usage: synth_model.py --shape NAME --vocab VOCAB.gguf --out DIR [--types f16,q8_0,q4_k_m,...]
Prints one line per file written: TYPE PATH. Files are reused when present (same seed, same
bytes)."""
import argparse, ctypes, os, sys

import numpy as np
import gguf

# name: (d_model, layers, ffn, heads, kv_heads, context, rope_theta, tied embeddings)
SHAPES = {
    # Small enough for a test to run llama.cpp and Hearth on several types in seconds.
    "tiny": (256, 2, 768, 4, 2, 2048, 10000.0, False),
    # Llama-3.2-1B's shape (larger than any L3 cache: ~0.8 GB at Q4_K_M).
    "llama-1b": (2048, 16, 8192, 32, 8, 8192, 500000.0, True),
}

# llama.cpp's file types (llama.h `llama_ftype`).
FTYPES = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10,
    "q3_k_m": 12,
    "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18, "bf16": 32,
}


def copy_tokenizer(w, vocab_path):
    r = gguf.GGUFReader(vocab_path)
    for f in r.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            sub = f.types[1]
            if sub == gguf.GGUFValueType.STRING:
                vals = [bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data]
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(f.name, vals, vt, sub_type=sub)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_key_value(f.name, bytes(f.parts[f.data[0]]).decode("utf-8"), vt)
        else:
            w.add_key_value(f.name, f.parts[f.data[0]].tolist()[0], vt)
    tokens = r.fields["tokenizer.ggml.tokens"]
    return len(tokens.data)


def write_f16(path, shape, vocab_path, seed):
    d, layers, ff, heads, kv_heads, ctx, theta, tied = SHAPES[shape]
    head_dim = d // heads
    w = gguf.GGUFWriter(path + ".tmp", "llama")
    w.add_name(f"hearth-synth-{shape}")
    w.add_context_length(ctx)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)
    vocab = copy_tokenizer(w, vocab_path)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)

    def mat(rows, cols, std):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    # Scales that keep the residual stream and the logits of a random model well spread, so
    # that greedy decoding is not a sequence of near-ties.
    w.add_tensor("token_embd.weight", mat(vocab, d, 1.0))
    w.add_tensor("output_norm.weight", norm(d))
    if not tied:
        w.add_tensor("output.weight", mat(vocab, d, 2.0 / np.sqrt(d)))
    kv = kv_heads * head_dim
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(d))
        w.add_tensor(p + "attn_q.weight", mat(d, d, 1.0 / np.sqrt(d)))
        w.add_tensor(p + "attn_k.weight", mat(kv, d, 1.0 / np.sqrt(d)))
        w.add_tensor(p + "attn_v.weight", mat(kv, d, 1.0 / np.sqrt(d)))
        w.add_tensor(p + "attn_output.weight", mat(d, d, 1.0 / np.sqrt(d)))
        w.add_tensor(p + "ffn_norm.weight", norm(d))
        w.add_tensor(p + "ffn_gate.weight", mat(ff, d, 1.0 / np.sqrt(d)))
        w.add_tensor(p + "ffn_up.weight", mat(ff, d, 1.0 / np.sqrt(d)))
        w.add_tensor(p + "ffn_down.weight", mat(d, ff, 1.0 / np.sqrt(ff)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    os.replace(path + ".tmp", path)


def quantize(src, dst, ftype, requantize=False):
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    # A quantized source (the default model is Q4_1) is requantized: its values as they are.
    params.allow_requantize = requantize
    params.nthread = os.cpu_count() or 2
    tmp = dst + ".tmp"
    # llama.cpp logs every tensor to stderr: kept in a log beside the file, shown on failure.
    log = dst + ".quantize.log"
    saved = os.dup(2)
    with open(log, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    if rc != 0:
        sys.stderr.write(open(log).read())
        sys.exit(f"llama_model_quantize({ftype}) failed: {rc}")
    os.replace(tmp, dst)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--vocab", required=True, help="a GGUF whose tokenizer.* keys to copy")
    ap.add_argument("--out", required=True)
    ap.add_argument("--types", default="f16,q8_0")
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--source", help="quantize this GGUF instead of a synthetic one")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.source:
        base, f16 = os.path.splitext(os.path.basename(a.source))[0], a.source
    else:
        base = f"synth-{a.shape}-s{a.seed}"
        f16 = os.path.join(a.out, base + "-f16.gguf")
        if not os.path.exists(f16):
            write_f16(f16, a.shape, a.vocab, a.seed)
    for t in a.types.split(","):
        t = t.strip().lower()
        if t not in FTYPES:
            sys.exit(f"unknown type {t!r} (one of {', '.join(FTYPES)})")
        if t == "f16" and not a.source:
            print("f16", f16)
            continue
        path = os.path.join(a.out, f"{base}-{t}.gguf")
        if not os.path.exists(path):
            quantize(f16, path, t, requantize=bool(a.source))
        print(t, path)


if __name__ == "__main__":
    main()
