"""Synthetic models for differential tests and benchmarks: seeded random weights with a real
tokenizer, written as GGUF with the `gguf` package, then quantized by llama.cpp's own
quantizer (`llama_model_quantize`, through llama-cpp-python).

Usage: synth_model.py --shape NAME --reference DIR --out DIR [--types f16,q8_0,q4_k_m,...]
Prints one line per file written: TYPE PATH. Files are reused when present (same seed, same
bytes)."""
import argparse, ctypes, math, os, sys

import numpy as np
import gguf

# Shapes. `arch` is the GGUF architecture; `vocab` the llama.cpp vocabulary file whose
# tokenizer the model takes (ggml-vocab-NAME.gguf) and `template` the chat template of
# llama.cpp's models/templates it carries (None: the vocabulary file's own).
BASE = dict(arch="llama", d=256, layers=2, ff=768, heads=4, kv_heads=2, head_dim=None, ctx=2048,
            theta=10000.0, tied=False, vocab="llama-bpe", template=None)
SHAPES = {
    # Small enough for a test to run llama.cpp and Hearth on several types in seconds.
    "tiny": dict(),
    # Llama-3.2-1B's shape (larger than any L3 cache: ~0.8 GB at Q4_K_M).
    "llama-1b": dict(d=2048, layers=16, ff=8192, heads=32, kv_heads=8, ctx=8192, theta=500000.0, tied=True,
                     embed_std=1.0),
    # One per family, each with its real tokenizer and chat template. Windows are short so
    # that 64 generated tokens cross them.
    "llama3-tiny": dict(theta=500000.0, rope_freqs=dict(factor=8.0, low=1.0, high=4.0, orig=256),
                        template="meta-llama-Llama-3.1-8B-Instruct"),
    # llama.cpp stores Mistral as `llama` and ignores its window: a window longer than the
    # test's sequences keeps both engines comparable (Gemma's windows are checked below).
    "mistral-tiny": dict(vocab="llama-spm", sliding_window=4096, template="mistralai-Mistral-Nemo-Instruct-2407"),
    "qwen2-tiny": dict(arch="qwen2", vocab="qwen2", qkv_bias=True, theta=1000000.0,
                       template="Qwen-Qwen2.5-7B-Instruct"),
    "qwen3-tiny": dict(arch="qwen3", vocab="qwen2", head_dim=128, qk_norm=True, theta=1000000.0,
                       tied=True, template="Qwen-Qwen3-0.6B"),
    # Gemma 2/3 GGUFs carry SentencePiece (`llama`) vocabularies, as llama-spm's.
    "gemma2-tiny": dict(arch="gemma2", vocab="llama-spm", heads=4, kv_heads=2, head_dim=256, tied=True,
                        gemma=True, attn_softcap=50.0, final_softcap=30.0, sliding_window=32,
                        template="google-gemma-2-2b-it"),
    "gemma3-tiny": dict(arch="gemma3", vocab="llama-spm", layers=6, head_dim=128, tied=True, gemma=True,
                        qk_norm=True, sliding_window=32, theta=1000000.0, theta_swa=10000.0,
                        linear_scale=8.0, template="google-gemma-2-2b-it"),
    "phi3-tiny": dict(arch="phi3", vocab="phi-3", fused=True, template="microsoft-Phi-3.5-mini-instruct"),
    # Mixtures of experts and latent attention. Mixtral: `llama` with 8 experts, 2 used.
    "mixtral-tiny": dict(vocab="llama-spm", ff=512, moe=dict(experts=8, used=2),
                         template="mistralai-Mistral-Nemo-Instruct-2407"),
    # Qwen3-MoE: Qwen3's attention, 16 experts of 256, 4 used.
    "qwen3moe-tiny": dict(arch="qwen3moe", vocab="qwen2", layers=3, head_dim=128, qk_norm=True, theta=1000000.0,
                          moe=dict(experts=16, used=4, ff_exp=256), template="Qwen-Qwen3-0.6B"),
    # DeepSeek-V3's block: latent attention (queries through a rank of 256, a latent of 256
    # plus a 64-dim RoPE key), YaRN ×4 with its score correction, one dense layer, then 16
    # experts in 4 groups (2 used) choosing 4 by sigmoid with a selection bias, one shared
    # expert, weights renormalized and scaled by 2.5.
    "deepseek2-tiny": dict(arch="deepseek2", vocab="deepseek-llm", layers=3, ff=512, heads=4,
                           mla=dict(q_lora=256, kv_lora=256, rope=64, nope=128, v=128),
                           moe=dict(experts=16, used=4, ff_exp=256, shared=1, dense=1, groups=4, groups_used=2,
                                    sigmoid=True, norm=True, scale=2.5),
                           yarn=dict(factor=4.0, orig=512, log_mul=1.0), theta=10000.0,
                           template="deepseek-ai-DeepSeek-V3.1"),
    # Phi-3 128k's LongRoPE as llama.cpp's converter writes it: long and short factor sets,
    # the original context and an attention factor, no scaling type.
    "phi3-longrope-tiny": dict(arch="phi3", vocab="phi-3", fused=True, ctx=4096, longrope=dict(orig=1024, attn=1.19),
                               template="microsoft-Phi-3.5-mini-instruct"),
    # The benchmarks' shapes: Qwen3-0.6B's (~0.65 GB at Q8_0) and a Gemma-2 of ~0.8 GB, each
    # with a plain-Llama twin of the same dimensions (the new pieces' cost).
    "qwen3-0.6b": dict(arch="qwen3", vocab="qwen2", d=1024, layers=28, ff=3072, heads=16, kv_heads=8,
                       head_dim=128, qk_norm=True, theta=1000000.0, tied=True, ctx=40960,
                       template="Qwen-Qwen3-0.6B"),
    "llama-as-qwen3-0.6b": dict(vocab="qwen2", d=1024, layers=28, ff=3072, heads=16, kv_heads=8,
                                head_dim=128, theta=1000000.0, tied=True, ctx=40960),
    # DeepSeek's latent attention with every layer dense (no routing).
    "deepseek2-mla-tiny": dict(arch="deepseek2", vocab="deepseek-llm", layers=3, ff=512, heads=4,
                               mla=dict(q_lora=256, kv_lora=256, rope=64, nope=128, v=128),
                               moe=dict(experts=16, used=4, ff_exp=256, shared=1, dense=3, sigmoid=True, norm=True),
                               yarn=dict(factor=4.0, orig=512, log_mul=1.0), theta=10000.0,
                               template="deepseek-ai-DeepSeek-V3.1"),
    # ~1 GB at Q4_K_M: Qwen3-30B-A3B's routing (8 of 64 experts) at a width one core runs.
    "qwen3moe-1g": dict(arch="qwen3moe", vocab="qwen2", d=1024, layers=16, ff=3072, heads=16, kv_heads=4,
                        head_dim=128, qk_norm=True, theta=1000000.0, ctx=40960,
                        moe=dict(experts=64, used=8, ff_exp=512), template="Qwen-Qwen3-0.6B"),
    # DeepSeek-V3's block at the same scale: latent 512 + 64 as V3's, 1 dense then MoE layers.
    "deepseek2-1g": dict(arch="deepseek2", vocab="deepseek-llm", d=1024, layers=16, ff=3072, heads=16, ctx=16384,
                         mla=dict(q_lora=512, kv_lora=512, rope=64, nope=128, v=128),
                         moe=dict(experts=64, used=8, ff_exp=512, shared=1, dense=1, groups=8, groups_used=4,
                                  sigmoid=True, norm=True, scale=2.5),
                         yarn=dict(factor=4.0, orig=4096, log_mul=1.0), theta=10000.0,
                         template="deepseek-ai-DeepSeek-V3.1"),
    "gemma2-0.8b": dict(arch="gemma2", vocab="gemma-4", d=1536, layers=10, ff=6144, heads=8, kv_heads=4,
                        head_dim=256, tied=True, gemma=True, attn_softcap=50.0, final_softcap=30.0,
                        sliding_window=4096, ctx=8192, template="google-gemma-2-2b-it"),
    "llama-as-gemma2-0.8b": dict(vocab="gemma-4", d=1536, layers=10, ff=6144, heads=8, kv_heads=4,
                                 head_dim=256, tied=True, ctx=8192),
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


def llama3_factors(dims, theta, f):
    """Llama 3.1's RoPE factors, as llama.cpp's converter computes them (`rope_freqs`)."""
    freqs = 1.0 / (theta ** (np.arange(0, dims, 2, dtype=np.float32) / dims))
    low_wavelen, high_wavelen = f["orig"] / f["low"], f["orig"] / f["high"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(f["factor"])
        else:
            smooth = (f["orig"] / wavelen - f["low"]) / (f["high"] - f["low"])
            out.append(1 / ((1 - smooth) / f["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def write_f16(path, shape, reference, seed):
    s = dict(BASE, **SHAPES[shape])
    d, layers, ff, heads, kv_heads = s["d"], s["layers"], s["ff"], s["heads"], s["kv_heads"]
    head_dim = s["head_dim"] or d // heads
    # A temporary name of this process's own: test binaries may ask for the same file at once.
    tmp = f"{path}.{os.getpid()}.tmp"
    w = gguf.GGUFWriter(tmp, s["arch"])
    w.add_name(f"hearth-synth-{shape}")
    w.add_context_length(s["ctx"])
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(1 if s.get("mla") else kv_heads)
    arch = s["arch"]
    mla, moe = s.get("mla"), s.get("moe")
    if mla:
        w.add_uint32(f"{arch}.attention.q_lora_rank", mla["q_lora"])
        w.add_uint32(f"{arch}.attention.kv_lora_rank", mla["kv_lora"])
        w.add_uint32(f"{arch}.attention.key_length", mla["kv_lora"] + mla["rope"])
        w.add_uint32(f"{arch}.attention.value_length", mla["kv_lora"])
        w.add_uint32(f"{arch}.attention.key_length_mla", mla["nope"] + mla["rope"])
        w.add_uint32(f"{arch}.attention.value_length_mla", mla["v"])
        w.add_rope_dimension_count(mla["rope"])
    else:
        if s["head_dim"]:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
    if moe:
        w.add_uint32(f"{arch}.expert_count", moe["experts"])
        w.add_uint32(f"{arch}.expert_used_count", moe["used"])
        if "ff_exp" in moe:
            w.add_uint32(f"{arch}.expert_feed_forward_length", moe["ff_exp"])
        if arch == "deepseek2":
            w.add_uint32(f"{arch}.expert_shared_count", moe.get("shared", 0))
            w.add_uint32(f"{arch}.leading_dense_block_count", moe.get("dense", 0))
            w.add_float32(f"{arch}.expert_weights_scale", moe.get("scale", 1.0))
            w.add_bool(f"{arch}.expert_weights_norm", moe.get("norm", False))
            w.add_uint32(f"{arch}.expert_gating_func", 2 if moe.get("sigmoid") else 1)
            if moe.get("groups"):
                w.add_uint32(f"{arch}.expert_group_count", moe["groups"])
                w.add_uint32(f"{arch}.expert_group_used_count", moe["groups_used"])
    if "yarn" in s:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s["yarn"]["factor"])
        w.add_rope_scaling_orig_ctx_len(s["yarn"]["orig"])
        # As llama.cpp's converter writes DeepSeek's `mscale_all_dim`: times 0.1.
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1 * s["yarn"]["log_mul"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(1e-5 if s["arch"] in ("llama", "phi3") else 1e-6)
    w.add_file_type(1)
    if "sliding_window" in s:
        w.add_sliding_window(s["sliding_window"])
    if "attn_softcap" in s:
        w.add_attn_logit_softcapping(s["attn_softcap"])
        w.add_final_logit_softcapping(s["final_softcap"])
    if "theta_swa" in s:
        w.add_rope_freq_base_swa(s["theta_swa"])
    if "longrope" in s:
        w.add_rope_scaling_orig_ctx_len(s["longrope"]["orig"])
        w.add_rope_scaling_attn_factors(s["longrope"]["attn"])
    if "linear_scale" in s:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s["linear_scale"])
    vocab = copy_tokenizer(w, os.path.join(reference, "vocab", f"ggml-vocab-{s['vocab']}.gguf"))
    w.add_vocab_size(vocab)
    if s["template"]:
        w.add_chat_template(open(os.path.join(reference, "templates", s["template"] + ".jinja")).read())
    rng = np.random.default_rng(seed)

    def mat(rows, cols, std):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16)

    def mats(n, rows, cols, std):
        return (rng.standard_normal((n, rows, cols), dtype=np.float32) * std).astype(np.float16)

    def mlp(p, suffix, width):
        """A gated MLP's three matrices (a dense layer's, or DeepSeek's shared experts')."""
        w.add_tensor(p + f"ffn_gate{suffix}.weight", mat(width, d, 1.0 / np.sqrt(d)))
        w.add_tensor(p + f"ffn_up{suffix}.weight", mat(width, d, 1.0 / np.sqrt(d)))
        w.add_tensor(p + f"ffn_down{suffix}.weight", mat(d, width, 1.0 / np.sqrt(width)))

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    def bias(n):
        return (0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    # Scales that keep the residual stream and the logits of a random model well spread, so
    # that greedy decoding is not a sequence of near-ties.
    # Tied embeddings are smaller too: a token's own row would otherwise dominate its logits
    # (Gemma's are scaled by √d on the way in, so smaller still).
    embed_std = s.get("embed_std", 2.0 / np.sqrt(d) if s["tied"] else 1.0)
    out_norm = norm(d)
    if s.get("gemma"):
        # Small rows (the residual stream is not the input token again), a large final
        # norm (the logits still spread).
        embed_std = 0.15 / np.sqrt(d)
        out_norm *= 12.0
    w.add_tensor("token_embd.weight", mat(vocab, d, embed_std))
    w.add_tensor("output_norm.weight", out_norm)
    if not s["tied"]:
        w.add_tensor("output.weight", mat(vocab, d, 2.0 / np.sqrt(d)))
    if "rope_freqs" in s:
        w.add_tensor("rope_freqs.weight", llama3_factors(head_dim, s["theta"], s["rope_freqs"]))
    if "longrope" in s:
        pairs = np.arange(head_dim // 2, dtype=np.float32) / (head_dim // 2)
        w.add_tensor("rope_factors_short.weight", (1.0 + 0.5 * pairs ** 2).astype(np.float32))
        w.add_tensor("rope_factors_long.weight", (1.0 + 7.0 * pairs ** 2).astype(np.float32))
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(d))
        if mla:
            kh, nh = mla["nope"] + mla["rope"], heads
            w.add_tensor(p + "attn_q_a.weight", mat(mla["q_lora"], d, 1.0 / np.sqrt(d)))
            w.add_tensor(p + "attn_q_a_norm.weight", norm(mla["q_lora"]))
            w.add_tensor(p + "attn_q_b.weight", mat(nh * kh, mla["q_lora"], 1.0 / np.sqrt(mla["q_lora"])))
            w.add_tensor(p + "attn_kv_a_mqa.weight", mat(mla["kv_lora"] + mla["rope"], d, 1.0 / np.sqrt(d)))
            w.add_tensor(p + "attn_kv_a_norm.weight", norm(mla["kv_lora"]))
            # Per head: the latent to the key without RoPE, and to the value (3-D tensors).
            w.add_tensor(p + "attn_k_b.weight", mats(nh, mla["kv_lora"], mla["nope"], 1.0 / np.sqrt(mla["nope"])))
            w.add_tensor(p + "attn_v_b.weight", mats(nh, mla["v"], mla["kv_lora"], 1.0 / np.sqrt(mla["kv_lora"])))
            w.add_tensor(p + "attn_output.weight", mat(d, nh * mla["v"], 1.0 / np.sqrt(nh * mla["v"])))
        else:
            if s.get("fused"):
                w.add_tensor(p + "attn_qkv.weight", mat(q + 2 * kv, d, 1.0 / np.sqrt(d)))
            else:
                w.add_tensor(p + "attn_q.weight", mat(q, d, 1.0 / np.sqrt(d)))
                w.add_tensor(p + "attn_k.weight", mat(kv, d, 1.0 / np.sqrt(d)))
                w.add_tensor(p + "attn_v.weight", mat(kv, d, 1.0 / np.sqrt(d)))
            if s.get("qkv_bias"):
                w.add_tensor(p + "attn_q.bias", bias(q))
                w.add_tensor(p + "attn_k.bias", bias(kv))
                w.add_tensor(p + "attn_v.bias", bias(kv))
            if s.get("qk_norm"):
                w.add_tensor(p + "attn_q_norm.weight", norm(head_dim))
                w.add_tensor(p + "attn_k_norm.weight", norm(head_dim))
            w.add_tensor(p + "attn_output.weight", mat(d, q, 1.0 / np.sqrt(q)))
        w.add_tensor(p + "ffn_norm.weight", norm(d))
        if moe and i >= moe.get("dense", 0):
            n, fe = moe["experts"], moe.get("ff_exp", ff)
            # A router spread wide (logits of std 6) so that the chosen experts are rarely
            # near-ties: a tie broken differently by two engines' rounding swaps an expert.
            w.add_tensor(p + "ffn_gate_inp.weight", mat(n, d, 6.0 / np.sqrt(d)).astype(np.float32))
            if moe.get("sigmoid"):
                w.add_tensor(p + "exp_probs_b.bias", bias(n))
            w.add_tensor(p + "ffn_gate_exps.weight", mats(n, fe, d, 1.0 / np.sqrt(d)))
            w.add_tensor(p + "ffn_up_exps.weight", mats(n, fe, d, 1.0 / np.sqrt(d)))
            # The routed scaling factor multiplies the experts' sum: their outputs are that
            # much smaller, so that the residual stream stays as spread as a dense model's.
            w.add_tensor(p + "ffn_down_exps.weight", mats(n, d, fe, 1.0 / np.sqrt(fe) / moe.get("scale", 1.0)))
            if moe.get("shared"):
                mlp(p, "_shexp", fe * moe["shared"])
        elif s.get("fused"):
            w.add_tensor(p + "ffn_up.weight", mat(2 * ff, d, 1.0 / np.sqrt(d)))
            w.add_tensor(p + "ffn_down.weight", mat(d, ff, 1.0 / np.sqrt(ff)))
        else:
            mlp(p, "", ff)
        if s.get("gemma"):
            w.add_tensor(p + "post_attention_norm.weight", norm(d))
            w.add_tensor(p + "post_ffw_norm.weight", norm(d))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    os.replace(tmp, path)


def quantize(src, dst, ftype, requantize=False):
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    # A quantized source (the default model is Q4_1) is requantized: its values as they are.
    params.allow_requantize = requantize
    params.nthread = os.cpu_count() or 2
    tmp = f"{dst}.{os.getpid()}.tmp"
    # llama.cpp logs every tensor to stderr: kept in a log beside the file, shown on failure.
    log = f"{dst}.{os.getpid()}.quantize.log"
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
    os.replace(log, dst + ".quantize.log")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--reference", required=True, help="scripts/reference-data's directory (vocab/, templates/)")
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
            write_f16(f16, a.shape, a.reference, a.seed)
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
