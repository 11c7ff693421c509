"""Pickle pandas arrays without their caches, so a read leaves their pickle as it was.

pandas keeps derived values (`cache_readonly`) in an object's `_cache`
dict, filled on first use: reading a datetime column fills its array's
`_cache` with the unit. Index objects leave `_cache` out of their pickle;
the arrays backing datetime, timedelta, period and categorical columns
(pandas' NDArrayBacked) do not. Pickled with it, a frame a cell only read
would pickle to new bytes: a new fingerprint, new blobs, and a symbol hash
telling clients it changed. The cache is recomputed on first use after a
restore, so leaving it out loses nothing.
"""

import sys


def reduce(obj):
    """A reduction of `obj` without its `_cache`, or None to pickle it as usual."""
    backed = getattr(sys.modules.get("pandas._libs.arrays"), "NDArrayBacked", None)
    if backed is None or not isinstance(obj, backed) or "_cache" not in obj.__dict__:
        return None
    reduced = obj.__reduce_ex__(5)
    # (function, args, (dtype, ndarray[, __dict__])): pandas adds the dict when not empty.
    state = reduced[2]
    rest = {k: v for k, v in state[-1].items() if k != "_cache"}
    return reduced[:2] + (state[:-1] + ((rest,) if rest else ()),) + reduced[3:]
