"""The official OpenAI Python SDK against a real `hearth serve` (started here on a free port
with a fresh data directory; a tenant and key are made with the CLI)."""
import json, sys, time, urllib.request

import openai
from openai import OpenAI

from harness import Checks, Serve, synthetic_adapter, upload_adapter

server = Serve(sys.argv[1], "sdk")
check = Checks()

try:
    url = server.wait_url()
    admin = server.admin
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

    # Tool calling: a round trip (call → role "tool" result → final answer), plain and streamed.
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}}]
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    result = json.dumps({"city": "Paris", "temperature_c": 18, "conditions": "sunny"})

    def final_answer(call_id, name, arguments, stream):
        history = ask + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]
        if not stream:
            r = c.chat.completions.create(model=model, messages=history, tools=tools, tool_choice="none",
                                          temperature=0, max_tokens=48)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, finish = "", None
        for ch in c.chat.completions.create(model=model, messages=history, tools=tools, tool_choice="none",
                                            temperature=0, max_tokens=48, stream=True):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
        return text, finish

    r = c.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required",
                                  parallel_tool_calls=False, temperature=0)
    m = r.choices[0].message
    ok = r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls or []) == 1
    call = m.tool_calls[0] if ok else None
    args = json.loads(call.function.arguments) if ok else {}
    check("tool call", ok and call.type == "function" and call.function.name == "get_weather"
          and call.id.startswith("call_") and isinstance(args.get("city"), str), r)
    if ok:
        text, finish = final_answer(call.id, call.function.name, call.function.arguments, stream=False)
        check("tool result → final answer", bool(text and text.strip()) and finish in ("stop", "length"),
              (text, finish))

    calls, finish, content = {}, None, ""
    for ch in c.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required",
                                        parallel_tool_calls=False, temperature=0, stream=True):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            if tc.function:
                slot["name"] = tc.function.name or slot["name"]
                slot["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    streamed = calls.get(0, {})
    try:
        streamed_args = json.loads(streamed.get("arguments") or "null")
    except ValueError:
        streamed_args = None
    check("streamed tool call", finish == "tool_calls" and len(calls) == 1 and streamed.get("name") == "get_weather"
          and (streamed.get("id") or "").startswith("call_") and isinstance(streamed_args, dict)
          and isinstance(streamed_args.get("city"), str), (calls, finish, content))
    if streamed.get("id"):
        text, finish = final_answer(streamed["id"], streamed["name"], streamed["arguments"], stream=True)
        check("streamed tool result → final answer", bool(text.strip()) and finish in ("stop", "length"),
              (text, finish))

    # Structured outputs: the SDK's parse helper with a Pydantic model (json_schema, strict).
    from typing import Annotated
    from pydantic import BaseModel, Field

    Short = Annotated[str, Field(max_length=40)]

    class City(BaseModel):
        name: Short
        country: Short
        is_capital: bool
        landmarks: list[Short] = Field(max_length=3)

    parse = getattr(c.chat.completions, "parse", None) or c.beta.chat.completions.parse
    r = parse(model=model, temperature=0, max_tokens=400, response_format=City,
              messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    parsed = r.choices[0].message.parsed
    check("parse returns a Pydantic object", isinstance(parsed, City) and r.choices[0].finish_reason == "stop",
          r.choices[0].message)

    # A tenant's LoRA adapter: uploaded through the self-service API, then used by the SDK as
    # BASE:ADAPTER; the usage row and the export name it.
    status, stored = upload_adapter(url, key, model, "my-adapter", synthetic_adapter(rank=4))
    check("adapter upload", status == 201 and stored.get("version") == 1, stored)
    name = model + ":my-adapter"
    check("adapter listed as a model", name in [m.id for m in c.models.list()])
    first = lambda m: c.chat.completions.create(model=m, messages=q, temperature=0, max_tokens=8,
                                                logprobs=True).choices[0].logprobs.content[0].logprob
    base_lp, adapter_lp = first(model), first(name)
    check("the adapter changes the answer", abs(adapter_lp - base_lp) > 1e-3, (adapter_lp, base_lp))
    rows = []
    for _ in range(40):
        rows = [r for r in json.loads(admin("usage", "--limit", "100")) if r.get("adapter") == "my-adapter"]
        if rows:
            break
        time.sleep(0.25)
    check("usage row carries the adapter", len(rows) == 1 and rows[0]["model"] == model, rows)
    req = urllib.request.Request(url + "/v1/tenant/usage/export?format=csv&granularity=request",
                                 headers={"Authorization": "Bearer " + key})
    lines = urllib.request.urlopen(req).read().decode().splitlines()
    col = lines[0].split(",").index("adapter") if "adapter" in lines[0].split(",") else None
    check("export has the adapter", col is not None
          and sum(1 for l in lines[1:] if l.split(",")[col] == "my-adapter") == 1, lines[:3])

    # The Files and Batch APIs: 50 lines, good and bad mixed. Every good line is answered
    # once, every bad one is in the error file, each line that ran has one usage row naming
    # the batch, and another tenant sees none of it.
    lines, good = [], []
    for i in range(50):
        if i % 10 == 3:
            lines.append("{not json")
        elif i % 10 == 7:
            lines.append(json.dumps({"custom_id": f"bad-{i}", "method": "POST", "url": "/v1/embeddings", "body": {}}))
        elif i == 25:  # runs, and the model refuses it: more tokens than the context holds
            lines.append(json.dumps({"custom_id": "over-context", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"model": model, "max_tokens": 10**8, "messages": q}}))
        else:
            good.append(f"good-{i}")
            lines.append(json.dumps({"custom_id": f"good-{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"model": model, "max_tokens": 6, "temperature": 0,
                                              "messages": [{"role": "user", "content": f"Say the number {i}."}]}}))
    data = ("\n".join(lines) + "\n").encode()
    f = c.files.create(file=("requests.jsonl", data), purpose="batch")
    check("file uploaded", f.purpose == "batch" and f.bytes == len(data), f)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"run": "sdk"})
    check("batch created", b.status == "in_progress" and b.request_counts.total == 50, b)
    deadline = time.time() + 600
    while b.status not in ("completed", "failed", "expired", "cancelled") and time.time() < deadline:
        time.sleep(0.5)
        b = c.batches.retrieve(b.id)
    check("batch completed", b.status == "completed" and b.request_counts.completed == len(good)
          and b.request_counts.failed == 50 - len(good), b)
    out = [json.loads(l) for l in c.files.content(b.output_file_id).text.splitlines()]
    check("every good line answered once", sorted(l["custom_id"] for l in out) == sorted(good)
          and all(l["response"]["status_code"] == 200 and l["response"]["body"]["choices"] for l in out), out[:2])
    err = [json.loads(l) for l in c.files.content(b.error_file_id).text.splitlines()]
    check("every bad line in the error file", len(err) == 50 - len(good)
          and sum(1 for l in err if l.get("response") and l["response"]["status_code"] == 400) == 1, err[:3])
    check("batch listed", b.id in [x.id for x in c.batches.list()])
    check("output file listed", b.output_file_id in [x.id for x in c.files.list(purpose="batch_output")])
    rows = []
    for _ in range(40):
        rows = [r for r in json.loads(admin("usage", "--limit", "1000")) if r.get("batch_id") == b.id]
        if len(rows) >= len(good) + 1:
            break
        time.sleep(0.25)
    check("one usage row per line run", len(rows) == len(good) + 1
          and len({r["request_id"] for r in rows}) == len(rows), len(rows))
    check("input file deleted", c.files.delete(f.id).deleted)
    admin("tenant", "create", "sdk-other")
    other = OpenAI(base_url=url + "/v1", api_key=json.loads(admin("key", "create", "--tenant", "sdk-other"))["key"],
                   max_retries=0)
    for what, call in [("batch", lambda: other.batches.retrieve(b.id)),
                       ("output", lambda: other.files.content(b.output_file_id)),
                       ("file", lambda: other.files.retrieve(b.error_file_id))]:
        try:
            call()
            check(f"another tenant's {what} is NotFoundError", False)
        except openai.NotFoundError:
            check(f"another tenant's {what} is NotFoundError", True)

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
    server.stop()

check.exit("openai-sdk")
