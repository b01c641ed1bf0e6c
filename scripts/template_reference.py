"""Chat templates rendered as Hugging Face `transformers.apply_chat_template` renders them
(a sandboxed Jinja2 environment with trim_blocks, lstrip_blocks and loop controls; its
`tojson`, `raise_exception`, `strftime_now` and `{% generation %}`), for the differential
test of Hearth's renderer (gpu-workers/protocol/tests/templates.rs). Learned from
transformers' chat_template_utils; run with the venv `scripts/reference-data` makes.

Usage: template_reference.py CASES.json TEMPLATE_DIR  → JSON on stdout:
{template file: {case name: {"text": …} | {"error": …}}}"""
import datetime, json, os, sys

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

cases = json.load(open(sys.argv[1]))
now = datetime.datetime.fromisoformat(cases["now"])


class Generation(Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text; it renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return now.strftime(fmt)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                    extensions=[Generation, jinja2.ext.loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = strftime_now

out = {}
tdir = sys.argv[2]
for name in sorted(os.listdir(tdir)):
    if not name.endswith(".jinja"):
        continue
    src = open(os.path.join(tdir, name), encoding="utf-8").read()
    res = {}
    try:
        tmpl = env.from_string(src)
    except Exception as e:  # a template Jinja2 itself cannot compile
        out[name] = {"compile_error": f"{type(e).__name__}: {e}"}
        continue
    for case in cases["cases"]:
        ctx = dict(case.get("kwargs", {}))
        ctx.update(messages=case["messages"], tools=cases["tools"] if case.get("tools") else None,
                   documents=None, add_generation_prompt=case.get("add_generation_prompt", True),
                   bos_token=cases["bos_token"], eos_token=cases["eos_token"])
        try:
            res[case["name"]] = {"text": tmpl.render(**ctx)}
        except Exception as e:
            res[case["name"]] = {"error": f"{type(e).__name__}: {e}"}
    out[name] = res
json.dump(out, sys.stdout, ensure_ascii=False, indent=1)
