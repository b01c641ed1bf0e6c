"""The smallest Python processor: every hook continues (the benchmark's Python guest)."""

import hearth_processor
import wit_world
from wit_world.imports import types

# componentize-py reseeds `random` at every instance's first call, whether or not the
# processor uses it (about half of this processor's time per request); this defers that
# reseed to the first draw, so a processor that never draws never pays.
hearth_processor.seed_random_lazily()


class WitWorld(hearth_processor.Continue, wit_world.WitWorld):
    """Every hook is `Continue`'s."""


# Module-level code runs once, while componentize-py makes the snapshot every instance
# starts from: running the hooks here on a sample takes the interpreter's first-run work
# (and the memory pages it writes) out of every request. Host imports (config, log) are
# not available yet, so a hook that calls them is warmed through its own pure parts (see
# pii-redactor).
_warm = WitWorld()
for _ in range(20):
    _warm.on_request(types.Request(tenant="", model="", endpoint="", body="{}", headers=[]))
    _warm.on_response(types.Response(tenant="", model="", endpoint="", body="{}"))
    _warm.on_chunk(0, "")
    _warm.on_stream_end()
del _warm
