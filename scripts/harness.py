"""What the scripts that drive a real `hearth serve` share (openai_sdk_check.py,
dashboard_check.py): the server on a free port with a fresh data directory, the CLI against
that directory, the count of checks passed and failed, and a synthetic LoRA adapter for the
default model with its upload."""
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid


class Serve:
    """`hearth serve` on 127.0.0.1:0 with a fresh data directory (`extra_env` added)."""

    def __init__(self, hearth, tag, extra_env=None):
        self.hearth = hearth
        self.data = tempfile.mkdtemp(prefix=f"hearth-{tag}-")
        self.env = dict(os.environ, HEARTH_LOG="warn", **(extra_env or {}))
        self.proc = subprocess.Popen([hearth, "serve", "--listen", "127.0.0.1:0", "--data-dir", self.data],
                                     stdout=subprocess.PIPE, text=True, env=self.env)

    def wait_url(self, timeout=180):
        """The base URL it printed once listening (exits the script if it died first)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                sys.exit("hearth serve exited before listening")
            if "listening on " in line:
                return line.split("listening on ")[1].split()[0]
        sys.exit("hearth serve did not start listening")

    def admin(self, *args):
        """`hearth admin --json ARGS` on this server's data directory; its stdout."""
        return subprocess.run([self.hearth, "admin", "--data-dir", self.data, "--json", *args],
                              check=True, capture_output=True, text=True, env=self.env).stdout

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


class Checks:
    """Prints each check as ok/FAIL and counts them."""

    def __init__(self):
        self.passed = self.failed = 0

    def __call__(self, name, cond, detail=""):
        if cond:
            self.passed += 1
            print(f"ok   {name}")
        else:
            self.failed += 1
            print(f"FAIL {name} {detail}")

    def exit(self, label):
        print(f"{label}: {self.passed} passed, {self.failed} failed")
        sys.exit(1 if self.failed else 0)


def synthetic_adapter(rank, seed=7):
    """A PEFT adapter for the default model (30 layers, 576 wide, 3 KV heads of 64, MLP
    1536) with seeded random weights, written with the standard library only."""
    rng = random.Random(seed)
    d, kv, ff = 576, 192, 1536
    modules = [("self_attn.q_proj", d, d), ("self_attn.k_proj", kv, d), ("self_attn.v_proj", kv, d),
               ("self_attn.o_proj", d, d), ("mlp.gate_proj", ff, d), ("mlp.up_proj", ff, d),
               ("mlp.down_proj", d, ff)]
    header, blobs, offset = {}, [], 0
    for layer in range(30):
        for m, out, inp in modules:
            stem = f"base_model.model.model.layers.{layer}.{m}"
            for part, shape, std in (("lora_A", [rank, inp], inp ** -0.5), ("lora_B", [out, rank], 0.05)):
                n = shape[0] * shape[1]
                blob = struct.pack(f"<{n}f", *(rng.gauss(0, std) for _ in range(n)))
                header[f"{stem}.{part}.weight"] = {"dtype": "F32", "shape": shape,
                                                  "data_offsets": [offset, offset + len(blob)]}
                blobs.append(blob)
                offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    weights = struct.pack("<Q", len(head)) + head + b"".join(blobs)
    config = json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                         "target_modules": [m.split(".")[1] for m, _, _ in modules], "bias": "none"}).encode()
    return [("adapter_config.json", config), ("adapter_model.safetensors", weights)]


def upload_batch_file(url, key, lines):
    """`POST /v1/files` (purpose batch) of JSONL `lines`; the file's id."""
    boundary = uuid.uuid4().hex
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="batch.jsonl"\r\n'
            f"Content-Type: application/jsonl\r\n\r\n").encode() + ("\n".join(lines) + "\n").encode()
    body += f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(url + "/v1/files", data=body, method="POST", headers={
        "Authorization": "Bearer " + key, "Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["id"]


def upload_adapter(url, key, base, name, files):
    """`POST /v1/tenant/adapters` as multipart/form-data; (status, JSON body)."""
    boundary = uuid.uuid4().hex
    body = b""
    for field, value in (("base_model", base), ("name", name)):
        body += f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"\r\n\r\n{value}\r\n'.encode()
    for file_name, data in files:
        body += (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{file_name}"\r\n'
                 f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    req = urllib.request.Request(url + "/v1/tenant/adapters", data=body, method="POST", headers={
        "Authorization": "Bearer " + key, "Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")
