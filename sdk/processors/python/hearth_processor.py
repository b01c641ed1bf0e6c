"""Helpers for Hearth processors written in Python (componentize-py).

Put this directory on componentize-py's path before the app's (`-p SDK/python -p APP_DIR`),
and call the helpers from `app.py`'s module-level code, which runs once, in the snapshot
every instance starts from.

`seed_random_lazily()`
    componentize-py reseeds `random` from the host's entropy at the first call of every
    instance, so that instances do not share the snapshot's sequence. That draws 2,496 bytes
    through WASI and rewrites the generator's state: about half of a trivial processor's
    time per request, paid whether or not the processor uses `random`. After this call the
    reseed is drawn when `random`'s shared generator is first used in the instance instead,
    so a processor that never uses it never pays, and one that does draws from a fresh seed
    as before.

`Continue`
    A base for the app's `WitWorld` whose four hooks all continue, so the app defines only
    the hooks that act: `class WitWorld(hearth_processor.Continue, wit_world.WitWorld)`.
"""

import functools
import random
import sys

try:
    from wit_world.imports.types import Action_Continue
except ImportError:  # outside a componentize-py build (checking the helpers on a host)

    def Action_Continue():
        raise RuntimeError("hearth_processor.Continue's hooks run only in a componentize-py build")


# The shared generator behind random's module-level functions.
_INST = random._inst
# Its own methods, which draw nothing lazily.
_SEED = _INST.seed
_SETSTATE = _INST.setstate
# A reseed from the host's entropy is owed before the generator's next use.
_owed = False
_installed = False


def _settle():
    """Draws the owed reseed (a no-op when none is owed)."""
    global _owed
    if _owed:
        _SEED()  # cleared only once drawn: a failed draw leaves it owed
        _owed = False


def seed(a=None, version=2):
    """`random.seed`: with no value (componentize-py's reseed of every instance, or the
    processor's own), the fresh seed is drawn at the generator's next use; with a value, it
    is used now."""
    global _owed
    if a is None:
        _owed = True
    else:
        # Cleared only once the seed took: a value it refuses leaves the reseed owed.
        _SEED(a, version)
        _owed = False


def setstate(state):
    """`random.setstate`: the given state replaces any owed reseed."""
    global _owed
    _SETSTATE(state)
    _owed = False


def _lazy(method):
    @functools.wraps(method)
    def draw(*args, **kwargs):
        _settle()
        return method(*args, **kwargs)

    return draw


def _replacement(value):
    """What stands in for one of the shared generator's bound methods (None: not one)."""
    try:
        if getattr(value, "__self__", None) is not _INST:
            return None
    except Exception:  # a proxy whose attributes raise is not one of them
        return None
    name = getattr(value, "__name__", "")
    if name == "seed":
        return seed
    if name == "setstate":
        return setstate
    return _lazy(value)


def seed_random_lazily():
    """Defers componentize-py's per-instance reseed of `random` to the shared generator's
    first use in the instance (see the module's documentation).

    Every reference to the shared generator's methods in a module's globals is replaced:
    `random`'s own functions, and those other modules imported (`from random import
    choice`), before or after this call. Call it before any code keeps one elsewhere (a
    default argument, a closure, a class attribute, a container); such a reference would
    draw without the owed reseed. Generators of your own (`random.Random()`) are seeded
    where they are made: make them inside a hook, not at module level, or every instance
    starts with the snapshot's state.
    """
    global _installed
    if _installed:
        return
    for module in list(sys.modules.values()):
        if module is sys.modules[__name__]:
            continue  # _SEED and _SETSTATE are the real methods the stand-ins call
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for name, value in list(names.items()):
            stand_in = _replacement(value)
            if stand_in is not None:
                names[name] = stand_in
    _installed = True


class Continue:
    """Hooks that let everything through unchanged. List it before `wit_world.WitWorld` in
    the app's bases and override the hooks the processor acts on."""

    def on_request(self, req):
        return Action_Continue()

    def on_response(self, resp):
        return Action_Continue()

    def on_chunk(self, index, text):
        return Action_Continue()

    def on_stream_end(self):
        return Action_Continue()
