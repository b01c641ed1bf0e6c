"""Prints Hearth and llama.cpp side by side with ratios, from the two JSON reports."""
import json, sys

h = json.load(open(sys.argv[1]))
l = json.load(open(sys.argv[2]))
rows = [
    ("model load (s)", "load_s", False),
    ("prefill, 512 tokens (tok/s)", "prefill_512_tok_s", True),
    ("decode, 1 stream (tok/s)", "decode_1_tok_s", True),
    ("decode, 8 streams (tok/s)", "decode_8_tok_s", True),
    ("decode, 32 streams (tok/s)", "decode_32_tok_s", True),
    ("TTFT 1000 tokens, cold (ms)", "ttft_1000_cold_ms", False),
    ("TTFT 1000 tokens, 900 cached (ms)", "ttft_1000_cached_900_ms", False),
    ("peak RSS (MiB)", "peak_rss_mib", False),
]
print(f"{'measure':<36} {'Hearth':>10} {'llama.cpp':>10} {'Hearth/llama.cpp':>17}")
out = {"hearth": h, "llamacpp": l, "ratios": {}}
for name, key, higher_better in rows:
    hv, lv = h[key], l[key]
    ratio = hv / lv if lv else float("nan")
    out["ratios"][key] = ratio
    note = "(higher is better)" if higher_better else "(lower is better)"
    print(f"{name:<36} {hv:>10.1f} {lv:>10.1f} {ratio:>10.2f}x {note}")
if len(sys.argv) > 3:
    json.dump(out, open(sys.argv[3], "w"), indent=2)
