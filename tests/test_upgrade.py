"""A store made by an earlier version opens in this one: its states restore whole.

The earlier version is a real one, the tree of the last commit before our code moved
into the one package `snapkernel` (its pickles name our helpers `storage.serializer...`),
taken from this repository's history and served from a temporary folder."""

from support.server import earlier_tree


MAKE = """
import random
import numpy as np
import pandas as pd
random.seed(7)
np.random.seed(7)
scale = 3
def f(x):
    return x * scale
class Point:
    def __init__(self, x):
        self.x = x
    def scaled(self):
        return f(self.x)
p = Point(2)
a = np.arange(10.0)
b = a[:4]
df = pd.DataFrame({"n": [1, 2, 3], "s": ["x", "y", "z"]})
"""
PROBE = ("scale = 5\nb[0] = 99.0\n"
         "print(f(2), p.scaled(), isinstance(p, Point), a[0], df.s.tolist(), "
         "random.random(), np.random.rand())")


def test_a_store_made_before_the_rename_restores_in_this_version(make_server, tmp_path):
    """Functions bound to the restored globals, one class for its instances, a numpy view
    writing through, a frame, the seeded generators: all as the earlier server gave
    them, from a new server of this version on the same store."""
    store = tmp_path / "store"
    old = make_server(store, cwd=str(earlier_tree(tmp_path / "earlier")))
    old.execute(MAKE, new="made")
    expected = old.execute(PROBE, state="made")
    old.stop()
    new = make_server(store)
    again = new.execute(PROBE, state="made")
    assert again["output"] == expected["output"]
    assert "".join(o["text"] for o in again["output"]).startswith(
        "10 10 True 99.0 ['x', 'y', 'z'] ")
