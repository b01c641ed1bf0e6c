"""Gateway overhead side by side: the LiteLLM proxy vs Hearth's gateway, each in front of
the same instant backend, in one run.

The backend is `hearth serve --backend sim` (the real scheduler with a cost model compressed
100,000×), reached (a) directly, (b) through the LiteLLM proxy (one worker, master key, no
database), each request alternating between the two. LiteLLM's added latency is (b) − (a);
Hearth's own added latency (auth + limits + budget + metering) comes from
`hearth bench gateway`, run by the wrapper script in the same run.

usage: litellm_compare.py DIRECT_URL DIRECT_KEY LITELLM_URL MODEL [--requests N] [--seconds S]
       [--hearth-json FILE] [--json FILE]
"""

import argparse
import asyncio
import json
import statistics
import time

import httpx


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round((len(xs) - 1) * p))]


async def throughput(url, key, body, seconds, concurrency=32):
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as c:
        deadline = time.perf_counter() + seconds
        done = 0
        errors = 0

        async def worker():
            nonlocal done, errors
            while time.perf_counter() < deadline:
                r = await c.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
                if r.status_code == 200:
                    done += 1
                else:
                    errors += 1

        t = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return done / (time.perf_counter() - t), errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("direct")
    ap.add_argument("direct_key")
    ap.add_argument("litellm")
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--hearth-json")
    ap.add_argument("--json")
    a = ap.parse_args()
    body = {"model": a.model, "max_tokens": 8, "messages": [{"role": "user", "content": "Say something short about the sea."}]}
    targets = [("direct", a.direct, a.direct_key), ("litellm", a.litellm, "sk-hearth-bench")]
    lat = {n: [] for n, _, _ in targets}
    with httpx.Client(timeout=60) as c:
        for i in range(a.requests + 20):
            for name, url, key in targets:
                t = time.perf_counter()
                r = c.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
                dt = (time.perf_counter() - t) * 1e6
                if r.status_code != 200:
                    raise SystemExit(f"{name}: {r.status_code} {r.text[:300]}")
                if i >= 20:
                    lat[name].append(dt)
    rps = {}
    for name, url, key in targets:
        rps[name], _ = asyncio.run(throughput(url, key, body, a.seconds))
    p50 = {n: pct(v, 0.5) for n, v in lat.items()}
    litellm_added = p50["litellm"] - p50["direct"]
    out = {
        "requests": a.requests,
        "direct_p50_us": p50["direct"],
        "litellm_p50_us": p50["litellm"],
        "litellm_added_p50_us": litellm_added,
        "litellm_requests_per_s": rps["litellm"],
        "direct_requests_per_s": rps["direct"],
    }
    hearth = None
    if a.hearth_json:
        with open(a.hearth_json) as f:
            hearth = {m["mode"]: m for m in json.load(f)["modes"]}
        out["hearth"] = hearth
    print(f"gateway overhead in front of an instant backend ({a.requests} sequential requests each; 32 clients for throughput)\n")
    print(f"{'gateway':<34} {'added p50 µs':>14} {'req/s':>10}")
    print(f"{'LiteLLM proxy (1 worker, master key)':<34} {litellm_added:>14.1f} {rps['litellm']:>10.0f}")
    if hearth:
        for mode, label in [("in_process", "Hearth (auth+limits+metering)"), ("redis", "Hearth (limits in Redis)")]:
            if mode in hearth:
                m = hearth[mode]
                print(f"{label:<34} {m['added_p50_us']:>14.1f} {m['requests_per_s']:>10.0f}")
        m = hearth["in_process"]
        print(
            f"\nLiteLLM adds {litellm_added / max(m['added_p50_us'], 1.0):.0f}× Hearth's latency; Hearth sustains "
            f"{m['requests_per_s'] / max(rps['litellm'], 1e-9):.0f}× LiteLLM's requests/s"
        )
    print(f"(direct to the backend: p50 {p50['direct']:.0f} µs, {rps['direct']:.0f} req/s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
