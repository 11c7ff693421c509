"""Arrow-backed string columns (pandas' "str" dtype with pyarrow) through the store:
exact round trips across a restart, no copy of an unchanged column, the restored
holder's full load."""

import json
import os

import numpy as np
import pandas as pd
import pytest
import zstandard

from snapkernel.kernel import config, trace
from snapkernel.storage import serializer
from snapkernel.storage.store import Store, StoreCorrupt
from support.server import store_bytes, wait_for

ROWS = 300_000
# Six float columns and a string column with nulls and non-ASCII text, its buffers
# larger than a chunk (1 MiB), and a short string Series kept in band.
FRAME = f"""
import numpy as np
import pandas as pd
_r = np.random.default_rng(3)
df = pd.DataFrame(_r.random(({ROWS}, 6)), columns=list('abcdef'))
df['s'] = pd.Series([f'v{{i}}-é' if i % 7 else None for i in range(len(df))], dtype='str')
few = pd.Series(['x', None, 'zß'], dtype='str')
part = df['s'].iloc[10:20]
del _r
"""
PROBE = ("str(df['s'].dtype), type(df['s'].array).__name__, str(few.dtype), "
         "str(part.dtype), int(pd.util.hash_pandas_object(df).sum()), "
         "int(df['s'].isna().sum()), few.tolist(), part.tolist()")


def test_string_frame_round_trips_a_restart_exactly(make_server, tmp_path):
    """Values, dtypes, symbol hashes and outputs of a string-column frame are the same
    after a restart; the state is written in several transactions (write_batch_mb)."""
    data = tmp_path / "store"
    config = "[store]\nwrite_batch_mb = 1\n"
    srv = make_server(data, config=config)
    first = srv.execute(FRAME + "df.head(3)", new="S")
    symbols = {"state_name": "S", "symbols": ["df", "few", "part"]}
    before = (srv.value("S", PROBE), srv.post("/symbol_hashes", symbols).json())
    assert before[0].split()[:4] == ["('str',", "'ArrowStringArray',", "'str',", "'str',"]
    srv.stop()
    again = make_server(data, config=config)
    assert (again.value("S", PROBE), again.post("/symbol_hashes", symbols).json()) == before
    shown = again.execute("df.head(3)", state="S", new="S2")
    assert shown["output"][0]["data"] == first["output"][0]["data"]
    # The restored column is a column like any other: changed in a new state only.
    again.execute("df.loc[1, 's'] = 'changed'", state="S", new="S3")
    assert again.value("S3", "df.loc[1, 's'], str(df['s'].dtype)") == "('changed', 'str')"
    assert again.value("S", "df.loc[1, 's']") == "'v1-é'"


def test_unchanged_string_column_is_not_stored_again(make_server, tmp_path):
    """A state whose cell adds a float column to the frame adds that column's bytes,
    not the string column's; a copy of the string column adds nothing."""
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute(FRAME, new="S")
    strings = int(srv.value("S", "df['s'].array._pa_array.get_total_buffer_size()"))
    assert strings > 3 * 2 ** 20
    before = store_bytes(data)
    srv.execute("df['g'] = df['a'] * 2", state="S", new="A")
    assert store_bytes(data) - before < 1.2 * 8 * ROWS + 2 ** 17
    before = store_bytes(data)
    srv.execute("t = df[['s']].copy()", state="A", new="T")
    assert store_bytes(data) - before < 2 ** 17
    srv.stop()
    # After a restart too: the restored column keeps its blobs.
    again = make_server(data)
    before = store_bytes(data)
    again.execute("df['h'] = 0.5", state="T", new="B")
    assert store_bytes(data) - before < 1.2 * 8 * ROWS + 2 ** 17
    assert again.value("B", "bool(t['s'].equals(df['s'])), float(df['h'].sum())") == \
        f"(True, {ROWS / 2})"


