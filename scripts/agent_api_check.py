"""The official OpenAI (Responses) and Anthropic (Messages) Python SDKs against a real
`hearth serve` (a free port, a fresh data directory; tenants and keys made with the CLI):
streams and their final objects, tool round trips, structured output, cached tokens,
previous_response_id and stored responses, count_tokens, auth and error shapes, usage rows,
limits and budgets on each route, and constrained answers that end valid within a tight
max_tokens at temperature 1.0."""
import json, sys

import anthropic
import openai
from anthropic import Anthropic
from openai import OpenAI
from pydantic import BaseModel

from harness import Checks, Serve

server = Serve(sys.argv[1], "agent-apis")
check = Checks()
MODEL = "smollm2-135m-instruct"


def key_for(tenant):
    server.admin("tenant", "create", tenant)
    return json.loads(server.admin("key", "create", "--tenant", tenant))["key"]


try:
    url = server.wait_url()
    key = key_for("agents")
    oa = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    an = Anthropic(base_url=url, api_key=key, max_retries=0)
    q = "What is the capital of France? Answer in one sentence."
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}
    result = json.dumps({"city": "Paris", "temperature_c": 18, "conditions": "sunny"})

    # --- Responses ---
    r = oa.responses.create(model=MODEL, input=q, temperature=0)
    check("responses: answers Paris", "Paris" in r.output_text and r.status == "completed", r)
    check("responses: usage", r.usage.input_tokens == 42 and r.usage.output_tokens > 0
          and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage)

    seen, seqs = [], []
    with oa.responses.stream(model=MODEL, input=q, temperature=0) as s:
        for ev in s:
            seen.append(ev.type)
            seqs.append(ev.sequence_number)
        final = s.get_final_response()
    order = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
             "response.output_text.delta", "response.output_text.done", "response.content_part.done",
             "response.output_item.done", "response.completed"]
    check("responses stream: documented event order", [e for e in order if e in seen] == order
          and seen[0] == "response.created" and seen[-1] == "response.completed", seen)
    check("responses stream: sequence numbers", seqs == list(range(len(seqs))), seqs[:10])
    check("responses stream: final response", "Paris" in final.output_text and final.usage.output_tokens > 0, final)

    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city.",
              "parameters": weather, "strict": True}, {"type": "web_search"}]
    ask = "What is the weather like in Paris today?"
    r = oa.responses.create(model=MODEL, input=ask, tools=tools, tool_choice="required",
                            parallel_tool_calls=False, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    ok = len(calls) == 1 and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments).get("city"), str)
    check("responses: tool call (a hosted tool beside it is left out)", ok, r.output)
    if ok:
        r2 = oa.responses.create(model=MODEL, previous_response_id=r.id, tools=tools, tool_choice="auto",
                                 temperature=0, max_output_tokens=48,
                                 input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": result}])
        # The conversation continues where the stored one ended: its prompt is the cached prefix.
        check("responses: tool result → answer (previous_response_id)", bool(r2.output)
              and r2.usage.input_tokens > r.usage.input_tokens
              and r2.usage.input_tokens_details.cached_tokens >= 64, r2.usage)
        history = [{"role": "user", "content": ask}, calls[0].model_dump(exclude_none=True),
                   {"type": "function_call_output", "call_id": calls[0].call_id, "output": result}]
        r3 = oa.responses.create(model=MODEL, input=history, store=False, tools=tools, tool_choice="none",
                                 temperature=0, max_output_tokens=48)
        check("responses: tool round trip with the items sent back", bool(r3.output_text.strip()), r3)
        try:
            oa.responses.retrieve(r3.id)
            check("responses: store=false keeps nothing", False)
        except openai.NotFoundError:
            check("responses: store=false keeps nothing", True)

    args, done_args = "", None
    with oa.responses.stream(model=MODEL, input=ask, tools=tools, tool_choice="required",
                             parallel_tool_calls=False, temperature=0) as s:
        for ev in s:
            if ev.type == "response.function_call_arguments.delta":
                args += ev.delta
            elif ev.type == "response.function_call_arguments.done":
                done_args = ev.arguments
        final = s.get_final_response()
    fc = [o for o in final.output if o.type == "function_call"]
    check("responses stream: tool call", len(fc) == 1 and args == done_args == fc[0].arguments
          and isinstance(json.loads(args).get("city"), str), (args, final.output))

    class City(BaseModel):
        name: str
        country: str
        is_capital: bool

    r = oa.responses.parse(model=MODEL, input="Describe Paris as JSON.", text_format=City, temperature=0,
                           max_output_tokens=200)
    check("responses: structured output parses", isinstance(r.output_parsed, City), r.output_text)

    long_prefix = "You are a careful assistant. " * 40
    first = oa.responses.create(model=MODEL, instructions=long_prefix, input="Say hi.", max_output_tokens=4)
    again = oa.responses.create(model=MODEL, instructions=long_prefix, input="Say hello.", max_output_tokens=4)
    check("responses: cached tokens on a repeated prefix",
          first.usage.input_tokens_details.cached_tokens == 0
          and again.usage.input_tokens_details.cached_tokens >= 200, (first.usage, again.usage))

    got = oa.responses.retrieve(first.id)
    items = oa.responses.input_items.list(first.id)
    check("responses: retrieve and input_items", got.id == first.id and got.output_text == first.output_text
          and len(items.data) == 1, (got, items))
    other = OpenAI(base_url=url + "/v1", api_key=key_for("stranger"), max_retries=0)
    try:
        other.responses.retrieve(first.id)
        check("responses: another tenant's id is a 404", False)
    except openai.NotFoundError:
        check("responses: another tenant's id is a 404", True)
    oa.responses.delete(first.id)
    try:
        oa.responses.retrieve(first.id)
        check("responses: deleted", False)
    except openai.NotFoundError:
        check("responses: deleted", True)
    try:
        oa.responses.create(model=MODEL, input=q, temperature=7)
        check("responses: bad parameter is BadRequestError", False)
    except openai.BadRequestError as e:
        check("responses: bad parameter is BadRequestError", e.body["param"] == "temperature", e.body)
    try:
        oa.responses.create(model=MODEL, input="word " * 9000)
        check("responses: context overflow", False)
    except openai.BadRequestError as e:
        check("responses: context overflow", e.body["code"] == "context_length_exceeded", e.body)

    # --- Messages ---
    msgs = [{"role": "user", "content": q}]
    m = an.messages.create(model=MODEL, max_tokens=8192, messages=msgs, extra_body={"temperature": 0})
    text = "".join(b.text for b in m.content if b.type == "text")
    u = m.usage
    check("messages: answers Paris (max_tokens beyond the context is a cap)", "Paris" in text
          and m.stop_reason == "end_turn", m)
    check("messages: three-part input usage",
          u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == 42, u)
    with an.messages.stream(model=MODEL, max_tokens=64, messages=msgs, extra_body={"temperature": 0}) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    check("messages stream: final message", "Paris" in final.content[0].text and final.usage.output_tokens > 0
          and kinds[0] == "message_start" and "content_block_delta" in kinds and kinds[-1] == "message_stop",
          (kinds[:6], final))
    count = an.messages.count_tokens(model=MODEL, messages=msgs)
    fu = final.usage
    check("messages: count_tokens equals billed input", count.input_tokens ==
          fu.input_tokens + fu.cache_read_input_tokens + fu.cache_creation_input_tokens == 42, (count, fu))

    atools = [{"name": "get_weather", "description": "Current weather in a city.", "input_schema": weather},
              {"type": "web_search_20250305", "name": "web_search"}]
    amsgs = [{"role": "user", "content": ask}]
    m = an.messages.create(model=MODEL, max_tokens=200, messages=amsgs, tools=atools, extra_body={"temperature": 0},
                           tool_choice={"type": "any", "disable_parallel_tool_use": True})
    uses = [b for b in m.content if b.type == "tool_use"]
    ok = m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].id.startswith("toolu_") \
        and isinstance(uses[0].input.get("city"), str)
    check("messages: tool_use", ok, m)
    if ok:
        follow = amsgs + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                        "content": result}]}]
        m2 = an.messages.create(model=MODEL, max_tokens=48, messages=follow, tools=atools, extra_body={"temperature": 0},
                                tool_choice={"type": "none"})
        check("messages: tool_result → answer", any(b.type == "text" and b.text.strip() for b in m2.content), m2)
    with an.messages.stream(model=MODEL, max_tokens=200, messages=amsgs, tools=atools, extra_body={"temperature": 0},
                            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}) as s:
        deltas = [ev.delta.partial_json for ev in s if ev.type == "content_block_delta"
                  and ev.delta.type == "input_json_delta"]
        final = s.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    check("messages stream: tool_use via input_json_delta", len(uses) == 1 and deltas
          and json.loads("".join(deltas)) == uses[0].input, (deltas, final))

    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cch=1;"},
              {"type": "text", "text": "You are a coding agent. " * 40}]
    a = an.messages.create(model=MODEL, max_tokens=4, system=system, messages=[{"role": "user", "content": "Hi."}])
    system[0]["text"] = "x-anthropic-billing-header: cc_version=2.1.332; cch=2;"
    b = an.messages.create(model=MODEL, max_tokens=4, system=system, messages=[{"role": "user", "content": "Hey."}])
    billed = b.usage.input_tokens + b.usage.cache_read_input_tokens + b.usage.cache_creation_input_tokens
    counted = an.messages.count_tokens(model=MODEL, system=system, messages=[{"role": "user", "content": "Hey."}])
    check("messages: billing header dropped, so the next turn hits the cache", a.usage.cache_read_input_tokens == 0
          and b.usage.cache_read_input_tokens >= 200 and billed == counted.input_tokens, (a.usage, b.usage, counted))
    bearer = Anthropic(base_url=url, auth_token=key, max_retries=0)
    check("messages: Bearer auth", bearer.messages.create(model=MODEL, max_tokens=2, messages=msgs).id.startswith("msg_"))
    try:
        Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(model=MODEL, max_tokens=2, messages=msgs)
        check("messages: bad key is AuthenticationError", False)
    except anthropic.AuthenticationError as e:
        check("messages: bad key is AuthenticationError", e.body["error"]["type"] == "authentication_error", e.body)
    try:
        an.messages.create(model="nope", max_tokens=2, messages=msgs)
        check("messages: unknown model is NotFoundError", False)
    except anthropic.NotFoundError as e:
        check("messages: unknown model is NotFoundError", e.body["type"] == "error", e.body)
    try:
        an.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
        check("messages: images refused by name", False)
    except anthropic.BadRequestError as e:
        check("messages: images refused by name", "image" in e.body["error"]["message"], e.body)
    try:
        an.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "word " * 9000}])
        check("messages: context overflow", False)
    except anthropic.BadRequestError as e:
        check("messages: context overflow", e.body["error"]["type"] == "invalid_request_error"
              and "context" in e.body["error"]["message"], e.body)

    # --- Constrained answers end valid within a tight budget (temperature 1.0) ---
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
              "landmarks": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "country", "landmarks"], "additionalProperties": False}
    valid = 0
    for i in range(12):
        desc = [{"role": "user", "content": "Describe Paris as JSON."}]
        if i % 2 == 0:
            out = oa.chat.completions.create(model=MODEL, temperature=1.0, max_tokens=24, messages=desc,
                                             response_format={"type": "json_schema",
                                                              "json_schema": {"name": "city", "schema": schema}})
            text = out.choices[0].message.content
        else:
            out = oa.responses.create(model=MODEL, temperature=1.0, max_output_tokens=24, input=desc, store=False,
                                      text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
            text = out.output_text
        try:
            v = json.loads(text)
            valid += set(v) == set(schema["required"]) and isinstance(v["landmarks"], list)
        except ValueError:
            print("   not JSON:", text)
    check("12 json_schema answers at temperature 1.0, max_tokens 24, all valid", valid == 12, valid)
    ctools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    valid = 0
    for i in range(12):
        ask3 = [{"role": "user", "content": "Weather in Paris, Rome and Tokyo?"}]
        try:
            if i % 2 == 0:
                out = oa.chat.completions.create(model=MODEL, temperature=1.0, max_tokens=40, messages=ask3,
                                                 tools=ctools, tool_choice="required")
                args = [c.function.arguments for c in out.choices[0].message.tool_calls or []]
                args = [json.loads(a) for a in args]
            else:
                out = an.messages.create(model=MODEL, extra_body={"temperature": 1.0}, max_tokens=40, messages=ask3, tools=atools,
                                         tool_choice={"type": "any"})
                args = [b.input for b in out.content if b.type == "tool_use"]
            valid += bool(args) and all(set(a) == {"city"} and isinstance(a["city"], str) for a in args)
        except ValueError as e:
            print("   not JSON:", e)
    check("12 tool_choice required answers at temperature 1.0, max_tokens 40, all valid", valid == 12, valid)

    # --- Limits, budgets and usage rows hold on every route ---
    limited = key_for("limited")
    server.admin("tenant", "limits", "limited", "--rpm", "2")
    lo = OpenAI(base_url=url + "/v1", api_key=limited, max_retries=0)
    la = Anthropic(base_url=url, api_key=limited, max_retries=0)
    lo.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    la.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    try:
        la.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        check("limits: the third request in a minute is refused (Messages)", False)
    except anthropic.RateLimitError as e:
        check("limits: the third request in a minute is refused (Messages)",
              e.body["error"]["type"] == "rate_limit_error", e.body)
    try:
        lo.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        check("limits: … and on Responses", False)
    except openai.RateLimitError:
        check("limits: … and on Responses", True)
    capped = key_for("capped")
    server.admin("price", "set", "--model", MODEL, "--input", "1000", "--cached-input", "100", "--output", "2000")
    server.admin("tenant", "budget", "capped", "--monthly-usd", "0.00001")
    co = OpenAI(base_url=url + "/v1", api_key=capped, max_retries=0)
    ca = Anthropic(base_url=url, api_key=capped, max_retries=0)
    try:
        co.responses.create(model=MODEL, input="Write a story.", max_output_tokens=64)
        check("budget: a hard budget refuses (Responses)", False)
    except openai.APIStatusError as e:
        check("budget: a hard budget refuses (Responses)", e.status_code == 402
              and e.body["code"] == "budget_exceeded", e.body)
    try:
        ca.messages.create(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "Write a story."}])
        check("budget: … and on Messages", False)
    except anthropic.APIStatusError as e:
        check("budget: … and on Messages", e.status_code == 402 and e.body["error"]["type"] == "billing_error", e.body)
    rows = json.loads(server.admin("usage", "--tenant", "limited"))
    rows = rows if isinstance(rows, list) else rows.get("rows", rows.get("data", []))
    by = {}
    for row in rows:
        by[row["endpoint"]] = by.get(row["endpoint"], 0) + 1
    check("usage: one row per request, the endpoint a column",
          by.get("/v1/responses") == 2 and by.get("/v1/messages") == 2, by)
finally:
    server.stop()

check.exit("agent-apis")
