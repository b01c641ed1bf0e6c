"""A Hearth cluster as local processes (deploy/local-cluster runs this).

2 gateways + 3 self-registering workers in 2 regions, and (engine backend) a 2-stage pipeline
group (a leader worker and its stage-2 process, one replica to the gateways), on PostgreSQL +
Redis. Runs a mixed load through both gateways, SIGKILLs a worker in the middle of it, adds another, checks
session affinity across the gateways, and reports: requests served, errors (and why),
affinity consistency, usage rows against responses. Exit status 1 if a check fails.

Usage: local_cluster.py HEARTH_BIN DATABASE_URL REDIS_URL [--requests N] [--json FILE]
       [--backend engine|sim]
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

ADMIN = "local-cluster-admin-" + os.urandom(8).hex()
TOKEN = "local-cluster-worker-" + os.urandom(16).hex()

ap = argparse.ArgumentParser()
ap.add_argument("hearth")
ap.add_argument("database_url")
ap.add_argument("redis_url")
ap.add_argument("--requests", type=int, default=60)
ap.add_argument("--concurrency", type=int, default=4)
ap.add_argument("--json", dest="json_out")
ap.add_argument("--backend", default="engine")
args = ap.parse_args()

prefix = f"hearth-local-cluster-{os.getpid()}-{int(time.time())}:"
data = tempfile.mkdtemp(prefix="hearth-local-cluster-")
procs = []


def spawn(name, argv, env=None, listening=r"listening on (http://\S+)"):
    e = dict(os.environ, HEARTH_ADMIN_TOKEN=ADMIN, HEARTH_WORKER_TOKEN=TOKEN,
             HEARTH_LOG=os.environ.get("LOCAL_CLUSTER_LOG", "warn"))
    e.update(env or {})
    log = open(os.path.join(data, f"{name}.log"), "w")
    p = subprocess.Popen([args.hearth] + argv, stdout=subprocess.PIPE, stderr=log, env=e, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            sys.exit(f"{name} exited before listening; see {log.name}")
        m = re.search(listening, line)
        if m:
            # Keep draining its stdout so that it never blocks.
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            procs.append(p)
            return p, m.group(1).rstrip(")")
    sys.exit(f"{name} did not start")


def worker(name, region):
    return spawn(
        name,
        [
            "worker", "--listen", "127.0.0.1:0", "--region", region, "--threads", "1",
            "--backend", args.backend, "--redis-url", args.redis_url, "--redis-prefix", prefix,
            "--drain-timeout-secs", "20",
        ],
    )


def group(name, region):
    """A 2-stage pipeline group: stage 2 as its own process, then the leader (the worker
    the gateways see), which connects to it."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, addr = spawn(f"{name}-stage-2", [
        "worker", "--stage", "2/2", "--stage-listen", f"127.0.0.1:{port}", "--threads", "1",
    ], listening=r"listening on (\S+)")
    return spawn(
        name,
        [
            "worker", "--listen", "127.0.0.1:0", "--region", region, "--threads", "1",
            "--backend", args.backend, "--redis-url", args.redis_url, "--redis-prefix", prefix,
            "--drain-timeout-secs", "20", "--stage", "1/2", "--stage-next", addr,
        ],
    )


def gateway(name, region):
    return spawn(
        name,
        [
            "gateway", "--listen", "127.0.0.1:0", "--data-dir", os.path.join(data, name),
            "--database-url", args.database_url, "--redis-url", args.redis_url,
            "--redis-prefix", prefix, "--discover", "--region", region,
        ],
    )


def call(method, url, body=None, headers=None, timeout=120):
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode())
    req.add_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def pool(gw):
    _, text = call("GET", f"{gw}/admin/v1/routing", headers={"authorization": f"Bearer {ADMIN}"})
    out = {}
    for m in json.loads(text).get("data", []):
        for w in m["workers"]:
            out[w["name"]] = w["prompt_tokens"]
    return out


