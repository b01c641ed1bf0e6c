"""Helpers for Hearth processors written in Python (componentize-py).

Put this directory on componentize-py's path (`-p sdk/processors/python -p .`) and call the
helpers from `app.py`'s module-level code, which runs once, in the snapshot every instance
starts from.

`seed_random_lazily()`
    componentize-py reseeds `random` from the host's entropy at the first call of every
    instance, so that instances do not share the snapshot's sequence. That draws 2,496 bytes
    through WASI and rewrites the generator's state: about half of a trivial processor's
    time per request, paid whether or not the processor uses `random`. After this call the
    reseed is drawn when `random`'s shared generator is first used in the instance instead,
    so a processor that never uses it never pays, and one that does gets the same fresh
    sequence as before.
"""

import functools
import random
import sys

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
        _owed = False
        _SEED()


def seed(a=None, version=2):
    """`random.seed`: with no value (componentize-py's reseed of every instance, or the
    processor's own), the fresh seed is drawn at the generator's next use; with a value, it
    is used now."""
    global _owed
    if a is None:
        _owed = True
    else:
        _owed = False
        _SEED(a, version)


def setstate(state):
    """`random.setstate`: the given state replaces any owed reseed."""
    global _owed
    _owed = False
    _SETSTATE(state)


def _lazy(method):
    @functools.wraps(method)
    def draw(*args, **kwargs):
        if _owed:
            _settle()
        return method(*args, **kwargs)

    return draw


def _replacement(value):
    """What stands in for one of the shared generator's bound methods (None: not one)."""
    if getattr(value, "__self__", None) is not _INST:
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

    Every module-level reference to the shared generator's methods is replaced: `random`'s
    own functions and any that another module imported them (`from random import choice`).
    Call it before code that keeps one elsewhere (a default argument, a closure); such a
    reference would use the generator without drawing the owed reseed. Generators of your
    own (`random.Random()`) are seeded where they are made: make them inside a hook, not at
    module level, or every instance starts with the snapshot's.
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
