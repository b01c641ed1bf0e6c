"""The official OpenAI Python SDK against a real `hearth serve` (started here on a free port
with a fresh data directory; a tenant and key are made with the CLI)."""
import json, os, subprocess, sys, tempfile, time

import openai
from openai import OpenAI

hearth = sys.argv[1]
data = tempfile.mkdtemp(prefix="hearth-sdk-")
env = dict(os.environ, HEARTH_LOG="warn")
server = subprocess.Popen([hearth, "serve", "--listen", "127.0.0.1:0", "--data-dir", data],
                          stdout=subprocess.PIPE, text=True, env=env)
passed = failed = 0

def check(name, cond, detail=""):
    global passed, failed
    if cond:
        passed += 1
        print(f"ok   {name}")
    else:
        failed += 1
        print(f"FAIL {name} {detail}")

try:
    deadline = time.time() + 180
    url = None
    while url is None and time.time() < deadline:
        line = server.stdout.readline()
        if not line:
            sys.exit("hearth serve exited before listening")
        if "listening on " in line:
            url = line.split("listening on ")[1].split()[0]
    admin = lambda *a: subprocess.run([hearth, "admin", "--data-dir", data, "--json", *a],
                                      check=True, capture_output=True, text=True).stdout
    admin("tenant", "create", "sdk")
    key = json.loads(admin("key", "create", "--tenant", "sdk"))["key"]
    c = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    model = "smollm2-135m-instruct"
    q = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]

    r = c.chat.completions.create(model=model, messages=q, temperature=0)
    check("chat answers Paris", "Paris" in r.choices[0].message.content, r.choices[0].message.content)
    check("chat usage", r.usage.prompt_tokens == 42 and r.usage.prompt_tokens_details.cached_tokens == 0, r.usage)

    text, usage = "", None
    for ch in c.chat.completions.create(model=model, messages=q, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
        else:
            usage = ch.usage
    check("stream answers Paris", "Paris" in text, text)
    check("stream carries usage", usage is not None and usage.completion_tokens > 0, usage)

    r = c.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    check("completions", r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4, r)
    check("models", [m.id for m in c.models.list()] == [model])

    try:
        c.chat.completions.create(model="nope", messages=q)
        check("unknown model is NotFoundError", False)
    except openai.NotFoundError as e:
        check("unknown model is NotFoundError", e.body["code"] == "model_not_found", e.body)
    try:
        c.chat.completions.create(model=model, messages=q, temperature=7)
        check("bad parameter is BadRequestError", False)
    except openai.BadRequestError as e:
        check("bad parameter is BadRequestError", e.body["param"] == "temperature", e.body)
    try:
        OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        check("bad key is AuthenticationError", False)
    except openai.AuthenticationError:
        check("bad key is AuthenticationError", True)
finally:
    server.terminate()
    server.wait(timeout=30)

print(f"openai-sdk: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