def wait_pools(gws, want, within):
    start = time.time()
    while time.time() - start < within:
        if all(sorted(pool(g)) == sorted(want) for g in gws):
            return time.time() - start
        time.sleep(0.05)
    raise SystemExit(f"pools {[sorted(pool(g)) for g in gws]} never became {sorted(want)}")


def admin(*a):
    out = subprocess.run(
        [args.hearth, "admin", "--data-dir", data, "--database-url", args.database_url, *a],
        capture_output=True, text=True, check=True,
    )
    return out.stdout


report = {"backend": args.backend}
try:
    t0 = time.time()
    workers = [worker("worker-eu-1", "eu"), worker("worker-eu-2", "eu"), worker("worker-us-1", "us")]
    if args.backend == "engine":
        workers.append(group("group-eu-1", "eu"))
    gws = [gateway("gateway-a", "eu")[1], gateway("gateway-b", "us")[1]]
    want = [u for _, u in workers]
    wait_pools(gws, want, 30)
    report["startup_s"] = round(time.time() - t0, 1)
    admin("tenant", "create", "load")
    key = re.search(r"hk_\S+", admin("key", "create", "--tenant", "load")).group(0)
    auth = {"authorization": f"Bearer {key}"}
    model = json.loads(call("GET", f"{gws[0]}/v1/models", headers=auth)[1])["data"][0]["id"]

    results = []
    lock = threading.Lock()

    def one(i):
        gw = gws[i % 2]
        stream = i % 3 == 0
        session = f"user-{i % 7}" if i % 2 == 0 else None
        body = {
            "model": model, "max_tokens": 8 + (i % 4) * 8, "stream": stream, "temperature": 0,
            "messages": [{"role": "user", "content": f"Question {i}: name a colour and a fruit."}],
        }
        h = dict(auth)
        if session:
            h["x-session-affinity"] = session
        status, text = call("POST", f"{gw}/v1/chat/completions", body, h)
        ok = status == 200
        why = None
        if ok and stream:
            ok = text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            if not ok:
                m = re.search(r'"code":"([a-z_]+)"', text)
                why = m.group(1) if m else "broken stream"
        elif not ok:
            try:
                why = json.loads(text)["error"]["code"] or json.loads(text)["error"]["type"]
            except Exception:
                why = f"HTTP {status}"
        with lock:
            results.append({"i": i, "gateway": gw, "stream": stream, "ok": ok, "status": status, "why": why})

    # The load; at a third of it a worker is SIGKILLed, at two thirds one joins.
    n = args.requests
    killed = workers[1]
    with ThreadPoolExecutor(args.concurrency) as ex:
        futures = []
        for i in range(n):
            futures.append(ex.submit(one, i))
            if i == n // 3:
                time.sleep(0.5)  # some requests in flight on every worker
                killed[0].send_signal(signal.SIGKILL)
                killed[0].wait()
                k_at = time.time()
                want.remove(killed[1])
                left = list(want)

                def watch_leave():
                    wait_pools(gws, left, 10)
                    report["killed_worker_left_pools_s"] = round(time.time() - k_at, 2)

                leaving = threading.Thread(target=watch_leave)
                leaving.start()
            if i == 2 * n // 3:
                leaving.join()
                added = worker("worker-us-2", "us")
                a_at = time.time()
                want.append(added[1])
                wait_pools(gws, want, 10)
                report["added_worker_joined_pools_s"] = round(time.time() - a_at, 2)
        for f in futures:
            f.result()

    # Affinity across gateways, measured quietly: each session's requests alternate
    # between the gateways; the worker is the one whose prompt tokens grew.
    # The gateways' shared load refreshes every 500 ms: after the load phase, wait until
    # it shows the workers idle, so that a pin holds by affinity, not by a stale bound
    # (a pinned worker over its load bound is left, by design).
    time.sleep(1.5)
    consistent = 0
    sessions = 8
    split = []
    for s in range(sessions):
        seen = set()
        order = []
        for r in range(4):
            gw = gws[r % 2]
            before = pool(gw)
            body = {"model": model, "max_tokens": 4, "prompt_cache_key": f"affinity-{s}",
                    "messages": [{"role": "user", "content": f"Affinity check {s}."}]}
            status, text = call("POST", f"{gw}/v1/chat/completions", body, dict(auth, **{"x-session-affinity": f"affinity-{s}"}))
            results.append({"i": -1, "gateway": gw, "stream": False, "ok": status == 200, "status": status,
                            "why": None if status == 200 else f"HTTP {status}"})
            for _ in range(100):
                after = pool(gw)
                moved = [w for w, t in after.items() if t > before.get(w, 0)]
                if len(moved) == 1:
                    seen.add(moved[0])
                    order.append((gw, moved[0]))
                    break
                time.sleep(0.02)
        consistent += len(seen) == 1
        if len(seen) != 1:
            split.append({"session": f"affinity-{s}", "gateway_worker": order})
    report["affinity_split"] = split

    served = sum(r["ok"] for r in results)
    errors = {}
    for r in results:
        if not r["ok"]:
            errors[r["why"]] = errors.get(r["why"], 0) + 1
    time.sleep(1)
    if args.backend == "engine":
        # Prompt tokens the gateways routed to the pipeline group.
        report["group_prompt_tokens"] = max(pool(g).get(workers[-1][1], 0) for g in gws)
    rows = json.loads(admin("--json", "usage", "--limit", "100000"))
    completed = sum(1 for r in rows if r["status"] == "completed")
    failed_codes = {}
    for r in rows:
        if r["status"] != "completed":
            failed_codes[r.get("error_code")] = failed_codes.get(r.get("error_code"), 0) + 1
    report.update({
        "usage_failed_by_code": failed_codes,
        "requests": len(results), "served": served, "errors": errors,
        "affinity_sessions": sessions, "affinity_consistent": consistent,
        "usage_rows": len(rows), "usage_completed": completed,
        "duration_s": round(time.time() - t0, 1),
    })
