"""Hearth's API against its own OpenAPI documents, from outside (scripts/api-check).

A real `hearth serve` (fresh data directory, the default model, an admin token) publishes
`/openapi.json` (public and self-service) and `/admin/v1/openapi.json` (admin). Then:
  1. every operation of both documents is sent without a credential and with a wrong one:
     each protected operation answers 401 in its error shape, the probes and
     `/openapi.json` answer 200;
  2. Schemathesis runs on the public operations, the self-service ones and the admin ones
     with every check it has (`--checks all`: positive data accepted and negative data
     refused included); an operation or check left out has its reason beside it
     (POSITIVE_EXCEPTIONS, the runs' `--exclude-checks`); any failure fails the script.
Completions are capped (by a Schemathesis hook) at a few tokens so that a bounded run stays
short on two cores; the server itself is not configured any differently.
"""
import argparse, json, os, subprocess, sys, tempfile, time, urllib.error, urllib.request

sys.path.insert(0, os.path.dirname(__file__))
from harness import Checks, Serve

ADMIN_TOKEN = "api-check-admin-token-0123456789abcdef"
MODEL = "smollm2-135m-instruct"
# Every check Schemathesis has (server errors, status codes, content types, response
# schemas and headers, positive data accepted and negative data refused, required headers,
# unsupported methods and their `allow` header, use after free, resources available after
# creation, ignored auth, object-level authorization). A run leaves a check out only with
# its reason written beside it.
CHECKS = "all"
# Operations whose schema-valid requests the server may still refuse, each with why: a rule
# that ties two fields together or depends on what exists (a file, a model, a valid
# component), which a JSON Schema cannot state. Only `positive_data_acceptance` is left out
# for them; every other check (negative data refused included) runs on them as on the rest.
POSITIVE_EXCEPTIONS = [
    ("POST /v1/chat/completions", "a valid request depends on the model (its context length, its template's roles) and on rules across fields: tool_choice names a function in tools, stream_options needs stream, a tool message needs its call"),
    ("POST /v1/completions", "stream_options needs stream; the prompt must fit the model's context"),
    ("POST /v1/responses", "tool_choice names a function in tools; previous_response_id and item references must exist; the input must leave the model something to read"),
    ("POST /v1/messages", "tool_choice names a tool in tools; messages alternate roles as the model's template needs; the prompt must fit the context"),
    ("POST /v1/messages/count_tokens", "tools and messages follow the same cross-field rules as /v1/messages"),
    ("POST /v1/files", "the file must hold at least one JSONL line"),
    ("POST /v1/batches", "the input file must exist, be the caller's and hold batchable lines"),
    ("GET /v1/tenant/usage", "'to' must be after 'from'"),
    ("GET /v1/tenant/usage/export", "'to' must be after 'from'"),
    ("GET /admin/v1/billing/export", "'to' must be after 'from'; a per-request export names a tenant"),
    ("POST /v1/tenant/keys", "expires_in and expires_at exclude each other; models must be served and within the creator's"),
    ("POST /admin/v1/tenants/{tenant}/keys", "expires_in and expires_at exclude each other; models must be served"),
    ("POST /v1/tenant/processors", "the body must be a WebAssembly component of Hearth's processor world"),
    ("POST /admin/v1/tenants/{tenant}/processors", "the body must be a WebAssembly component of Hearth's processor world"),
    ("POST /v1/tenant/adapters", "base_model must be a served model and the files a LoRA adapter that fits it"),
    ("POST /admin/v1/tenants/{tenant}/adapters", "base_model must be a served model and the files a LoRA adapter that fits it"),
    ("POST /admin/v1/models", "source must be a model Hearth can fetch and load"),
    ("POST /admin/v1/prices", "'*' or a model id; effective_from may not be in the past once the model has a price"),
    ("POST /admin/v1/tenants", "the name is printable, without surrounding spaces, and not 'tn_…' (an id's prefix)"),
    ("PUT /admin/v1/keys/{key_id}/limits", "share is a tenant's setting: a key's limits refuse it (the Limits schema is shared)"),
    ("PUT /admin/v1/tenants/{tenant}/budget", "a USD amount has at most 6 decimals and fits in nano-dollars"),
    ("POST /admin/v1/tenants/{tenant}/jwt-issuers", "exactly one of key, jwks and jwks_url, of the algorithm's kind; issuer and audience 1-512 bytes"),
    ("PUT /admin/v1/tenants/{tenant}/sso", "the issuer must be an https URL of an OpenID provider (http only on loopback)"),
    ("POST /admin/v1/tenants/{tenant}/members", "the address must be an e-mail address"),
]
SCHEMATHESIS_TOML = "".join(
    f'# {why}\n[[operations]]\ninclude-name = "{name}"\nchecks.positive_data_acceptance.enabled = false\n\n'
    for name, why in POSITIVE_EXCEPTIONS
)
HOOKS = '''
import schemathesis

CAP = {cap}
MODEL = "{model}"
LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")

# Processors are uploaded as raw bytes.
schemathesis.serializer.alias("application/wasm", "application/octet-stream")

@schemathesis.hook
def map_case(context, case):
    # The model served (a random name is only ever a 404: the rest of the request would never
    # be looked at), and a short generation; every other field is left as generated. A value
    # the document refuses (an empty model, n past its maximum) is left alone: a negative
    # case must stay negative.
    if isinstance(case.body, dict):
        if isinstance(case.body.get("model"), str) and case.body["model"] and case.path.startswith("/v1/"):
            case.body["model"] = MODEL
        for k in LIMITS:
            v = case.body.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > CAP:
                case.body[k] = CAP
        n = case.body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and 2 < n <= 16:
            case.body["n"] = 2
    return case
'''


