"""Pickle pandas values without their caches, so a read leaves their pickle as it was.

pandas keeps derived values (`cache_readonly`) in an object's `_cache`
dict, filled on first use: reading a datetime column fills its array's
`_cache` with the unit. Index objects leave `_cache` out of their pickle;
the arrays backing datetime, timedelta, period and categorical columns do
not. Pickled with it, a frame a cell only read would pickle to new bytes:
a new fingerprint, new blobs, and a symbol hash that tells clients it
changed. The cache is recomputed on first use after a restore, so leaving
it out loses nothing.
"""


def reduce(obj):
    """A reduction of `obj` without its `_cache`, or None to pickle it as usual."""
    if not type(obj).__module__.startswith("pandas"):
        return None
    try:
        state = obj.__dict__
    except AttributeError:
        return None
    if not isinstance(state, dict) or "_cache" not in state:
        return None
    reduced = obj.__reduce_ex__(5)
    if not isinstance(reduced, tuple) or len(reduced) < 3:
        return None
    state = reduced[2]
    if isinstance(state, dict) and "_cache" in state:
        state = {k: v for k, v in state.items() if k != "_cache"}
    elif (isinstance(state, tuple) and state and isinstance(state[-1], dict)
          and "_cache" in state[-1]):
        rest = {k: v for k, v in state[-1].items() if k != "_cache"}
        # An empty dict is left out, as pandas does for an object that never cached.
        state = state[:-1] + ((rest,) if rest else ())
    else:
        return None
    return reduced[:2] + (state,) + reduced[3:]
