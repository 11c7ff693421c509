"""pandas values in alias groups and symbol hashes, through a real server and store.

pandas objects share internals no write can reach through them (Index
objects, dtypes, blocks under copy-on-write): those must not join frames
into one group, or a cell that reads one frame re-pickles them all. Data
that is really shared (a numpy array and a Series made on it without a
copy, two names for one list) stays one group, and stays shared after a
restore.
"""

import lmdb

SETUP = (
    "import numpy as np, pandas as pd\n"
    "raw = pd.DataFrame({'x': np.arange(5.0), 'd': pd.date_range('2024-01-01', periods=5)})\n"
    "df = raw.assign(y=raw['x'] * 2)\n"
    "col = df['x']\n"
    "xs = [1, 2]\n"
    "ys = xs\n"
    "a = np.arange(3.0)\n"
    "t = pd.Series(a, copy=False)\n"
)


def blob_count(data_dir):
    """How many blobs the store holds (read between requests, without the lock file)."""
    env = lmdb.open(str(data_dir), readonly=True, lock=False, max_dbs=8)
    try:
        with env.begin() as txn:
            return txn.stat(env.open_db(b"blobs", txn=txn, create=False))["entries"]
    finally:
        env.close()


def test_pandas_internals_do_not_join_groups_but_shared_data_does(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute(SETUP, new="pg")
    # What the frames share: dtypes, and memory (copy-on-write; a plain copy would not).
    assert srv.value("pg", "np.shares_memory(raw['x'].array, df['x'].array), "
                           "np.shares_memory(df['x'].array, col.array)") == "(True, True)"
    groups = srv.post("/alias_groups", {"state_name": "pg"}).json()["groups"]
    assert ["raw"] in groups and ["df"] in groups and ["col"] in groups
    assert ["xs", "ys"] in groups and ["a", "t"] in groups
    srv.stop()
    # Restored from the store by a new server: what was shared still is, what was not
    # still is not.
    again = make_server(data)
    again.execute("a[0] = 99.0\nys.append(3)\ndf.loc[0, 'x'] = -1.0", state="pg", new="pg2")
    assert again.value("pg2", "float(t[0]), xs, float(raw.loc[0, 'x']), float(df.loc[0, 'x']), "
                              "float(col[0])") == "(99.0, [1, 2, 3], 0.0, -1.0, 0.0)"


def test_a_cell_that_only_reads_a_frame_stores_nothing_new_for_it(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import pandas as pd\n"
                "frame = pd.DataFrame({'d': pd.date_range('2024-01-01', periods=50_000, "
                "freq='min'), 'v': range(50_000)})\n"
                "frame = frame[frame['v'] >= 0]", new="r1")
    before = blob_count(data)
    # Filtering fills a cache inside the frame's datetime array (made by the filter above
    # without one).
    answer = srv.execute("frame[frame['v'] > 10].shape, int(frame['d'].dt.year.sum())",
                         state="r1", new="r2")
    assert answer["accessed_symbols"] == ["frame"] and answer["modified_symbols"] == []
    # One new blob: the cell's answer, kept for a retry of its exec_id (docs/fleet.md);
    # none for the frame.
    assert blob_count(data) == before + 1

    def hashes(state):
        """The symbol hash of `frame` and the fingerprints of the state's groups."""
        body = srv.post("/alias_groups", {"state_name": state}).json()
        return (srv.post("/symbol_hashes", {"state_name": state, "symbols": ["frame"]})
                .json()["hashes"]["frame"], body["fingerprints"])

    assert hashes("r1") == hashes("r2")


def test_a_frames_alias_walk_does_not_grow_with_the_views_taken_of_it():
    """pandas keeps a weak reference for every view of a block (copy-on-write
    bookkeeping), dead ones included until it cleans them: a frame a notebook has read
    a column from 500 times must cost the alias walk of every save that touches it no
    more than after 10 times, and still join a variable that holds its data plainly."""
    import numpy as np
    import pandas as pd

    from snapkernel.storage import groups

    data = np.arange(10.0)
    df = pd.DataFrame({"a": data, "b": np.arange(10)}, copy=False)
    views = [df["a"] for _ in range(10)]
    few = sum(1 for _ in groups._identity_keys(df, {}))
    views += [df["a"] for _ in range(490)]
    assert sum(1 for _ in groups._identity_keys(df, {})) == few
    assert groups.alias_groups({"df": df, "data": data, "views": views}, {}) == \
        [["data", "df", "views"]]