def request(method, url, headers=None, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def operations(doc):
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            yield path, method.upper(), op


def concrete(path):
    """A path with its parameters filled (ids that exist nowhere)."""
    out = path.replace("{slot}", "0")
    while "{" in out:
        a, b = out.index("{"), out.index("}")
        out = out[:a] + "nonexistent" + out[b + 1:]
    return out


def auth_probe(check, url, doc, secured_default, good_key=None):
    for path, method, op in operations(doc):
        secured = bool(op.get("security")) or (secured_default and "security" not in op)
        target = url + concrete(path)
        body = {} if method in ("POST", "PUT") else None
        if not secured:
            status, _ = request(method, target)
            check(f"{method} {path} answers without a credential", status == 200, status)
            continue
        for label, headers in [("no credential", {}),
                               ("a wrong bearer token", {"authorization": "Bearer hk_wrongwrongwrong"}),
                               ("a wrong x-api-key", {"x-api-key": "hk_wrongwrongwrong"})] + (
                              [("a wrong bearer token beside a good x-api-key",
                                {"authorization": "Bearer hk_wrongwrongwrong", "x-api-key": good_key})]
                              if good_key else []):
            status, raw = request(method, target, headers, body)
            # Paced under the gateway's throttle of bad credentials (a burst of 50, then 10
            # a second per address), which would otherwise answer 429 to the rest.
            time.sleep(0.12)
            try:
                err = json.loads(raw)
                shaped = isinstance(err.get("error"), dict) and "message" in err["error"]
            except ValueError:
                shaped = False
            check(f"{method} {path} refuses {label}", status == 401 and shaped, (status, raw[:200]))


def schemathesis(st, doc_path, url, headers, checks, args, label, extra, cwd):
    # Every check is Schemathesis's default; naming them on the command line would also
    # override the per-operation settings of `schemathesis.toml`.
    chosen = [] if checks == "all" else ["--checks", checks]
    cmd = [st, "run", doc_path, "--url", url, *chosen,
           "--max-examples", str(args.examples), "--seed", str(args.seed), "--generation-deterministic",
           "--phases", args.phases, "--suppress-health-check", "all", "--request-timeout", "120",
           "--no-color", "--continue-on-failure", *extra]
    for h in headers:
        cmd += ["-H", h]
    print(f"== Schemathesis: {label}", flush=True)
    # Run in the scratch directory: Schemathesis keeps a cache (`.schemathesis/`) in its cwd.
    return subprocess.run(cmd, cwd=cwd).returncode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hearth", required=True)
    ap.add_argument("--st", required=True)
    ap.add_argument("--examples", type=int, default=50)
    ap.add_argument("--seed", type=int, default=20261203)
    ap.add_argument("--phases", default="examples,coverage,fuzzing")
    ap.add_argument("--long", action="store_true", help="the long run: longer completions")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="hearth-api-check-")
    with open(os.path.join(work, "api_check_hooks.py"), "w") as f:
        f.write(HOOKS.format(cap=64 if args.long else 4, model=MODEL))
    # Read by Schemathesis from its working directory.
    with open(os.path.join(work, "schemathesis.toml"), "w") as f:
        f.write(SCHEMATHESIS_TOML)
    server = Serve(args.hearth, "api", {"HEARTH_ADMIN_TOKEN": ADMIN_TOKEN, "HEARTH_DEFAULT_MAX_TOKENS": "4"})
    check = Checks()
    failed_runs = []
    try:
        url = server.wait_url()
        server.admin("tenant", "create", "api")
        key = json.loads(server.admin("key", "create", "--tenant", "api", "--scopes", "inference,manage"))["key"]

        status, raw = request("GET", url + "/openapi.json")
        check("GET /openapi.json without a credential", status == 200, status)
        public = json.loads(raw)
        status, _ = request("GET", url + "/admin/v1/openapi.json")
        check("GET /admin/v1/openapi.json refused without the admin token", status == 401, status)
        status, raw = request("GET", url + "/admin/v1/openapi.json", {"authorization": f"Bearer {ADMIN_TOKEN}"})
        check("GET /admin/v1/openapi.json with the admin token", status == 200, status)
        admin = json.loads(raw)
        for name, doc in [("public", public), ("admin", admin)]:
            check(f"{name} document is OpenAPI 3.1", doc.get("openapi", "").startswith("3.1"), doc.get("openapi"))

        auth_probe(check, url, public, secured_default=False, good_key=key)
        auth_probe(check, url, admin, secured_default=True)

        paths = {}
        for name, doc in [("public", public), ("admin", admin)]:
            paths[name] = os.path.join(work, f"{name}.json")
            with open(paths[name], "w") as f:
                json.dump(doc, f)
        os.environ["SCHEMATHESIS_HOOKS"] = "api_check_hooks"
        os.environ["PYTHONPATH"] = work + os.pathsep + os.environ.get("PYTHONPATH", "")
        bearer = [f"Authorization: Bearer {key}"]
        runs = [
            ("the OpenAI routes, models and probes", paths["public"], bearer, CHECKS,
             ["--exclude-tag", "self-service", "--exclude-path-regex", "^/v1/messages"]),
            # Messages take the key as `x-api-key` or a bearer token: with the bearer token
            # sent, `ignored_auth` adds a wrong `x-api-key` and expects a refusal, but either
            # credential satisfies the operation (OpenAPI's alternatives) and `Authorization`
            # is the one used. The auth probe above covers these two operations instead.
            ("the Anthropic Messages routes", paths["public"], bearer,
             CHECKS, ["--include-path-regex", "^/v1/messages", "--exclude-checks", "ignored_auth"]),
            ("the self-service API", paths["public"], bearer, CHECKS, ["--include-tag", "self-service"]),
            # Without `ignored_auth`: its wrong admin tokens would throttle this address,
            # and then the right one too. The auth probe above sends every admin operation
            # without and with a wrong token, paced under the throttle.
            ("the admin API", paths["admin"], [f"Authorization: Bearer {ADMIN_TOKEN}"],
             CHECKS, ["--exclude-checks", "ignored_auth"]),
        ]
        for label, doc, headers, checks, extra in runs:
            if schemathesis(args.st, doc, url, headers, checks, args, label, extra, work) != 0:
                failed_runs.append(label)
        check("Schemathesis passes on every document", not failed_runs, failed_runs)
        # Not vacuous: generated requests got past validation and were answered by the model.
        auth = {"authorization": f"Bearer {key}"}
        request("GET", url + "/v1/tenant", auth)  # flushes the usage ledger
        status, raw = request("GET", url + "/v1/tenant/usage", auth)
        metered = json.loads(raw)["totals"]["requests"] if status == 200 else 0
        print(f"generated requests answered by the model and metered: {metered}")
        check("generated requests reached the model", metered > 0, (status, raw[:200]))
        # The server survived all of it.
        status, _ = request("GET", url + "/livez")
        check("the server still answers", status == 200, status)
    finally:
        server.stop()
    check.exit("api-check")


if __name__ == "__main__":
    main()
