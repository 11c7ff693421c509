"""scripts/gc_states.py and scripts/check_store.py on real stores made by real servers.

One server session builds a template store (named and auto-named states,
shared blobs, an orphan blob, back-dated states, a large incompressible
value); each test works on its own copy of it and runs the scripts as
subprocesses, the way an operator would.
"""

import datetime
import hashlib
import os
import shutil

import lmdb
import pytest

from snapkernel.kernel import config
from snapkernel.storage.store import Store
from support.server import Server, run_script

SHARED_SUM = sum(range(50000))


def gc(data_dir, *args):
    """Run gc_states.py."""
    return run_script("gc_states.py", data_dir, *args)


def check(data_dir):
    """Run check_store.py."""
    return run_script("check_store.py", data_dir)


def contents(data_dir):
    """({name: manifest}, {blob keys}) of the store, read without a server."""
    store = Store(str(data_dir))
    try:
        return store.manifests(), set(store.blob_keys())
    finally:
        store.env.close()


def referenced(data_dir, manifests):
    """Every blob key the manifests refer to, chunk lists expanded."""
    store = Store(str(data_dir))
    try:
        return set().union(*(store.referenced(m) for m in manifests.values()))
    finally:
        store.env.close()


def backdate(data_dir, names, days):
    """Move the creation time of states `days` into the past (the store rewrites their
    manifests, in its own format)."""
    store = Store(str(data_dir), config.load())
    try:
        for name in names:
            manifest = store.manifest(name)
            when = datetime.datetime.fromisoformat(manifest["created"])
            when -= datetime.timedelta(days=days)
            manifest["created"] = manifest["timestamp"] = when.isoformat()
            store.put_state(name, manifest, {})
    finally:
        store.close()


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A stopped store, its auto-generated state names, and what each state holds.

    States (parent -> child):
      initial -> base (shared, a) -> child (c) -> auto1 (t)
      initial -> auto2 (u) -> leaf (v)          auto2 is reachable from leaf
      initial -> auto4 (w) -> auto5 (w2)        both unreachable; auto4 3 days old
      initial -> exp-1, exp-2, exp-3 (e)        made in that order
      initial -> old-1 (o)                      3 days old
      initial -> junk (3 MB of random bytes)
    plus the blob of a deleted state `gone` that nothing references.
    """
    data_dir = tmp_path_factory.mktemp("template") / "data"
    srv = Server(data_dir)
    try:
        srv.execute("shared = list(range(50000)); a = 1", new="base")
        srv.execute("c = 3", state="base", new="child")
        auto = {"auto1": srv.execute("t = 10", state="child")["state_name"]}
        auto["auto2"] = srv.execute("u = 20")["state_name"]
        srv.execute("v = 30", state=auto["auto2"], new="leaf")
        auto["auto4"] = srv.execute("w = 40")["state_name"]
        auto["auto5"] = srv.execute("w2 = 41", state=auto["auto4"])["state_name"]
        for i in (1, 2, 3):
            srv.execute(f"e = {i}", new=f"exp-{i}")
        srv.execute("o = 'old'", new="old-1")
        srv.execute("import os\njunk = os.urandom(3_000_000)", new="junk")
        srv.execute("g = list(range(1000, 2000))", new="gone")
        assert srv.delete("/states/gone").json() == {"deleted": "gone"}
    finally:
        srv.stop()
    backdate(data_dir, ["old-1", auto["auto4"]], days=3)
    return data_dir, auto


@pytest.fixture
def store_copy(template, tmp_path):
    """A private copy of the template store: (data_dir, auto-named state names)."""
    source, auto = template
    data_dir = tmp_path / "data"
    shutil.copytree(source, data_dir,
                    ignore=shutil.ignore_patterns("server.lock", "lock.mdb"))
    return data_dir, auto


def assert_gc_result(data_dir, before, deleted):
    """Exactly `deleted` states are gone, and exactly the unreferenced blobs with them."""
    manifests, blobs = contents(data_dir)
    assert set(manifests) == set(before) - set(deleted)
    assert manifests == {n: m for n, m in before.items() if n not in deleted}
    assert blobs == referenced(data_dir, manifests)


# The rules ------------------------------------------------------------------


def test_no_rule_deletes_only_unreferenced_blobs(store_copy):
    """Without a rule, every state stays and only the orphan blobs go."""
    data_dir, _ = store_copy
    before, blobs_before = contents(data_dir)
    orphans = blobs_before - referenced(data_dir, before)
    assert orphans  # the deleted state `gone` left its blob behind
    result = gc(data_dir)
    assert result.returncode == 0, result.stderr
    assert "no selection rule" in result.stdout
    assert f"deleted {len(orphans)} blob(s)" in result.stdout
    assert_gc_result(data_dir, before, deleted=[])


def test_match_deletes_matching_names_only(store_copy):
    """--match deletes exactly the states whose names match the glob."""
    data_dir, _ = store_copy
    before, _ = contents(data_dir)
    result = gc(data_dir, "--match", "exp-*")
    assert result.returncode == 0, result.stderr
    assert "deleted 3 state(s)" in result.stdout
    assert_gc_result(data_dir, before, deleted=["exp-1", "exp-2", "exp-3"])


def test_keep_last_within_match_protects_the_newest(store_copy):
    """--keep-last N counts within --match and keeps its newest N."""
    data_dir, _ = store_copy
    before, _ = contents(data_dir)
    result = gc(data_dir, "--match", "exp-*", "--keep-last", "1")
    assert result.returncode == 0, result.stderr
    assert_gc_result(data_dir, before, deleted=["exp-1", "exp-2"])


def test_keep_last_alone_keeps_newest_n_and_initial(store_copy):
    """--keep-last alone deletes every state but the newest N (and `initial`)."""
    data_dir, _ = store_copy
    before, _ = contents(data_dir)
    by_age = sorted((n for n in before if n != "initial"), key=lambda n: before[n]["created"])
    result = gc(data_dir, "--keep-last", "3")
    assert result.returncode == 0, result.stderr
    assert_gc_result(data_dir, before, deleted=by_age[:-3])
    assert set(contents(data_dir)[0]) == {"initial", *by_age[-3:]}


def test_older_than_deletes_old_states_only(store_copy):
    """--older-than deletes the states created before the cutoff."""
    data_dir, auto = store_copy
    before, _ = contents(data_dir)
    result = gc(data_dir, "--older-than", "2d")
    assert result.returncode == 0, result.stderr
    assert_gc_result(data_dir, before, deleted=["old-1", auto["auto4"]])


def test_unreachable_deletes_dead_end_auto_named_states(store_copy):
    """--unreachable keeps named states and auto-named ancestors of named states."""
    data_dir, auto = store_copy
    before, _ = contents(data_dir)
    result = gc(data_dir, "--unreachable")
    assert result.returncode == 0, result.stderr
    # auto2 is kept: the named state `leaf` descends from it.
    assert_gc_result(data_dir, before, deleted=[auto["auto1"], auto["auto4"], auto["auto5"]])


def test_rules_combine_as_and(store_copy):
    """A state goes only if it matches every selection rule given."""
    data_dir, auto = store_copy
    before, _ = contents(data_dir)
    result = gc(data_dir, "--unreachable", "--older-than", "1d")
    assert result.returncode == 0, result.stderr
    assert_gc_result(data_dir, before, deleted=[auto["auto4"]])


def test_initial_is_never_deleted(store_copy):
    """Even `--match '*'` leaves `initial`."""
    data_dir, _ = store_copy
    result = gc(data_dir, "--match", "*")
    assert result.returncode == 0, result.stderr
    manifests, blobs = contents(data_dir)
    assert set(manifests) == {"initial"}
    assert blobs == set()


def test_dry_run_changes_nothing(store_copy):
    """--dry-run reports what it would do and leaves the file byte for byte."""
    data_dir, auto = store_copy
    path = os.path.join(data_dir, "data.mdb")
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    result = gc(data_dir, "--unreachable", "--dry-run", "--compact")
    assert result.returncode == 0, result.stderr
    assert "would delete 3 state(s)" in result.stdout
    assert auto["auto1"] in result.stdout
    assert "would compact" in result.stdout
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == digest


def test_bad_arguments_are_named(store_copy):
    """Bad values exit 2 with a message naming the option, never a traceback."""
    data_dir, _ = store_copy
    for args, needle in [(["--older-than", "5x"], "--older-than"),
                         (["--older-than", "-3d"], "--older-than"),
                         (["--keep-last", "many"], "--keep-last"),
                         (["--keep-last", "-1"], "--keep-last"),
                         (["--bogus"], "--bogus")]:
        result = gc(data_dir, *args)
        assert result.returncode == 2, (args, result)
        assert needle in result.stderr and "Traceback" not in result.stderr, result.stderr
    result = gc(os.path.join(data_dir, "nowhere"), "--match", "*")
    assert result.returncode == 2
    assert "no store at" in result.stderr and "Traceback" not in result.stderr


# Against a server -----------------------------------------------------------


def test_refuses_while_a_server_runs(store_copy, make_server):
    """The lock held by a running server makes gc refuse with exit 2."""
    data_dir, _ = store_copy
    before, blobs = contents(data_dir)
    srv = make_server(data_dir)
    result = gc(data_dir, "--match", "*", "--compact")
    assert result.returncode == 2
    # The refusal names who holds the store.
    assert f"a server at {srv.url}" in result.stderr and "Traceback" not in result.stderr
    srv.stop()
    assert contents(data_dir) == (before, blobs)


def test_survivors_run_after_gc_with_shared_blobs(store_copy, make_server):
    """After gc a restarted server loads the kept states, also blobs shared with deleted ones."""
    data_dir, auto = store_copy
    before, _ = contents(data_dir)
    shared_key = next(g["key"] for g in before["base"]["groups"] if "shared" in g["members"])
    assert any(g["key"] == shared_key for g in before["child"]["groups"])
    result = gc(data_dir, "--match", "base")
    assert result.returncode == 0, result.stderr
    manifests, blobs = contents(data_dir)
    assert "base" not in manifests and shared_key in blobs
    srv = make_server(data_dir)
    assert srv.value("child", "sum(shared) + a + c") == str(SHARED_SUM + 4)
    assert srv.value("leaf", "u + v") == "50"
    assert srv.value(auto["auto1"], "t + c") == "13"
    srv.execute("d = len(shared) + c", state="child", new="after")
    assert srv.value("after", "d") == "50003"
    srv.stop()
    assert check(data_dir).returncode == 0


def test_compact_shrinks_the_file_and_the_store_works(store_copy, make_server):
    """--compact after deleting a large state shrinks data.mdb; states still run."""
    data_dir, _ = store_copy
    path = os.path.join(data_dir, "data.mdb")
    size_before = os.path.getsize(path)
    result = gc(data_dir, "--match", "junk", "--compact")
    assert result.returncode == 0, result.stderr
    assert "compacted" in result.stdout and "->" in result.stdout
    size_after = os.path.getsize(path)
    assert size_after < size_before - 2_000_000
    assert check(data_dir).returncode == 0
    srv = make_server(data_dir)
    assert srv.value("child", "sum(shared) + c") == str(SHARED_SUM + 3)
    srv.execute("z = [c] * 3", state="child", new="post-compact")
    srv.stop()
    srv = make_server(data_dir)
    assert srv.value("post-compact", "z") == "[3, 3, 3]"
    srv.stop()
    assert check(data_dir).returncode == 0


# check_store ----------------------------------------------------------------


def test_check_store_passes_on_a_healthy_store_even_while_serving(store_copy, make_server):
    """A sound store checks OK, also with a server running on it; orphans are info."""
    data_dir, _ = store_copy
    result = check(data_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout and "no state references" in result.stdout
    srv = make_server(data_dir)
    srv.execute("n = 7", state="leaf", new="while-serving")
    result = check(data_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    states = len(srv.get("/states").json()["states"])
    assert f"checked {states} state(s)" in result.stdout and "OK" in result.stdout
    srv.stop()


def _blob_of(data_dir, state, member):
    """The payload key of the group holding `member` in `state`."""
    manifests, _ = contents(data_dir)
    return next(g["key"] for g in manifests[state]["groups"] if member in g["members"])


def test_check_store_finds_a_corrupt_blob(store_copy):
    """A blob whose content no longer hashes to its key fails the check."""
    data_dir, _ = store_copy
    key = _blob_of(data_dir, "leaf", "v")
    env = lmdb.open(str(data_dir), max_dbs=4, map_size=2 ** 30)
    with env.begin(db=env.open_db(b"blobs"), write=True) as txn:
        txn.put(bytes.fromhex(key), b"R" + b"not the pickled value")
    env.close()
    result = check(data_dir)
    assert result.returncode == 1
    lines = [line for line in result.stdout.splitlines() if key in line]
    assert lines and "'leaf'" in lines[0] and "[v]" in lines[0] and "corrupt" in lines[0]


def test_check_store_finds_a_missing_blob(store_copy):
    """A blob deleted behind the store's back fails the check for every state using it."""
    data_dir, _ = store_copy
    key = _blob_of(data_dir, "base", "shared")
    env = lmdb.open(str(data_dir), max_dbs=4, map_size=2 ** 30)
    with env.begin(db=env.open_db(b"blobs"), write=True) as txn:
        assert txn.delete(bytes.fromhex(key))
    env.close()
    result = check(data_dir)
    assert result.returncode == 1
    missing = [line for line in result.stdout.splitlines() if key in line and "missing" in line]
    assert {"'base'" in line for line in missing} == {True, False}  # base and child
    assert any("'child'" in line and "shared" in line for line in missing)
