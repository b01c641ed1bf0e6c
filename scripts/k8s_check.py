"""What Hearth needs of its Kubernetes manifests, beyond the API schemas (scripts/k8s-check).

Usage: k8s_check.py OVERLAY RENDERED.yaml HEARTH_BIN
Checks, for one rendered overlay:
  * every workload container has liveness, readiness and startup probes on Hearth's own
    endpoints (/livez, /readyz), resource requests and a memory limit, and a grace period
    longer than the drain timeout;
  * every gateway and worker workload is covered by a PodDisruptionBudget, the gateway by
    an HPA;
  * workers take connections only from gateways and workers (NetworkPolicy);
  * worker pools have a model-cache volume, advertise their pod address, and register
    (HEARTH_REDIS_URL, HEARTH_WORKER_TOKEN from the Secret); gateways discover;
  * every HEARTH_* variable the manifests set is one that `hearth <command> --help` lists
    (a misspelt variable would be silently ignored);
  * everything is in one namespace and runs one image (pulled if not present); overlays
    other than `bundled` pin its tag; the gpu overlay has a pool that requests
    nvidia.com/gpu;
  * pipeline groups (LeaderWorkerSet): known fields only, a leader that starts first and a
    group that restarts whole, `--stage K/N` on every pod with N the group's size, probes,
    resources, the token in the Secret, a PDB, and the stage port open only to leaders.
"""

import re
import subprocess
import sys

import yaml

overlay, path, hearth = sys.argv[1], sys.argv[2], sys.argv[3]
docs = [d for d in yaml.safe_load_all(open(path)) if d]
failures = []


def fail(msg):
    failures.append(msg)


def by_kind(kind):
    return [d for d in docs if d["kind"] == kind]


def labels_match(selector, labels):
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


config = {}
for cm in by_kind("ConfigMap"):
    config.update(cm.get("data", {}))
secret_keys = set()
for s in by_kind("Secret"):
    secret_keys.update((s.get("data") or {}).keys())
    secret_keys.update((s.get("stringData") or {}).keys())

help_cache = {}


def env_names_of(command):
    if command not in help_cache:
        out = subprocess.run([hearth, command, "--help"], capture_output=True, text=True, check=True).stdout
        help_cache[command] = set(re.findall(r"env: (HEARTH_[A-Z0-9_]+)=", out))
    return help_cache[command]


hearth_workloads = [
    d
    for d in by_kind("Deployment") + by_kind("StatefulSet")
    if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") in ("gateway", "worker")
]
if not any(w["kind"] == "Deployment" for w in hearth_workloads):
    fail("no gateway Deployment")
if not any(w["kind"] == "StatefulSet" for w in hearth_workloads):
    fail("no worker StatefulSet")

