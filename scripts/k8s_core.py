"""The rendered manifests with every LeaderWorkerSet replaced by its pod templates (as
core PodTemplate objects), for the strict schema validation of scripts/k8s-check.

Usage: k8s_core.py RENDERED.yaml OUT.yaml
"""

import sys

import yaml

docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
out = []
for d in docs:
    if d.get("kind") != "LeaderWorkerSet":
        out.append(d)
        continue
    for role in ("leaderTemplate", "workerTemplate"):
        template = d["spec"]["leaderWorkerTemplate"].get(role)
        if template is not None:
            out.append({
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f'{d["metadata"]["name"]}-{role.lower()}', "namespace": d["metadata"].get("namespace")},
                "template": template,
            })
with open(sys.argv[2], "w") as f:
    yaml.safe_dump_all(out, f)
