"""The durable store through the real server: restart, increments, crashes, volatiles."""

import json
import os
import signal
import subprocess
import sys
import threading

import lmdb
import psutil
import pytest
import requests

from snapkernel.kernel import config
from snapkernel.storage.store import Store
from support.server import ROOT, in_thread, store_bytes, wait_for


LINEAGE = """
import numpy as np
import pandas as pd
arr = np.arange(10.0)
view = arr[2:5]
d = {'xs': [1, 2, 3]}
same = d['xs']
df = pd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']})
def total():
    return sum(same) + len(df)
class Point:
    def __init__(self, x):
        self.x = x
    def norm(self):
        return abs(self.x) * scale
scale = 2
p = Point(-3)
"""
PROBE = ("arr.tolist(), view.base is arr, same is d['xs'], df.to_dict('list'), total(), "
         "isinstance(p, Point), p.norm()")


def test_restart_keeps_every_state_identical(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data)
    first = srv.execute(LINEAGE, new="L1")
    second = srv.execute("view[0] = 99.0\nscale = 10", state="L1", new="L2")
    names = srv.get("/states").json()["states"]
    before = {n: (srv.value(n, PROBE),
                  srv.post("/symbol_hashes", {"state_name": n, "symbols": [
                      "arr", "view", "d", "same", "df", "total", "p", "scale"]}).json(),
                  srv.post("/alias_groups", {"state_name": n}).json(),
                  srv.get(f"/states/{n}").json()["variables"])
              for n in ("L1", "L2")}
    srv.stop()
    again = make_server(data)
    assert again.get("/states").json()["states"] == names
    for n in ("L1", "L2"):
        after = (again.value(n, PROBE),
                 again.post("/symbol_hashes", {"state_name": n, "symbols": [
                     "arr", "view", "d", "same", "df", "total", "p", "scale"]}).json(),
                 again.post("/alias_groups", {"state_name": n}).json(),
                 again.get(f"/states/{n}").json()["variables"])
        assert after == before[n]
    assert before["L2"][0].startswith("([0.0, 1.0, 99.0")
    third = again.execute("scale", state="L2")
    assert third["execution_count"] == second["execution_count"] + 1 == \
        first["execution_count"] + 2
    # A restored function reads the restored globals, and the view still writes through.
    again.execute("scale = 100\nview[1] = -1.0", state="L2", new="L3")
    assert again.value("L3", "p.norm(), arr[3]") == "(300, np.float64(-1.0))"


def test_small_cell_beside_big_dataframe_adds_little(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import numpy as np, pandas as pd\n"
                "df = pd.DataFrame(np.random.default_rng(0).random((1_000_000, 25)))",
                new="big")
    before = store_bytes(data)
    srv.execute("k = 1", state="big", new="small")
    assert store_bytes(data) - before < 2 ** 20
    # An unchanged column of a changed DataFrame is not stored again either.
    before = store_bytes(data)
    srv.execute("df['new'] = 1.0", state="small", new="col")
    assert store_bytes(data) - before < 12 * 2 ** 20
    # A masked write into one column of the 2-D block stores about that column.
    before = store_bytes(data)
    srv.execute("df.loc[df[0] > 0.5, 3] = -1.0", state="col", new="masked")
    assert store_bytes(data) - before < 1.2 * 8_000_000
    assert srv.value("masked", "float(df.loc[df[0] > 0.5, 3].max())") == "-1.0"


