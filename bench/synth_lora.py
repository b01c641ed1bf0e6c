"""Synthetic LoRA adapters for differential tests and benchmarks (no model hub is reachable):
seeded random low-rank updates for a Hugging Face model directory's shapes, written as PEFT
writes them (adapter_config.json + adapter_model.safetensors) and, optionally, as the GGUF
LoRA llama.cpp's convert_lora_to_gguf.py writes; and the reference merge, W + (alpha/r)·B·A,
computed here with NumPy into a new model directory.

  synth_lora.py adapter BASE_DIR OUT_DIR --rank 16 --alpha 32 --seed 1 [--targets q,k,v,o,gate,up,down]
                [--layers 0,1,...] [--gguf FILE --gguf-arch llama]
  synth_lora.py merge BASE_DIR ADAPTER_DIR OUT_DIR

Run with scripts/reference-data's venv (NumPy, safetensors, gguf).
"""

import argparse, json, os, shutil, sys

import numpy as np
from safetensors.numpy import load_file, save_file

MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}

GGUF_STEMS = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}


def shapes(cfg):
    """(out, in) of each target module."""
    d = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim") or d // heads
    ff = cfg["intermediate_size"]
    return {
        "q": (heads * hd, d),
        "k": (kv * hd, d),
        "v": (kv * hd, d),
        "o": (d, heads * hd),
        "gate": (ff, d),
        "up": (ff, d),
        "down": (d, ff),
    }, hd


def permute_adjacent(b, n_head, hd):
    """Hugging Face Q/K rows to GGUF Llama's (RoPE pairs adjacent), as llama.cpp's converter
    permutes them: row h·d + s·d/2 + i goes to h·d + 2i + s."""
    return b.reshape(n_head, 2, hd // 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)


def adapter(a):
    cfg = json.load(open(os.path.join(a.base, "config.json")))
    shp, hd = shapes(cfg)
    targets = a.targets.split(",")
    layers = range(cfg["num_hidden_layers"]) if not a.layers else [int(x) for x in a.layers.split(",")]
    rng = np.random.default_rng(a.seed)
    tensors = {}
    gguf_tensors = []
    for l in layers:
        for t in targets:
            out, inp = shp[t]
            A = rng.normal(0.0, 1.0 / np.sqrt(inp), (a.rank, inp)).astype(np.float32)
            B = rng.normal(0.0, a.b_std, (out, a.rank)).astype(np.float32)
            name = f"base_model.model.model.layers.{l}.{MODULES[t]}"
            tensors[f"{name}.lora_A.weight"] = A
            tensors[f"{name}.lora_B.weight"] = B
            if a.gguf:
                if a.gguf_arch == "llama" and t in ("q", "k"):
                    heads = cfg["num_attention_heads"] if t == "q" else cfg.get("num_key_value_heads")
                    B = permute_adjacent(B, heads, hd)
                stem = f"blk.{l}.{GGUF_STEMS[t]}.weight"
                gguf_tensors += [(f"{stem}.lora_a", A), (f"{stem}.lora_b", B)]
    os.makedirs(a.out, exist_ok=True)
    save_file(tensors, os.path.join(a.out, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.basename(os.path.normpath(a.base)),
        "r": a.rank,
        "lora_alpha": a.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({MODULES[t].split(".")[1] for t in targets}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    with open(os.path.join(a.out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if a.gguf:
        import gguf

        w = gguf.GGUFWriter(a.gguf, a.gguf_arch)
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(a.alpha))
        for name, t in gguf_tensors:
            w.add_tensor(name, t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def merge(a):
    cfg = json.load(open(os.path.join(a.adapter, "adapter_config.json")))
    weights = load_file(os.path.join(a.adapter, "adapter_model.safetensors"))
    src = os.path.join(a.base, "model.safetensors")
    if not os.path.exists(src):
        sys.exit(f"{a.base}: merge reads a single model.safetensors")
    base = load_file(src)
    for key, A in weights.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[len("base_model.model.") : -len(".lora_A.weight")]
        B = weights[f"base_model.model.{module}.lora_B.weight"]
        r = A.shape[0]
        scale = cfg["lora_alpha"] / r
        W = base[f"{module}.weight"]
        merged = W.astype(np.float64) + scale * (B.astype(np.float64) @ A.astype(np.float64))
        base[f"{module}.weight"] = merged.astype(W.dtype)
    os.makedirs(a.out, exist_ok=True)
    save_file(base, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(a.base):
        if f.endswith(".json") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(a.base, f), os.path.join(a.out, f))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("adapter")
    p.add_argument("base")
    p.add_argument("out")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--b-std", type=float, default=0.02)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down")
    p.add_argument("--layers", default="")
    p.add_argument("--gguf", default="")
    p.add_argument("--gguf-arch", default="llama")
    p.set_defaults(run=adapter)
    p = sub.add_parser("merge")
    p.add_argument("base")
    p.add_argument("adapter")
    p.add_argument("out")
    p.set_defaults(run=merge)
    a = ap.parse_args()
    a.run(a)


if __name__ == "__main__":
    main()
