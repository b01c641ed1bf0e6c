#!/usr/bin/env python3
"""The PyTorch anchor of `bench/gpu-check`: Hugging Face transformers' eager decode of the
same GGUF (dequantized by transformers through the `gguf` package) on the same GPU, at the
same batch sizes as hearth-gpu-check; and `--compare` prints the two side by side.

    gpu_check_torch.py --gguf MODEL.gguf --json OUT [--streams 1,8,32] [--prompt-tokens 128]
                       [--decode-tokens 64] [--prefill-tokens 512]
    gpu_check_torch.py --compare hearth.json torch.json
"""
import argparse
import json
import os
import sys
import time


def measure(a):
    import torch
    from transformers import AutoModelForCausalLM

    d, name = os.path.dirname(a.gguf), os.path.basename(a.gguf)
    dtype = torch.float16
    try:  # transformers 5 names it `dtype`; 4.x `torch_dtype`
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype, attn_implementation="eager")
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, torch_dtype=dtype, attn_implementation="eager")
    model = model.to("cuda").eval()
    out = {"torch": torch.__version__, "dtype": str(dtype), "attention": "eager", "decode": []}
    import transformers
    out["transformers"] = transformers.__version__

    def sync():
        torch.cuda.synchronize()

    with torch.inference_mode():
        ids = (torch.arange(a.prefill_tokens, device="cuda") * 7919 % 40000 + 100).unsqueeze(0)

        # Only the last position's logits, as Hearth computes them, where this transformers
        # version can say so (`logits_to_keep`, earlier `num_logits_to_keep`).
        import inspect
        params = inspect.signature(model.forward).parameters
        keep = next(({k: 1} for k in ("logits_to_keep", "num_logits_to_keep") if k in params), {})
        out["prefill_last_logits_only"] = bool(keep)

        def prefill():
            return model(ids, **keep)

        prefill()
        sync()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            prefill()
            sync()
            times.append((time.perf_counter() - t) * 1e3)
        times.sort()
        out["prefill"] = {"tokens": a.prefill_tokens, "ms": times[2], "tokens_per_s": a.prefill_tokens / times[2] * 1e3}
        print(f"torch prefill {a.prefill_tokens} tokens: {times[2]:.2f} ms")
        for b in a.streams:
            prompt = (torch.arange(b * a.prompt_tokens, device="cuda").view(b, a.prompt_tokens) * 7919 % 40000 + 100)
            res = model(prompt, use_cache=True)
            past = res.past_key_values
            tok = res.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            # One warm-up step, then timed steps: the same loop as hearth-gpu-check's.
            res = model(tok, past_key_values=past, use_cache=True)
            past, tok = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            t = time.perf_counter()
            steps = a.decode_tokens - 1
            for _ in range(steps):
                res = model(tok, past_key_values=past, use_cache=True)
                past, tok = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
                tok.cpu()  # the host sees each token, as a server streams it
            secs = time.perf_counter() - t
            tps = b * steps / secs
            out["decode"].append({"streams": b, "ms_per_step": secs * 1e3 / steps, "tokens_per_s": tps})
            print(f"torch decode {b:>2} streams: {secs * 1e3 / steps:.3f} ms/step, {tps:.0f} tokens/s")
    with open(a.json, "w") as f:
        json.dump(out, f, indent=2)


def compare(hearth_path, torch_path):
    if not os.path.exists(hearth_path):
        print(f"(no {hearth_path}: hearth-gpu-check did not finish; see hearth.log)")
        return 1
    h = json.load(open(hearth_path))
    t = json.load(open(torch_path)) if os.path.exists(torch_path) else None
    g = h["golden"]
    print(f"\n== GPU check: {h['device']['name']}")
    print(f"golden answer identical: {g['answer'] == g['expected']}  top-5 GPU {g['top5_gpu']} CPU {g['top5_cpu']}  "
          f"max |dlogit| first {g['max_abs_logit_diff_first']:.4f} decode {g['max_abs_logit_diff_decode']:.4f}")
    print(f"KV blocks read/write/copy identical: {h['kv_blocks_identical']}  "
          f"graph replay vs eager max |dlogit|: {h['graph_vs_eager_max_abs_diff']:.5f}  "
          f"all checks passed: {h['ok']}")
    p = h["prefill"]
    line = f"prefill {p['tokens']} tokens: hearth {p['ms']:.2f} ms (target < 20 ms)"
    if t:
        line += f", torch eager {t['prefill']['ms']:.2f} ms"
    print(line)
    print("| streams | hearth graphs tok/s | hearth no graphs tok/s | torch eager tok/s | hearth / torch |")
    print("|---|---|---|---|---|")
    for b in sorted({d["streams"] for d in h["decode"]}):
        on = next((d["tokens_per_s"] for d in h["decode"] if d["streams"] == b and d["graphs"]), None)
        off = next((d["tokens_per_s"] for d in h["decode"] if d["streams"] == b and not d["graphs"]), None)
        te = next((d["tokens_per_s"] for d in t["decode"] if d["streams"] == b), None) if t else None
        ratio = f"{on / te:.2f}x" if on and te else "-"
        print(f"| {b} | {on or 0:.0f} | {off or 0:.0f} | {te or 0:.0f} | {ratio} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf")
    ap.add_argument("--json")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--compare", nargs=2)
    a = ap.parse_args()
    if a.compare:
        return compare(*a.compare)
    a.streams = [int(s) for s in a.streams.split(",")]
    if not a.gguf or not a.json:
        ap.error("--gguf and --json are required")
    measure(a)


if __name__ == "__main__":
    sys.exit(main())
