"""PII redaction: replaces e-mail addresses and phone numbers in prompts before the model
sees them.

config: {"redact": ["email", "phone"], "email": "[EMAIL]", "phone": "[PHONE]"}
(every key optional; by default both kinds are redacted with those placeholders).
"""

import json
import re

import hearth_processor
import wit_world
from wit_world.imports import host, types

# No draws from `random` here: its per-instance reseed is deferred to a first draw that
# never comes (see the trivial example).
hearth_processor.seed_random_lazily()

EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
# International or North-American style numbers: +44 20 7946 0958, (555) 123-4567, 555.123.4567.
PHONE = re.compile(r"(?<![\w])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{2,4}\)|\d{2,4})(?:[\s.-]?\d{2,4}){2,4}(?![\w])")


def redact(text, cfg):
    kinds = cfg.get("redact", ["email", "phone"])
    count = 0
    if "email" in kinds:
        text, n = EMAIL.subn(cfg.get("email", "[EMAIL]"), text)
        count += n
    if "phone" in kinds:
        text, n = PHONE.subn(cfg.get("phone", "[PHONE]"), text)
        count += n
    return text, count


def redact_body(raw, cfg):
    """The request body with its prompts redacted (None when nothing was), and the count."""
    body = json.loads(raw)
    total = 0
    if isinstance(body.get("messages"), list):
        for m in body["messages"]:
            if isinstance(m.get("content"), str):
                m["content"], n = redact(m["content"], cfg)
                total += n
            elif isinstance(m.get("content"), list):
                for part in m["content"]:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        part["text"], n = redact(part["text"], cfg)
                        total += n
    if isinstance(body.get("prompt"), str):
        body["prompt"], n = redact(body["prompt"], cfg)
        total += n
    return (json.dumps(body) if total else None), total


class WitWorld(hearth_processor.Continue, wit_world.WitWorld):
    def on_request(self, req: types.Request) -> types.Action:
        cfg = json.loads(host.config() or "{}")
        out, total = redact_body(req.body, cfg)
        if out is None:
            return types.Action_Continue()
        host.log(host.Level.INFO, f"redacted {total} item(s)")
        return types.Action_Replace(out)


# Warm-up, as in the trivial example: the hook's own work on a sample, without its host
# calls (config and log are not available while the snapshot is made).
for _ in range(20):
    redact_body('{"messages": [{"role": "user", "content": "a@b.example, +1 555 123 4567"}]}', {})