drain = int(config.get("HEARTH_DRAIN_TIMEOUT_SECS", "30")) + int(config.get("HEARTH_SHUTDOWN_DELAY_SECS", "0"))
for w in by_kind("Deployment") + by_kind("StatefulSet"):
    name = f'{w["kind"]}/{w["metadata"]["name"]}'
    pod = w["spec"]["template"]["spec"]
    labels = w["spec"]["template"]["metadata"]["labels"]
    component = labels.get("app.kubernetes.io/component")
    for c in pod["containers"]:
        res = c.get("resources", {})
        if not res.get("requests") or "memory" not in res.get("limits", {}):
            fail(f"{name}: container {c['name']} needs resource requests and a memory limit")
        for probe in ("livenessProbe", "readinessProbe"):
            if probe not in c:
                fail(f"{name}: container {c['name']} has no {probe}")
    if component not in ("gateway", "worker"):
        continue  # the bundled PostgreSQL and Redis: single replicas, for trying it
    if not any(labels_match(p["spec"]["selector"], labels) for p in by_kind("PodDisruptionBudget")):
        fail(f"{name}: no PodDisruptionBudget covers it")
    c = pod["containers"][0]
    command = c["args"][0]
    if command != component:
        fail(f"{name}: runs `hearth {command}`, expected `hearth {component}`")
    paths = {p: c[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe", "startupProbe") if p in c}
    if paths != {"livenessProbe": "/livez", "readinessProbe": "/readyz", "startupProbe": "/livez"}:
        fail(f"{name}: probes {paths}, expected liveness/startup /livez and readiness /readyz")
    # A gateway past its drain timeout gives requests 5 s to end and their records 10 s.
    need = drain + (15 if component == "gateway" else 1)
    if pod.get("terminationGracePeriodSeconds", 30) <= need:
        fail(f"{name}: terminationGracePeriodSeconds must exceed {need} s (the drain and what follows it)")
    env = {e["name"]: e for e in c.get("env", [])}
    known = env_names_of(command)
    # Read outside the subcommand's arguments: HEARTH_LOG (logging), HEARTH_HOME (the model cache).
    common = {"HEARTH_LOG", "HEARTH_HOME"}
    for var in list(env) + [k for k in config if k.startswith("HEARTH_")]:
        if var.startswith("HEARTH_") and var not in known | common:
            # Shared settings (the ConfigMap) may belong to the other command.
            if var in env or var not in env_names_of("gateway") | env_names_of("worker"):
                fail(f"{name}: `hearth {command}` reads no {var}")
    for var in ("HEARTH_REDIS_URL", "HEARTH_WORKER_TOKEN"):
        if var not in secret_keys and var not in env:
            fail(f"{name}: {var} is not set (the Secret hearth-secrets lacks it)")
    if component == "gateway":
        if "--discover" not in c["args"]:
            fail(f"{name}: the gateway does not --discover workers")
        if not any(h["spec"]["scaleTargetRef"]["name"] == w["metadata"]["name"] for h in by_kind("HorizontalPodAutoscaler")):
            fail(f"{name}: no HorizontalPodAutoscaler")
        if "HEARTH_DATABASE_URL" not in secret_keys:
            fail(f"{name}: gateways share a database: HEARTH_DATABASE_URL is not in the Secret")
    else:
        if "HEARTH_ADVERTISE_URL" not in env or "POD_IP" not in env:
            fail(f"{name}: workers must advertise their pod address (HEARTH_ADVERTISE_URL from POD_IP)")
        claims = [v["metadata"]["name"] for v in w["spec"].get("volumeClaimTemplates", [])]
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        home = env.get("HEARTH_HOME", {}).get("value")
        if not claims or not home or mounts.get(claims[0]) != home:
            fail(f"{name}: the model cache (HEARTH_HOME) must be a volume claim")

# Workers: ingress only from gateways and workers.
policies = [
    p
    for p in by_kind("NetworkPolicy")
    if p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component") == "worker"
]
if not policies:
    fail("no NetworkPolicy for workers")
for p in policies:
    for rule in p["spec"].get("ingress", []):
        sources = rule.get("from")
        if not sources:
            fail(f"NetworkPolicy/{p['metadata']['name']}: a rule admits every source")
            continue
        for src in sources:
            comp = src.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
            if comp not in ("gateway", "worker") or "namespaceSelector" in src or "ipBlock" in src:
                fail(f"NetworkPolicy/{p['metadata']['name']}: admits {src}")

# Pipeline groups (LeaderWorkerSet, https://lws.sigs.k8s.io): the API group's fields this
# project relies on, a leader that is a worker like the others, stages that add up to the
# group's size, and the stage port open only to the group's leaders.
LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE = {"size", "leaderTemplate", "workerTemplate", "restartPolicy", "subGroupPolicy"}
for g in by_kind("LeaderWorkerSet"):
    name = f'LeaderWorkerSet/{g["metadata"]["name"]}'
    if g.get("apiVersion") != "leaderworkerset.x-k8s.io/v1":
        fail(f"{name}: apiVersion {g.get('apiVersion')}, expected leaderworkerset.x-k8s.io/v1")
    spec = g["spec"]
    lwt = spec.get("leaderWorkerTemplate", {})
    for key in set(spec) - LWS_SPEC:
        fail(f"{name}: unknown field spec.{key}")
    for key in set(lwt) - LWS_TEMPLATE:
        fail(f"{name}: unknown field spec.leaderWorkerTemplate.{key}")
    if spec.get("startupPolicy") != "LeaderCreated" or lwt.get("restartPolicy") != "RecreateGroupOnPodRestart":
        fail(f"{name}: a group starts with its leader and restarts whole (startupPolicy LeaderCreated, restartPolicy RecreateGroupOnPodRestart)")
    size = lwt.get("size", 1)
    pods = {role: lwt.get(role, {}) for role in ("leaderTemplate", "workerTemplate")}
    for role, t in pods.items():
        pod = t.get("spec", {})
        for c in pod.get("containers", []):
            res = c.get("resources", {})
            if not res.get("requests") or "memory" not in res.get("limits", {}):
                fail(f"{name}: {role} container {c['name']} needs resource requests and a memory limit")
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe not in c:
                    fail(f"{name}: {role} container {c['name']} has no {probe}")
            line = " ".join(c.get("command", []) + c.get("args", []))
            stage = re.search(r"--stage (\d+)/(\d+)", line)
            if not stage or int(stage.group(2)) != size:
                fail(f"{name}: {role} runs {line!r}: want --stage K/{size}, the group's size")
            elif (stage.group(1) == "1") != (role == "leaderTemplate"):
                fail(f"{name}: the leader runs stage 1 and only the leader does ({line!r})")
            env = {e["name"] for e in c.get("env", [])}
            for var in env:
                if var.startswith("HEARTH_") and var not in env_names_of("worker") | {"HEARTH_LOG", "HEARTH_HOME"}:
                    fail(f"{name}: `hearth worker` reads no {var}")
            if "HEARTH_WORKER_TOKEN" not in secret_keys:
                fail(f"{name}: the stages prove the workers' token: HEARTH_WORKER_TOKEN is not in the Secret")
    leader = pods["leaderTemplate"].get("spec", {}).get("containers", [{}])[0]
    if leader.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/readyz":
        fail(f"{name}: the leader's readiness is /readyz (503 while its group is incomplete)")
    if "HEARTH_ADVERTISE_URL" not in {e["name"] for e in leader.get("env", [])}:
        fail(f"{name}: the leader must advertise its pod address (HEARTH_ADVERTISE_URL)")
    labels = pods["leaderTemplate"].get("metadata", {}).get("labels", {})
    if not any(labels_match(p["spec"]["selector"], labels) for p in by_kind("PodDisruptionBudget")):
        fail(f"{name}: no PodDisruptionBudget covers it")
    wlabels = pods["workerTemplate"].get("metadata", {}).get("labels", {})
    stage_policies = [p for p in by_kind("NetworkPolicy") if labels_match(p["spec"]["podSelector"], wlabels)
                      and any(port.get("port") == 9100 for r in p["spec"].get("ingress", []) for port in r.get("ports", []))]
    if not stage_policies:
        fail(f"{name}: no NetworkPolicy admits the stage port (9100) to its workers")
    for p in stage_policies:
        for rule in p["spec"].get("ingress", []):
            for src in rule.get("from") or [{}]:
                if not labels_match(src.get("podSelector", {}), labels) or "namespaceSelector" in src or "ipBlock" in src:
                    fail(f"NetworkPolicy/{p['metadata']['name']}: the stage port admits {src}, not only the group's leaders")
if overlay == "pipeline" and not by_kind("LeaderWorkerSet"):
    fail("the pipeline overlay has no LeaderWorkerSet")

if overlay == "gpu":
    gpu = [
        w
        for w in by_kind("StatefulSet")
        if any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in w["spec"]["template"]["spec"]["containers"])
    ]
    if not gpu:
        fail("the gpu overlay has no pool requesting nvidia.com/gpu")
# One namespace for everything (a resource outside it would miss the Secret and the
# ConfigMap); production overlays pin one image tag; images are pulled only when missing.
namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
if len(namespaces) != 1 or None in namespaces:
    fail(f"objects in several namespaces or none: {sorted(map(str, namespaces))}")
images = set()
lws_pods = [
    {"metadata": g["metadata"], "spec": {"template": t}}
    for g in by_kind("LeaderWorkerSet")
    for t in (g["spec"]["leaderWorkerTemplate"].get("leaderTemplate"), g["spec"]["leaderWorkerTemplate"].get("workerTemplate"))
    if t
]
for w in hearth_workloads + lws_pods:
    for c in w["spec"]["template"]["spec"]["containers"]:
        images.add(c["image"])
        if c.get("imagePullPolicy") != "IfNotPresent":
            fail(f"{w['metadata']['name']}: imagePullPolicy should be IfNotPresent (a loaded image must be used)")
if len(images) != 1:
    fail(f"Hearth workloads run different images: {sorted(images)}")
if overlay != "bundled":
    for image in images:
        if image.endswith(":latest") or ":" not in image.rsplit("/", 1)[-1]:
            fail(f"{overlay} pins an image tag, not {image}")

kinds = sorted({d["kind"] for d in docs})
if failures:
    for f in failures:
        print(f"FAIL {overlay}: {f}")
    sys.exit(1)
print(f"ok   {overlay}: {len(docs)} objects ({', '.join(kinds)}) meet Hearth's checks")
