"""Prints Hearth and llama.cpp side by side with ratios and the engine-speed targets, from
the two JSON reports."""
import json, sys

h = json.load(open(sys.argv[1]))
l = json.load(open(sys.argv[2]))
# (label, key, higher is better, target on the Hearth/llama.cpp ratio or None)
rows = [
    ("model load (s)", "load_s", False, None),
    ("prefill, 512 tokens (tok/s)", "prefill_512_tok_s", True, 2.0),
    ("decode, 1 stream (tok/s)", "decode_1_tok_s", True, 1.2),
    ("decode, 8 streams (tok/s)", "decode_8_tok_s", True, None),
    ("decode, 32 streams (tok/s)", "decode_32_tok_s", True, 3.0),
    ("TTFT 1000 tokens, cold (ms)", "ttft_1000_cold_ms", False, 0.5),
    ("TTFT 1000 tokens, 900 cached (ms)", "ttft_1000_cached_900_ms", False, None),
    ("peak RSS (MiB)", "peak_rss_mib", False, 1.0),
]
print(f"Hearth:    isa {h.get('isa', '?')}, KV {h.get('kv_dtype', '?')} (cpu: {h.get('cpu', '?')})")
print(f"llama.cpp: {l.get('isa', '?')}")
print(f"{'measure':<36} {'Hearth':>10} {'llama.cpp':>10} {'ratio':>8}  target")
out = {"hearth": h, "llamacpp": l, "ratios": {}, "targets": {}}
for name, key, higher_better, target in rows:
    hv, lv = h[key], l[key]
    ratio = hv / lv if lv else float("nan")
    out["ratios"][key] = ratio
    goal = ""
    if target is not None:
        met = ratio >= target if higher_better else ratio <= target
        goal = f"{'>=' if higher_better else '<='} {target:.2f}x {'met' if met else 'MISSED'}"
        out["targets"][key] = {"target": target, "met": met}
    print(f"{name:<36} {hv:>10.1f} {lv:>10.1f} {ratio:>7.2f}x  {goal}")
cached = h["ttft_cached_over_cold"]
met = cached <= 0.25
out["targets"]["ttft_cached_over_cold"] = {"target": 0.25, "met": met}
print(f"{'Hearth cached TTFT / cold TTFT':<36} {cached:>10.2f} {'':>10} {'':>8}  <= 0.25 {'met' if met else 'MISSED'}")
if "decode_limit_tok_s" in h:
    frac = h["decode_1_of_limit"]
    out["targets"]["decode_1_of_dram_limit"] = {"target": 0.75, "met": frac >= 0.75}
    print(f"DRAM read {h['dram_read_gb_s']:.1f} GB/s, {h['weight_mb_per_token']:.0f} MB of weights a token: "
          f"decode limit {h['decode_limit_tok_s']:.1f} tok/s; Hearth decode 1 at {100 * frac:.0f} % "
          f"(target >= 75 % {'met' if frac >= 0.75 else 'MISSED'}), llama.cpp at "
          f"{100 * l['decode_1_tok_s'] / h['decode_limit_tok_s']:.0f} %")
if len(sys.argv) > 3:
    json.dump(out, open(sys.argv[3], "w"), indent=2)