def test_sigkill_during_executions_loses_no_answered_state(make_server, tmp_path, gate):
    data = tmp_path / "store"
    srv = make_server(data)
    answered = []
    killed = threading.Event()

    def chain():
        """Execute a chain until the server dies, remembering what was answered; the
        error that ended it (any other failure is the thread's, raised to the test)."""
        state, i = "initial", 0
        while True:
            try:
                answer = srv.execute(f"v{i} = list(range({i}))", state=state, new=f"k{i}")
            except requests.ConnectionError as exc:
                assert killed.is_set(), exc  # only the kill may end the chain
                return exc
            answered.append(answer["state_name"])
            state, i = answer["state_name"], i + 1

    ended = in_thread(chain)
    wait_for(lambda: len(answered) >= 15 or ended.done(), "15 states of the chain")
    assert not ended.done(), ended.result()  # (raises what ended the chain early)
    # One execution is surely in flight when the server dies: its cell waits at a gate.
    stuck = gate()
    in_flight = in_thread(srv.execute, stuck.code + "never = 1", new="in-flight")
    (cell,) = stuck.arrived()
    cell = psutil.Process(cell)
    killed.set()
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait()
    assert isinstance(ended.result(timeout=120), requests.ConnectionError)
    with pytest.raises(requests.ConnectionError, match="aborted"):  # cut off mid-request
        in_flight.result(timeout=120)
    cell.kill()  # its server gone, nothing else stops it (it would make its state later)
    cell.wait(60)
    again = make_server(data)
    listed = set(again.get("/states").json()["states"])
    assert set(answered) <= listed
    assert "in-flight" not in listed
    last = answered[-1]
    n = int(last[1:])
    assert again.value(last, f"v{n} == list(range({n}))") == "True"
    for name in listed - {"initial"}:
        assert again.get(f"/states/{name}").json()["name"] == name
    check = subprocess.run([sys.executable, "scripts/check_store.py", "--data-dir", str(data)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"checked {len(listed)} state(s)" in check.stdout and "OK" in check.stdout


def test_volatile_values_live_on_and_replay_after_restart(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("base = [1, 2, 3]", new="v0")
    answer = srv.execute("gen = (x * 10 for x in base)\nkeep = 5", state="v0", new="v1")
    assert answer["volatile_symbols"] == ["gen"]
    assert srv.get("/states/v1").json()["volatile_symbols"] == ["gen"]
    assert srv.value("v1", "next(gen)") == "10"
    srv.execute("k2 = keep + 1", state="v1", new="v2")
    srv.stop()
    again = make_server(data)
    assert again.value("v2", "next(gen), keep, k2") == "(10, 5, 6)"


def test_a_cell_that_only_uses_a_volatile_value_leaves_its_maker_to_replay(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("gen = (x * 10 for x in range(5))", new="made")
    srv.execute("first = next(gen)", state="made", new="used")
    assert srv.get("/states/used").json()["volatile_symbols"] == ["gen"]
    srv.execute("gen = iter('ab')", state="used", new="remade")
    srv.stop()
    again = make_server(data)
    # Replaying the maker gives the generator as made (its advance is not stored).
    assert again.value("used", "next(gen), first") == "(0, 0)"
    assert again.value("remade", "next(gen)") == "'a'"


def test_objects_that_pickle_but_would_not_load_the_default_way_survive_a_restart(
        make_server, tmp_path):
    """Loaded the default way, an object whose __getattr__ reads its own attributes
    recursed (pickle asks it for __setstate__ before its __dict__ is there: altair.datasets'
    `data`), and one whose __new__ needs arguments failed (mpmath's mpq, in sympy)."""
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("class Lazy:\n"
                "    def __init__(self):\n"
                "        self.cache = {}\n"
                "    def __getattr__(self, name):\n"
                "        return self.cache.setdefault(name, len(name))\n"
                "class Ratio:\n"
                "    __slots__ = ('p', 'q')\n"
                "    def __new__(cls, p, q=1):\n"
                "        self = object.__new__(cls)\n"
                "        self.p, self.q = p, q\n"
                "        return self\n"
                "lazy = Lazy()\nlazy.four\nthird = Ratio(1, 3)", new="made")
    srv.stop()
    srv = make_server(data)
    answer = srv.execute("lazy.seven, sorted(lazy.cache), (third.p, third.q)", state="made")
    assert answer["output"][0]["data"]["text/plain"] == "(5, ['four', 'seven'], (1, 3))"


def test_failed_replay_names_variable_and_cell(make_server, tmp_path):
    data = tmp_path / "store"
    source = tmp_path / "words.txt"
    source.write_text("alpha beta")
    srv = make_server(data)
    srv.execute(f"import pathlib\ntext = pathlib.Path({str(source)!r}).read_text()\n"
                "words = (w for w in text.split())\nok = 1", new="r0")
    srv.stop()
    source.unlink()
    again = make_server(data)
    # A cell that does not need the volatile value runs.
    assert again.execute("ok + 1", state="r0")["error"] is None
    answer = again.execute("next(words)", state="r0", ok=False)
    assert answer["error"]["ename"] == "ReplayFailed"
    assert "words" in answer["error"]["evalue"]
    assert "read_text" in answer["error"]["evalue"]
    assert "FileNotFoundError" in answer["error"]["evalue"]


def test_store_full_is_507_and_keeps_older_states(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data, config="[store]\nmax_store_gb = 0.05\n")
    srv.execute("x = 1", new="f1")
    r = srv.post("/execute", {"code": "import numpy as np\nbig = np.random.random(10_000_000)",
                              "exec_id": "full", "state_name": "f1", "new_state_name": "f2"})
    assert r.status_code == 507, r.text
    assert r.json()["error"]["type"] == "StoreFull"
    assert "f2" not in srv.get("/states").json()["states"]
    assert srv.value("f1", "x") == "1"
    assert srv.execute("y = 2", state="f1", new="f3")["error"] is None


def test_refuses_foreign_store_and_second_server(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data)
    second = subprocess.run([sys.executable, "main.py", "--bind", "127.0.0.1:1",
                             "--token", "t", "--data-dir", str(data)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert second.returncode != 0
    assert f"a server at {srv.url} (pid {srv.proc.pid}) is using the store" in second.stderr
    assert "Traceback" not in second.stderr
    srv.stop()
    env = lmdb.open(str(data), max_dbs=4)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"format", b"999", db=meta)
    env.close()
    third = subprocess.run([sys.executable, "main.py", "--bind", "127.0.0.1:1",
                            "--token", "t", "--data-dir", str(data)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert third.returncode != 0
    assert str(data) in third.stderr and "format 999" in third.stderr
    assert "Traceback" not in third.stderr
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "data.mdb").write_bytes(b"not an lmdb file" * 1000)
    fourth = subprocess.run([sys.executable, "main.py", "--bind", "127.0.0.1:1",
                             "--token", "t", "--data-dir", str(junk)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert fourth.returncode != 0 and str(junk) in fourth.stderr
    assert "Traceback" not in fourth.stderr


def test_state_from_another_python_is_refused_clearly(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("x = [1]", new="old")
    srv.stop()
    # The store writes the manifest, in its own format: only the interpreter differs.
    store = Store(str(data), config.load())
    try:
        manifest = store.manifest("old")
        manifest["python"] = "cpython-3.9"
        manifest["id"] = "other-id"
        store.put_state("old", manifest, {})
    finally:
        store.close()
    again = make_server(data)
    answer = again.execute("x", state="old", ok=False)
    assert answer["error"]["ename"] == "IncompatibleState"
    assert "cpython-3.9" in answer["error"]["evalue"]


def test_in_place_writes_are_never_missed(make_server, tmp_path):
    """Unchanged buffers keep their keys without rehashing; a single written byte is seen."""
    data = tmp_path / "store"
    srv = make_server(data)

    def hashes(state):
        """Symbol hashes of arr and other in `state`."""
        return srv.post("/symbol_hashes", {"state_name": state,
                                           "symbols": ["arr", "other"]}).json()["hashes"]

    srv.execute("import numpy as np\narr = np.zeros(2_000_000)\nother = np.ones(2_000_000)",
                new="w0")
    start = hashes("w0")
    srv.execute("float(arr.sum())", state="w0", new="w1")
    assert hashes("w1") == start
    srv.execute("arr[-1] = 7.0", state="w1", new="w2")
    assert hashes("w2")["arr"] != start["arr"]
    assert hashes("w2")["other"] == start["other"]
    # A byte in the middle of a 16 MB buffer: its 1 MB chunk is stored again, not the rest.
    grown = store_bytes(data)
    srv.execute("arr[1_000_000] = 3.0", state="w2", new="w2b")
    assert hashes("w2b")["arr"] != hashes("w2")["arr"]
    assert store_bytes(data) - grown < 3 * 2 ** 20
    srv.stop()
    again = make_server(data)
    # Restored buffers come from the store; the same holds for them.
    again.execute("float(other.sum())", state="w2", new="w3")
    assert again.post("/symbol_hashes", {"state_name": "w3", "symbols": ["other"]}).json() \
        == {"hashes": {"other": start["other"]}}
    again.execute("other[0] = -1.0", state="w3", new="w4")
    changed = again.post("/symbol_hashes", {"state_name": "w4", "symbols": ["other"]}).json()
    assert changed["hashes"]["other"] != start["other"]
    again.stop()
    third = make_server(data)
    assert third.value("w4", "float(arr[-1]), float(other[0]), float(other[1])") \
        == "(7.0, -1.0, 1.0)"
    assert third.value("w2b", "float(arr[1_000_000]), float(arr[-1]), float(arr.sum())") \
        == "(3.0, 7.0, 10.0)"


def test_a_chunk_stored_in_this_process_is_vouched_for_by_its_digest():
    """With no fork since a buffer was stored, its pages are this process's own: the
    digest of each chunk's bytes tells an unchanged chunk from one written since."""
    import hashlib

    import numpy as np

    from snapkernel.storage import pages
    array = np.zeros(2 ** 18)  # 2 MiB: two 1 MiB chunks
    view = memoryview(array).cast("B")
    pieces = [view[:2 ** 20], view[2 ** 20:]]
    keys = [hashlib.sha256(p).hexdigest() for p in pieces]
    pages.remember(view, keys, 2 ** 20, [pages.digest(p) for p in pieces])
    assert [entry[0] for entry in pages.known(view, 2 ** 20)] == keys
    array[-1] = 1.0
    assert [entry and entry[0] for entry in pages.known(view, 2 ** 20)] == [keys[0], None]
    pages.remember(view, keys, 2 ** 20)  # no digests: pages only
    assert pages.known(view, 2 ** 20) == [None, None]


def test_a_restored_buffer_is_vouched_for_by_its_digests(tmp_path):
    """A restore remembers each chunk's XXH3-128 with its key: a cell's child that
    restored a large value itself (its pages are its own) saves it again, unchanged,
    by those digests, and a chunk written since is hashed again."""
    import numpy as np

    from snapkernel.storage import pages, snapshot
    settings = config.load()
    store = Store(str(tmp_path / "s"), settings)
    value = np.random.default_rng(3).random(3 * 2 ** 17 + 1024)  # 3 MiB and 8 KiB: 4 chunks
    manifest = snapshot.new_manifest("s")
    snapshot.commit(store, manifest, snapshot.save_groups(store, manifest, {"v": value},
                                                          ["v"], settings))
    pages.keep_only(set())  # as in a new process: nothing of the save is known
    namespace = {}
    snapshot.load_group(store, manifest["groups"][0], namespace, "s")
    restored = namespace["v"]
    assert np.array_equal(restored, value) and restored.base is not None
    keys = store.chunk_list(manifest["groups"][0]["buffers"][0])
    view = memoryview(restored).cast("B")
    assert [entry and entry[0] for entry in pages.known(view, 2 ** 20)] == keys
    restored[2 ** 17] = -1.0  # the first value of the second chunk
    assert [entry and entry[0] for entry in pages.known(view, 2 ** 20)] == \
        [keys[0], None, keys[2], keys[3]]
    store.close()


# A frame of several chunks (floats, Arrow strings) and a view into a numpy array, made
# under the names suffixed with {n}.
SEVERAL_CHUNKS = (
    "r{n} = np.random.default_rng(7)\n"
    "df{n} = pd.DataFrame(r{n}.random((200_000, 3)), columns=list('abc'))\n"
    "df{n}['s'] = pd.array(pa.array([f'v{{i}}' for i in range(200_000)], pa.large_string()), "
    "dtype='str')\n"
    "arr{n} = r{n}.integers(0, 2**62, 400_000)\npart{n} = arr{n}[150_000:250_000]\n")


def test_a_frame_read_after_a_restart_is_restored_whole_and_saved_again_for_nothing(
        make_server, tmp_path):
    """After a restart, a cell reading every column of a frame of several chunks sees the
    values as they were, a view still a view of its array; the state it makes holds the
    same blobs (nothing of the frame is written again)."""
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import numpy as np\nimport pandas as pd\nimport pyarrow as pa\n"
                + SEVERAL_CHUNKS.format(n=""), new="made")
    srv.stop()
    again = make_server(data)
    before = store_bytes(data)
    answer = again.execute(
        SEVERAL_CHUNKS.format(n="2") + "(df.equals(df2), bool((arr == arr2).all()), "
        "part.base is arr, str(df['s'].dtype))", state="made", new="read")
    assert answer["output"][-1]["data"]["text/plain"] == "(True, True, True, 'str')"
    again.execute("part[0] = -5\nassert arr[150_000] == -5", state="read", new="written")
    assert again.value("read", "int(arr[150_000]) != -5, df['s'].iloc[-1]") \
        == "(True, 'v199999')"
    added = store_bytes(data) - before
    assert added < 4 * 2 ** 20, added  # the new states' records, not the frame again


def test_holders_wait_while_a_child_loads_and_not_once_it_is_killed():
    """A cell's child that loads values holds the zygote's `child-loads` ChildLock
    (holders do not load meanwhile); a child killed while loading lets them go on."""
    from snapkernel.kernel.worker.holder import ChildLock
    loads = ChildLock("child-loads")
    assert not loads.now()
    ready, tell = os.pipe()
    pid = os.fork()
    if pid == 0:
        with loads.held():
            os.write(tell, b"l")
            signal.pause()  # loading, until killed
        os._exit(0)
    try:
        assert os.read(ready, 1) == b"l"
        assert loads.now()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert not loads.now()
    os.close(loads.fd)


# Cell code defining _holds(): whether this process holds the zygote's `child-loads` lock
# (a shared POSIX lock on its memfd, as /proc/locks lists it).
HOLDS_CHILD_LOADS = (
    "def _holds():\n"
    "    import os  # no global: a rebuild's unpickling calls it where none is\n"
    "    for fd in os.listdir('/proc/self/fd'):\n"
    "        try:\n"
    "            if os.readlink(f'/proc/self/fd/{fd}').startswith('/memfd:child-loads'):\n"
    "                inode = os.fstat(int(fd)).st_ino\n"
    "        except OSError:\n"
    "            pass  # the listing's own\n"
    "    with open('/proc/locks') as f:\n"
    "        return any(line.split()[3:5] == ['READ', str(os.getpid())] and\n"
    "                   line.split()[5].endswith(f':{inode}') for line in f)\n")


def test_a_cells_child_holds_the_child_loads_lock_while_it_saves(make_server, tmp_path):
    """Holders restoring in the background wait while a cell's child saves, as while it
    loads (its answer waits for the save): the child holds the zygote's `child-loads`
    ChildLock in its save, and not while the cell runs. A value's pickle records which
    was so."""
    probe = HOLDS_CHILD_LOADS + ("class Probe:\n"
                                 "    def __reduce__(self):\n"
                                 "        return (bool, (_holds(),))\n")
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute(probe + "during_run = _holds()\nduring_save = Probe()", new="S")
    srv.stop()
    assert make_server(data).value("S", "during_run, during_save") == "(False, True)"


def test_a_rebuild_and_a_multistate_cell_hold_the_child_loads_lock_while_they_load(server):
    """The loads of /rebuild_state and of /multistate_execute's aliases hold the lock too,
    however deeply nested: a value whose unpickling records it says so."""
    # At load, _holds() runs in the process that unpickles the value.
    probe = HOLDS_CHILD_LOADS + ("class Probe:\n"
                                 "    def __reduce__(self):\n"
                                 "        return (_holds, ())\n")
    server.execute(probe + "q = [Probe()]\nr = q", new="lk-src")
    r = server.post("/rebuild_state", {"input_state": "initial", "source_state": "lk-src",
                                       "source_vars": ["r"],
                                       "input_vars": [], "new_state_name": "lk-rb"})
    assert r.status_code == 200, r.text
    assert server.value("lk-rb", "r") == "[True]"  # the split group {q, r} was loaded
    r = server.post("/multistate_execute", {
        "code": "(src.q, _holds())", "exec_id": "lk-ms", "default_state": "lk-src",
        "state_mapping": {"src": "lk-src"}})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["error"] is None, answer["error"]
    assert answer["output"][-1]["data"]["text/plain"] == "([True], False)"


def test_a_holder_loads_nothing_in_the_background_while_its_child_serves_a_request(
        make_server, tmp_path):
    """The holder of a restored state loads its values between messages, but not while
    one of its children runs a cell (the answer a client waits for), whatever that
    cell reads: it would compete with the cell for the same cores.

    Two values whose unpickling waits for a file the cell makes, then notes itself in
    the server's trace (a load may not write a file of its own: storage/guard.py): a
    holder loading them as the cell runs has loaded both within the cell's wait.
    """
    gates = tmp_path / "gates"
    gates.mkdir()
    gate = ("def _gate(i, folder):\n"
            "    import os, time  # no global: a holder's unpickling calls it\n"
            "    deadline = time.monotonic() + 60\n"
            "    while not os.path.exists(f'{folder}/go') and time.monotonic() < deadline:\n"
            "        time.sleep(0.01)\n"
            "    from snapkernel.kernel import trace\n"
            "    trace.stamp(f'loaded-{i}')\n"
            "    return i\n"
            "class Gate:\n"
            "    def __init__(self, i):\n"
            "        self.i = i\n"
            "    def __reduce__(self):\n"
            f"        return (_gate, (self.i, {str(gates)!r}))\n")
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute(gate + "g1, g2, x = Gate(1), Gate(2), 3", new="S")
    srv.stop()
    path = tmp_path / "trace.jsonl"
    again = make_server(data, config=f"[server]\ntrace_file = {json.dumps(str(path))}\n")
    # Waits up to 3 s for both to be loaded: a holder not held back loads them in ms.
    answer = again.execute(
        "import time as _time\nfrom snapkernel.kernel import trace as _trace\n"
        f"open({str(gates / 'go')!r}, 'w').close()\n"
        "_deadline = _time.monotonic() + 3\n"
        f"_loaded = lambda: sorted(s['phase'] for s in _trace.read({str(path)!r})\n"
        "                          if s['phase'].startswith('loaded-'))\n"
        "while _time.monotonic() < _deadline and len(_loaded()) < 2:\n"
        "    _time.sleep(0.01)\n"
        "(x, _loaded())", state="S", new="T")
    loaded = answer["output"][-1]["data"]["text/plain"]
    assert loaded in ("(3, [])", "(3, ['loaded-1'])", "(3, ['loaded-2'])"), loaded
    # Once the cell is over, the holder loads them (a cell reading them finds them).
    assert again.value("S", "g1, g2") == "(1, 2)"


def test_a_chunk_made_again_with_the_same_bytes_takes_the_key_its_digest_is_known_by():
    """A value made again (`train = df[mask]` in a re-run cell) is a new array with old
    bytes: each chunk whose XXH3-128 matches a chunk this process stored takes that
    chunk's key without SHA-256; a chunk with other bytes is hashed."""
    import hashlib

    import numpy as np

    from snapkernel.storage import pages, serializer, snapshot
    # 2 MiB (two 1 MiB chunks) of bytes no other test stores: the digests stay known.
    array = np.random.default_rng(20261204).random(2 ** 18)
    view = memoryview(array).cast("B")
    pieces = [view[:2 ** 20], view[2 ** 20:]]
    # Keys no hash gives: a chunk that takes one was not hashed again.
    stand_ins = ["a" * 64, "b" * 64]
    pages.remember(view, stand_ins, 2 ** 20, [pages.digest(p) for p in pieces])
    again = array.copy()
    again[-1] = -1.0  # the second chunk's bytes differ
    pickled = serializer.dumps([again], {}, "", 2 ** 16)
    found, layout = snapshot._chunks(pickled, 2 ** 20, 2)
    assert layout == [2]
    assert [key for _, key in found] == [
        "a" * 64, hashlib.sha256(memoryview(again).cast("B")[2 ** 20:]).hexdigest()]


def test_a_chunk_named_by_its_digest_is_written_again_if_its_blob_is_gone(tmp_path):
    """The digest index names a key, not a stored blob: after garbage collection took
    the blob, a value made again with those bytes stores it again and loads back."""
    import numpy as np

    from snapkernel.kernel import config
    from snapkernel.storage import snapshot
    from snapkernel.storage.store import Store
    settings = config.load()
    store = Store(str(tmp_path / "store"), settings)
    a = np.random.default_rng(4).random(2 ** 18)  # two 1 MiB chunks
    first = snapshot.new_manifest("first")
    snapshot.commit(store, first, snapshot.save_groups(store, first, {"a": a}, ["a"], settings))
    store.delete_states(["first"])
    store.delete_blobs(store.referenced(first))  # what gc_states.py would do
    again = snapshot.new_manifest("again")
    snapshot.commit(store, again, snapshot.save_groups(store, again, {"b": a.copy()}, ["b"],
                                                       settings))
    assert again["groups"][0]["buffers"] == first["groups"][0]["buffers"]  # keys by digest
    loaded = {}
    snapshot.load_group(store, again["groups"][0], loaded, "again")
    assert np.array_equal(loaded["b"], a)


def test_a_string_column_made_again_does_not_keep_its_old_copy(tmp_path):
    """pyarrow makes a new wrapper of a buffer per pickle, so the page map holds Arrow
    buffers strongly; a column made again with the same strings (a re-run read_csv)
    has the same keys, and its old copy must still be let go, not held for them."""
    import pandas as pd
    import pyarrow as pa

    from snapkernel.kernel import config
    from snapkernel.storage import snapshot
    from snapkernel.storage.store import Store
    settings = config.load()
    store = Store(str(tmp_path / "store"), settings)
    words = [f"word{i % 1000}-{i}" for i in range(1_000_000)]
    before = pa.total_allocated_bytes()  # what other tests of this process left
    namespace = {"s": pd.Series(words, dtype="str")}
    one_copy = pa.total_allocated_bytes() - before
    parent = None
    for n in range(4):
        if n:
            namespace["s"] = pd.Series(words, dtype="str")  # the same strings again
        manifest = snapshot.new_manifest(f"s{n}", parent)
        records = snapshot.save_groups(store, manifest, namespace, ["s"], settings,
                                       parent=parent)
        snapshot.commit(store, manifest, records, parent and parent["groups"])
        parent = manifest
    assert [g["buffers"] for g in parent["groups"]] == [
        g["buffers"] for g in store.manifest("s0")["groups"]]
    assert pa.total_allocated_bytes() - before < 1.5 * one_copy  # four copies when held


def test_a_string_column_replaced_by_other_strings_is_let_go(tmp_path):
    """A save prunes the page map when a group it replaced lost a buffer (and skips
    that when none did): a column replaced by other strings frees the old one."""
    import pandas as pd
    import pyarrow as pa

    from snapkernel.kernel import config
    from snapkernel.storage import snapshot
    from snapkernel.storage.store import Store
    settings = config.load()
    store = Store(str(tmp_path / "store"), settings)
    before = pa.total_allocated_bytes()
    namespace = {"s": pd.Series([f"old{i}" for i in range(1_000_000)], dtype="str")}
    one_copy = pa.total_allocated_bytes() - before
    parent = None
    for n in range(4):
        if n:
            namespace["s"] = pd.Series([f"new{n}-{i}" for i in range(1_000_000)], dtype="str")
        manifest = snapshot.new_manifest(f"s{n}", parent)
        records = snapshot.save_groups(store, manifest, namespace, ["s"], settings,
                                       parent=parent)
        snapshot.commit(store, manifest, records, parent and parent["groups"])
        parent = manifest
    assert pa.total_allocated_bytes() - before < 1.5 * one_copy  # four columns when held


def test_datetime_columns_are_stored_by_chunk_like_numbers(make_server, tmp_path):
    """A date column's bytes go out of band: a changed date stores about its chunk, not the
    column, and a restored one is the same values, dtype, view and hash."""
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import numpy as np, pandas as pd\n"
                "rng = np.random.default_rng(0)\n"
                "df = pd.DataFrame({'when': pd.to_datetime(rng.integers(0, 2**50, 2_000_000)),"
                " 'span': pd.to_timedelta(rng.integers(0, 2**40, 2_000_000)),"
                " 'x': rng.random(2_000_000)})\n"
                "raw = df['when'].to_numpy().copy()\npart = raw[10:20]", new="d0")
    hashes = srv.post("/symbol_hashes", {"state_name": "d0", "symbols": ["df", "raw"]}).json()
    grown = store_bytes(data)
    srv.execute("df.loc[1_000_000, 'when'] = pd.Timestamp('2001-02-03')\n"
                "raw[1_000_000] = np.datetime64('2001-02-03')", state="d0", new="d1")
    assert store_bytes(data) - grown < 5 * 2 ** 20  # two 16 MB columns changed by a chunk
    srv.stop()
    again = make_server(data)
    again.execute("len(df)", state="d0", new="d2")
    assert again.post("/symbol_hashes", {"state_name": "d2",
                                         "symbols": ["df", "raw"]}).json() == hashes
    assert again.value("d1", "'|'.join(map(str, [df['when'][1_000_000], raw[1_000_000], "
                             "df.dtypes['when'], df.dtypes['span']]))") \
        == "'2001-02-03 00:00:00|2001-02-03T00:00:00.000000000|datetime64[ns]|timedelta64[ns]'"
    again.execute("part[0] = np.datetime64('1999-01-01')\nassert raw[10] == part[0]",
                  state="d1", new="d3")


def test_frames_of_arrow_strings_keep_their_hashes_across_a_restart(make_server, tmp_path):
    """Arrow buffers pickle the same whether pyarrow made them mutable or not: a frame
    read again after a restart, and not changed, keeps its symbol hash."""
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import io\nimport pandas as pd\n"
                "read = pd.read_csv(io.StringIO('k,v\\n' + '\\n'.join(f's{i},{i}' "
                "for i in range(100_000))))\n"
                "made = pd.DataFrame({'a': [1.0, 2.0], 'b': ['x', 'y']})", new="a0")
    names = ["read", "made"]
    before = srv.post("/symbol_hashes", {"state_name": "a0", "symbols": names}).json()
    srv.stop()
    again = make_server(data)
    again.execute("len(read) + len(made)", state="a0", new="a1")
    assert again.post("/symbol_hashes", {"state_name": "a1", "symbols": names}).json() \
        == before
    again.execute("len(read) + len(made)", state="a1", new="a2")
    assert again.post("/symbol_hashes", {"state_name": "a2", "symbols": names}).json() \
        == before


def test_dill_fallback_and_async_durability(make_server, tmp_path):
    """What the C pickler refuses goes through dill; "async" durability still stores."""
    data = tmp_path / "store"
    srv = make_server(data, config='[store]\ndurability = "async"\n')
    answer = srv.execute("import threading\nlock = threading.Lock()\nn = 3", new="d1")
    assert answer["volatile_symbols"] == []
    srv.stop()
    again = make_server(data)
    assert again.value("d1", "type(lock).__name__, lock.acquire(), n") == "('lock', True, 3)"


FORKED_WRITERS = r"""
import hashlib, os, sys
from snapkernel.kernel import config
from snapkernel.storage.store import Store
from snapkernel.storage.snapshot import new_manifest

path = sys.argv[1]

def write(tag, count):
    '''Store `count` states named after `tag`, each read back through this process's handle.'''
    store = Store.for_process(path, config.load())
    for i in range(count):
        data = f"{tag}-{i}".encode() * 100
        key = hashlib.sha256(data).hexdigest()
        store.put_state(f"{tag}-{i}", new_manifest(f"{tag}-{i}"), {key: store.encode(data)})
        assert bytes(store.blob(key)) == data

write("parent", 5)  # the parent's handle is open when it forks, and stays open
children = []
for c in range(4):
    pid = os.fork()
    if pid == 0:
        write(f"child{c}", 30)
        grandchild = os.fork()
        if grandchild == 0:
            write(f"grandchild{c}", 10)
            os._exit(0)
        _, status = os.waitpid(grandchild, 0)
        write(f"child{c}-after", 5)
        os._exit(os.waitstatus_to_exitcode(status))
    children.append(pid)
write("parent-during", 30)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
names = set(Store.for_process(path, config.load()).manifests())
print(codes, len(names))
"""


def test_forked_processes_write_through_handles_of_their_own(tmp_path):
    """A forked process drops the store handle it inherited and opens its own; the
    parent keeps using its handle through the fork, and nothing written is lost."""
    script = tmp_path / "writers.py"
    script.write_text(FORKED_WRITERS)
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    # 5 + 30 in the parent; per child 30 + 10 (its child) + 5.
    assert run.stdout.split() == ["[0,", "0,", "0,", "0]", str(5 + 30 + 4 * 45)]


HUGE_PAGE_ELIGIBLE = """
import os
def _thp_eligible(array):
    '''Whether the mapping holding `array`'s data may use transparent huge pages.'''
    start = array.__array_interface__['data'][0]
    eligible = None
    for line in open('/proc/self/smaps'):
        head = line.split()
        if '-' in head[0] and ':' not in head[0]:
            low, high = (int(x, 16) for x in head[0].split('-'))
            inside = low <= start < high
        elif inside and head[0] == 'THPeligible:':
            eligible = head[1] == '1'
    return eligible
"""


def test_restored_buffers_are_private_and_in_huge_pages(make_server, tmp_path):
    """A large buffer restored from the store is memory of the holder's own, in huge
    pages (cheap forks): a cell writing to it changes its own state only."""
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import numpy as np\nbig = np.arange(2_000_000, dtype=np.float64)\n"
                "part = big[10:20]", new="big")
    srv.stop()
    again = make_server(data)
    again.execute(HUGE_PAGE_ELIGIBLE, state="big", new="probe")
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = "[never]" not in f.read()
    if thp:
        assert again.value("probe", "_thp_eligible(big)") == "True"
    again.execute("big[:] = -1.0\nassert part[0] == -1.0", state="probe", new="written")
    assert again.value("probe", "float(big.sum()), float(part[0]), part.base is big") \
        == "(1999999000000.0, 10.0, True)"
    assert again.value("written", "float(big.sum())") == "-2000000.0"