def test_restored_holder_stamps_its_full_load(make_server, tmp_path):
    """A restored state's holder stamps `loaded` (with the state's name) in the trace
    once every variable is in its memory; a cell needing only `x` answers meanwhile,
    and the cell after the full load runs in a child forked after it."""
    data = tmp_path / "store"
    path = tmp_path / "trace.jsonl"
    config = f"[server]\ntrace_file = {json.dumps(str(path))}\n"
    srv = make_server(data, config=config)
    srv.execute(FRAME + "x = 0", new="S")
    srv.stop()
    again = make_server(data, config=config)
    started = again.started  # time.perf_counter(): CLOCK_MONOTONIC, as the stamps
    assert again.execute("x += 1\nx", state="S")["output"][0]["data"]["text/plain"] == "1"
    wait_for(lambda: [s for s in trace.read(path) if s["phase"] == "loaded" and
                      s["exec"] == "S" and s["role"] == "holder" and s["t"] >= started],
             "a 'loaded' stamp of the restored holder")
    loaded = max(s["t"] for s in trace.read(path) if s["phase"] == "loaded"
                 and s["exec"] == "S" and s["role"] == "holder")
    # The spare taken by `x += 1` was replaced once the holder was loaded: the next cell
    # finds `df` in memory instead of loading it again.
    assert again.execute("len(df), float(df['f'].count())", state="S")["output"][0][
        "data"]["text/plain"] == f"({ROWS}, {float(ROWS)})"
    assert not [s for s in trace.read(path) if s["phase"] == "loading" and s["t"] > loaded]


def test_string_column_pickles_and_restores_its_own_buffers():
    """The large buffers of a string column go out of band as they are (no copy, the
    same addresses at every save) and come back without a copy; a small slice is
    pickled compactly."""
    df = pd.DataFrame({"a": np.arange(ROWS, dtype=float),
                       "s": pd.Series([f"v{i}" for i in range(ROWS)], dtype="str")})
    chunk = df["s"].array._pa_array.chunk(0)
    own = {b.address for b in chunk.buffers() if b is not None and b.size >= 2 ** 16}
    assert len(own) == 2  # offsets and characters
    pickled = serializer.dumps([df], {}, "", 2 ** 16)
    sent = {np.frombuffer(view, np.uint8).ctypes.data for view in pickled.buffers}
    assert own <= sent
    restored = serializer.loads(pickled.payload, pickled.buffers, "c")[0]
    assert restored.equals(df) and str(restored["s"].dtype) == "str"
    back = restored["s"].array._pa_array.chunk(0)
    assert {b.address for b in back.buffers() if b is not None and b.size >= 2 ** 16} <= sent
    part = serializer.dumps([df["s"].iloc[10:20]], {}, "", 2 ** 16)
    assert not part.buffers and len(part.payload) < 4096


def test_blobs_compressed_only_when_it_pays(tmp_path):
    """Random bytes are stored raw (and not compressed whole to find out); repetitive
    ones compressed; 8-byte numbers that compress better byte-shuffled (string
    offsets), shuffled, whole elements or not; each is read back into place, checked."""
    store = Store(str(tmp_path / "store"), config.load())
    noise, text = os.urandom(2 ** 20), b"snapshot " * 2 ** 17
    offsets = (np.arange(2 ** 17 + 1, dtype=np.int64) * 9).tobytes()
    assert store.encode(noise)[:1] == b"H" and store.encode(text)[:1] == b"Z"
    assert store.encode(offsets)[:1] == b"S" and store.encode(offsets[:-3])[:1] == b"S"
    # Shuffled, they take under a tenth of what zstd alone makes of them.
    assert 10 * len(store.encode(offsets)) < len(zstandard.ZstdCompressor().compress(offsets))
    payloads = {f"{i:064x}": data for i, data in enumerate((noise, text, offsets,
                                                            offsets[:-3]))}
    store.write_state("t", {"name": "t", "groups": []}, payloads)
    for key, data in payloads.items():
        target = bytearray(len(data))
        store.read_into(key, memoryview(target))
        assert target == data
        with pytest.raises(StoreCorrupt):
            store.read_into(key, memoryview(bytearray(len(data) - 1)))
