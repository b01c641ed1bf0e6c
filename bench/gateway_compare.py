"""Gateway overhead side by side: peer gateways (the LiteLLM proxy, the Portkey AI Gateway)
vs Hearth's gateway, each in front of the same instant backend, in one run.

The backend is `hearth serve --backend sim` (the real scheduler with a cost model compressed
100,000×), reached directly and through each peer, requests rotating between them so that
drift hits all alike. A peer's added latency is its P50 minus the direct P50. Hearth's own
added latency (auth + limits + budget + metering) comes from `hearth bench gateway`, run by
the wrapper script in the same run (its JSON is read here).

usage: gateway_compare.py DIRECT_URL DIRECT_KEY [--litellm URL] [--portkey URL] --model M
       [--requests N] [--seconds S] [--hearth-json FILE] [--json FILE]
"""

import argparse
import asyncio
import json
import time

import httpx


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round((len(xs) - 1) * p))]


async def throughput(url, headers, body, seconds, concurrency=32):
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as c:
        deadline = time.perf_counter() + seconds
        done = 0
        errors = 0

        async def worker():
            nonlocal done, errors
            while time.perf_counter() < deadline:
                r = await c.post(url, json=body, headers=headers)
                if r.status_code == 200:
                    done += 1
                else:
                    errors += 1

        t = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return done / (time.perf_counter() - t), errors


LABELS = {
    "litellm": "LiteLLM proxy 1.108.7 (1 worker, master key)",
    "portkey": "Portkey AI Gateway 1.15.2 (Node)",
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("direct")
    ap.add_argument("direct_key")
    ap.add_argument("--litellm")
    ap.add_argument("--portkey")
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--hearth-json")
    ap.add_argument("--json")
    a = ap.parse_args()
    body = {"model": a.model, "max_tokens": 8, "messages": [{"role": "user", "content": "Say something short about the sea."}]}
    backend = a.direct.rsplit("/chat/completions", 1)[0]
    targets = [("direct", a.direct, {"Authorization": f"Bearer {a.direct_key}"})]
    if a.litellm:
        targets.append(("litellm", a.litellm, {"Authorization": "Bearer sk-hearth-bench"}))
    if a.portkey:
        targets.append(
            (
                "portkey",
                a.portkey,
                {
                    "Authorization": f"Bearer {a.direct_key}",
                    "x-portkey-provider": "openai",
                    "x-portkey-custom-host": backend,
                },
            )
        )
    lat = {n: [] for n, _, _ in targets}
    with httpx.Client(timeout=60) as c:
        for i in range(a.requests + 20):
            for name, url, headers in targets:
                t = time.perf_counter()
                r = c.post(url, json=body, headers=headers)
                dt = (time.perf_counter() - t) * 1e6
                if r.status_code != 200:
                    raise SystemExit(f"{name}: {r.status_code} {r.text[:300]}")
                if i >= 20:
                    lat[name].append(dt)
    rps = {}
    for name, url, headers in targets:
        rps[name], _ = asyncio.run(throughput(url, headers, body, a.seconds))
    p50 = {n: pct(v, 0.5) for n, v in lat.items()}
    out = {"requests": a.requests, "direct_p50_us": p50["direct"], "direct_requests_per_s": rps["direct"], "peers": {}}
    for name, _, _ in targets[1:]:
        out["peers"][name] = {
            "p50_us": p50[name],
            "p99_us": pct(lat[name], 0.99),
            "added_p50_us": p50[name] - p50["direct"],
            "requests_per_s": rps[name],
        }
    hearth = None
    if a.hearth_json:
        with open(a.hearth_json) as f:
            hearth = {m["mode"]: m for m in json.load(f)["modes"]}
        out["hearth"] = hearth
    print(f"gateway overhead in front of an instant backend ({a.requests} sequential requests each; 32 clients for throughput)\n")
    print(f"{'gateway':<46} {'added p50 µs':>14} {'req/s':>10}")
    for name, peer in out["peers"].items():
        print(f"{LABELS[name]:<46} {peer['added_p50_us']:>14.1f} {peer['requests_per_s']:>10.0f}")
    if hearth:
        for mode, label in [("in_process", "Hearth (auth+limits+budget+metering)"), ("redis", "Hearth (limits in Redis)")]:
            if mode in hearth:
                m = hearth[mode]
                print(f"{label:<46} {m['added_p50_us']:>14.1f} {m['requests_per_s']:>10.0f}")
        m = hearth["in_process"]
        for name, peer in out["peers"].items():
            print(
                f"\n{name}: adds {peer['added_p50_us'] / max(m['added_p50_us'], 1.0):.0f}× Hearth's latency; Hearth sustains "
                f"{m['requests_per_s'] / max(peer['requests_per_s'], 1e-9):.0f}× its requests/s",
                end="",
            )
        print()
    print(f"(direct to the backend: p50 {p50['direct']:.0f} µs, {rps['direct']:.0f} req/s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
