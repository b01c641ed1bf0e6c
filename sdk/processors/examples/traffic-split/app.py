"""Traffic split: sends a share of a model's requests to other models (a canary, an A/B
test), drawn at random per request.

config: {"split": {"MODEL": {"OTHER-MODEL": SHARE, ...}, ...}}
  For a request to MODEL, each OTHER-MODEL gets SHARE of the requests (0 to 1, together at
  most 1); the rest keep MODEL. Requests to other models continue. Every route names the
  model in the body's top-level "model", so the split is the same on every route.
"""

import json
import random

import hearth_processor
import wit_world
from wit_world.imports import host, types

# Each instance's fresh seed is drawn at its first draw, not at every request's first call
# (see hearth_processor).
hearth_processor.seed_random_lazily()


def shares_of(cfg, model):
    """The shares of MODEL's requests that go elsewhere ({} when it is not split); raises
    ValueError on a malformed configuration."""
    if not isinstance(cfg, dict):
        raise ValueError("the configuration must be an object")
    split = cfg.get("split", {})
    if not isinstance(split, dict):
        raise ValueError('"split" must be an object of models')
    shares = split.get(model, {})
    if not isinstance(shares, dict):
        raise ValueError(f'"split"."{model}" must be an object of models and shares')
    for target, share in shares.items():
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f'the share of "{target}" must be a number from 0 to 1')
    if sum(shares.values()) > 1 + 1e-9:
        raise ValueError(f'the shares of "{model}" add up to more than 1')
    return shares


def route(raw, cfg):
    """The model this request goes to (None: it keeps its own) and the parsed body; raises
    ValueError on a malformed configuration. A body that is not JSON keeps its model (the
    gateway then refuses it with its own 400)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None, None
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str):
        return None, body
    shares = shares_of(cfg, model)
    if not shares:
        return None, body
    draw = random.random()
    for target, share in shares.items():
        if draw < share:
            return (None if target == model else target), body
        draw -= share
    return None, body


class WitWorld(hearth_processor.Continue, wit_world.WitWorld):
    def on_request(self, req: types.Request) -> types.Action:
        try:
            cfg = json.loads(host.config() or "{}")
            target, body = route(req.body, cfg)
        except ValueError as e:
            return types.Action_Reject(types.Rejection(500, f"traffic-split configuration: {e}"))
        if target is None:
            return types.Action_Continue()
        host.log(host.Level.INFO, f"sent a request for {body['model']} to {target}")
        body["model"] = target
        return types.Action_Replace(json.dumps(body))


# Warm-up, as in the trivial example: the hook's pure part on a sample (config and log are
# not available while the snapshot is made). Its draws use the snapshot's generator, which
# every instance reseeds before its own first draw.
for _ in range(20):
    route('{"model": "m", "messages": []}', {"split": {"m": {"a": 0.5}}})