finally:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()

checks = [
    ("every request has one usage row", report.get("usage_rows") == report.get("requests")),
    ("usage rows completed == successful responses", report.get("usage_completed") == report.get("served")),
    # A request on the killed worker ends with a clean error (503, or an error event in its
    # stream); its usage row says why.
    ("errors only from the killed worker", set(report.get("usage_failed_by_code", {})) <= {"worker_disconnected"}
     and sum(report.get("usage_failed_by_code", {}).values()) == sum(report.get("errors", {}).values())),
    ("affinity consistent across gateways", report.get("affinity_consistent") == report.get("affinity_sessions")),
]
if args.backend == "engine":
    checks.append(("the pipeline group served requests", report.get("group_prompt_tokens", 0) > 0))
print()
print("local cluster: 2 gateways, 3 workers (eu, eu, us) + 1 added", "+ a 2-stage pipeline group (eu)" if args.backend == "engine" else "",
      "PostgreSQL + Redis, backend", args.backend)
print(f"{'':2}{'measure':44} value")
for k in ("startup_s", "requests", "served", "errors", "killed_worker_left_pools_s", "added_worker_joined_pools_s",
          "affinity_sessions", "affinity_consistent", "affinity_split", "group_prompt_tokens", "usage_rows", "usage_completed", "usage_failed_by_code",
          "duration_s"):
    print(f"  {k:44} {report.get(k)}")
for name, ok in checks:
    print(f"  {'ok  ' if ok else 'FAIL'} {name}")
print(f"logs: {data}")
if args.json_out:
    with open(args.json_out, "w") as f:
        json.dump(dict(report, checks={n: ok for n, ok in checks}), f, indent=2)
sys.exit(0 if all(ok for _, ok in checks) else 1)
