"""Several servers on one remote store: moto's S3 server on loopback, real servers over HTTP."""

import hashlib
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from snapkernel.kernel import config
from snapkernel.storage import lmdbfile
from snapkernel.storage.cache import CachedStore
from snapkernel.storage.store import (FORMAT_VERSION, Store, decode_manifest, decode_record,
                                      referenced_blobs)
from support.server import ROOT, Server, free_port, in_thread, run_script, wait_for

BIG_LEN = 500_000  # 4 MB of int64 below 2 ** 40: 4 chunks, each over 256 KiB zstd'ed


def big(seed=0):
    """(code making `big`, a random int64 array, and the text of its sum)."""
    code = (f"import numpy as np\nbig = np.random.default_rng({seed}).integers("
            f"0, 2 ** 40, {BIG_LEN}, dtype=np.int64)")
    values = np.random.default_rng(seed).integers(0, 2 ** 40, BIG_LEN, dtype=np.int64)
    return code, str(int(values.sum()))


BIG, BIG_SUM = big()


@pytest.fixture(scope="module")
def pair(s3, tmp_path_factory):
    """(bucket, a, b): two sync servers on one bucket, for the tests that neither
    restart them nor break the bucket (each uses state names of its own)."""
    bucket = s3.bucket()
    folder = tmp_path_factory.mktemp("pair")
    servers = [Server(folder / name, config=s3.config(bucket)) for name in ("a", "b")]
    yield bucket, *servers
    for srv in servers:
        srv.stop()


def new_chunks(s3, bucket, before):
    """Keys of the blobs over 256 KiB in `bucket` that are not in `before`."""
    return [k for k, item in s3.objects(bucket, "blobs").items()
            if item["Size"] > 2 ** 18 and k not in before]


def hashes(srv, state, names):
    """The symbol hashes of `names` in `state` on server `srv`."""
    r = srv.post("/symbol_hashes", {"state_name": state, "symbols": names})
    assert r.status_code == 200, r.text
    return r.json()["hashes"]


def blob_requests(s3, bucket, method, key):
    """How many `method` requests for blob `key` in `bucket` the S3 server has logged."""
    with open(s3.log_path, errors="replace") as f:
        return len(re.findall(rf'"{method} /{bucket}/states/blobs/{key} ', f.read()))


def test_two_servers_run_from_each_others_states(s3, pair):
    """Each server lists and runs from the other's states, with the same values and hashes."""
    bucket, a, b = pair
    before = s3.objects(bucket, "blobs")
    a.execute(BIG + "\nlabel = 'from a'", new="base")
    assert "base" in b.get("/states").json()["states"]
    chunks = new_chunks(s3, bucket, before)
    assert len(chunks) == 4
    heads = [blob_requests(s3, bucket, "HEAD", k) for k in chunks]
    b.execute("total = int(big.sum())\nlabel = label + ', then b'", state="base", new="next")
    # b published a state with a's chunks without asking the remote about them: it
    # fetched them a moment ago, and its parent, bound there a moment ago, names them.
    assert [blob_requests(s3, bucket, "HEAD", k) for k in chunks] == heads
    a.execute("check = total == int(big.sum())", state="next", new="checked")
    for srv in (a, b):
        assert srv.value("checked", "(check, label, total)") == \
            f"(True, 'from a, then b', {BIG_SUM})"
    names = ["big", "label", "total", "check"]
    assert hashes(a, "checked", names) == hashes(b, "checked", names)
    assert b.get("/states/checked").json()["parent"] == "next"


def test_a_blob_both_servers_make_is_stored_and_sent_once(s3, pair):
    """The same value made on two servers is one object on the remote, uploaded once."""
    bucket, a, b = pair
    code, _ = big(seed=1)
    start = s3.objects(bucket, "blobs")
    a.execute(code, new="on-a")
    before = s3.objects(bucket, "blobs")
    chunks = new_chunks(s3, bucket, start)
    assert len(chunks) == 4
    b.execute(code, new="on-b")  # computed again on b, not restored from a's state
    after = s3.objects(bucket, "blobs")
    assert hashes(a, "on-a", ["big"]) == hashes(b, "on-b", ["big"])
    for key in chunks:
        assert blob_requests(s3, bucket, "PUT", key) == 1
        assert after[key]["LastModified"] == before[key]["LastModified"]
    assert len(after) - len(before) <= 1  # b's own pickle payload at most (the same bytes)


def test_rebinding_race_between_two_servers(s3, pair, gate):
    """Two servers rebinding one name at once: one wins each round, the other gets 409
    and, having learnt the winner's record, rebinds the name over it when it runs again.

    "At once" is staged: both cells wait at a gate until both run, so both servers
    looked up the name's record before either publishes its state."""
    bucket, a, b = pair
    a.execute("who = 'first'", new="x")
    b.get("/states")
    conflicts = 0
    for round_ in range(6):
        both = gate(f"round-{round_}")

        def rebind(srv, tag):
            """Run a cell into the name `x` while the other server does too."""
            return srv.post("/execute", {"code": both.code + f"who = '{tag}{round_}'",
                                         "exec_id": f"{tag}{round_}", "state_name": "initial",
                                         "new_state_name": "x"})
        running = {tag: in_thread(rebind, srv, tag) for srv, tag in ((a, "a"), (b, "b"))}
        both.arrived(2)
        both.open()
        answers = {tag: done.result(timeout=120) for tag, done in running.items()}
        statuses = sorted(r.status_code for r in answers.values())
        assert statuses == [200, 409], [r.text for r in answers.values()]
        for tag, r in answers.items():
            if r.status_code == 409:
                conflicts += 1
                assert r.json()["error"]["type"] == "NameConflict"
                retry = (a if tag == "a" else b).execute(f"who = '{tag}{round_} again'",
                                                           new="x")
                assert retry["state_name"] == "x"
        record = s3.client.get_object(Bucket=bucket, Key="states/names/x")["Body"].read()
        assert decode_manifest(record)["name"] == "x"  # a whole record, never torn
        ids = {srv.get("/states/x").json()["variables"]["who"]["repr"] for srv in (a, b)}
        assert len(ids) == 1, ids  # both servers see the same binding
    assert conflicts == 6


def test_async_rebinding_keeps_the_state_made_last(s3, make_server):
    """Async: both servers answer at once; the state created last wins on both."""
    bucket = s3.bucket()
    a = make_server(config=s3.config(bucket, "async"))
    b = make_server(config=s3.config(bucket, "async"))
    a.execute("who = 'a'", new="x")
    b.execute("who = 'b'", new="x")  # made later, whether b has seen a's x yet or not
    for srv in (a, b):
        wait_for(lambda: srv.value("x", "who") == "'b'", "the later state on both servers")
    record = s3.client.get_object(Bucket=bucket, Key="states/names/x")["Body"].read()
    assert decode_manifest(record)["variables"]["who"]["repr"] == "'b'"


def test_a_server_that_lost_its_cache_recovers_every_state(s3, make_server, tmp_path):
    """Delete a server's whole store folder: every state comes back from the remote."""
    bucket = s3.bucket()
    data = tmp_path / "lost"
    a = make_server(data, config=s3.config(bucket))
    a.execute(BIG + "\nimport pandas as pd\ndf = pd.DataFrame({'v': [1, 2, 3]})", new="s1")
    a.execute("def f(n):\n    return n * 2\nsmall = f(21)", state="s1", new="s2")
    a.execute("big = big[::2].copy()", state="s2", new="s3")
    expected_half = a.value("s3", "int(big.sum())")
    names = ["big", "df", "f", "small"]
    expected = {s: hashes(a, s, names) for s in ("s1", "s2", "s3")}
    a.stop()
    shutil.rmtree(data)
    again = make_server(data, config=s3.config(bucket))
    assert set(again.get("/states").json()["states"]) == {"initial", "s1", "s2", "s3"}
    for state, want in expected.items():
        assert hashes(again, state, names) == want
    assert again.value("s3", "(int(big.sum()), df.v.sum(), f(small))") == \
        f"({expected_half}, np.int64(6), 84)"


def test_remote_down_then_up_sync(s3, make_server):
    """Sync: while the remote is down an execution fails with 503 and binds nothing,
    here or there; once it is back the same execution succeeds."""
    bucket = s3.bucket()
    config = s3.config(bucket, timeout_s=3.0)  # each request to the paused remote: 3 s
    a, b = make_server(config=config), make_server(config=config)
    a.execute("x = 1", new="before")
    s3.pause()
    try:
        r = a.post("/execute", {"code": "x = 2", "exec_id": "down", "state_name": "before",
                                "new_state_name": "during"})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "RemoteUnavailable"
        assert "during" not in a.get("/states").json()["states"]
    finally:
        s3.resume()
    assert "during" not in s3.objects(bucket, "names")
    assert "during" not in b.get("/states").json()["states"]
    a.execute("x = 2", state="before", new="during")
    assert b.value("during", "x") == "2"


def test_a_context_the_remote_cannot_send_fails_the_restore_instead_of_dropping_it(
        s3, make_server):
    """A cold server restoring a state while the remote is down: the state's context
    (here the seeded generator) cannot be read, so the execution fails with 503 rather
    than running in a process that differs from the state; once the remote is back the
    state restores whole."""
    bucket = s3.bucket()
    config = s3.config(bucket, timeout_s=3.0)
    a = make_server(config=config)
    a.execute("import random\nrandom.seed(5)", new="seeded")
    expected = a.value("seeded", "random.random()")
    b = make_server(config=config)  # a cold cache: the context's blobs are on the remote
    assert "seeded" in b.get("/states").json()["states"]
    s3.pause()
    try:
        r = b.post("/execute", {"code": "random.random()", "exec_id": "down",
                                "state_name": "seeded"})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "RemoteUnavailable", r.text
    finally:
        s3.resume()
    assert b.value("seeded", "random.random()") == expected


def test_remote_down_then_up_async_survives_a_restart(s3, make_server, tmp_path):
    """Async: executions go on while the remote is down; the queue survives a restart of
    the server and is uploaded once the remote is back."""
    bucket = s3.bucket()
    data = tmp_path / "async"
    config = s3.config(bucket, "async", timeout_s=3.0)  # each request while paused: 3 s
    a = make_server(data, config=config)
    b = make_server(config=s3.config(bucket, timeout_s=3.0))
    a.execute("x = 1", new="before")
    wait_for(lambda: "before" in b.get("/states").json()["states"], "the first upload")
    s3.pause()
    try:
        a.execute(BIG, state="before", new="while-down")
        a.execute("y = 3", state="while-down", new="later")
        assert {"while-down", "later"} <= set(a.get("/states").json()["states"])
        a.stop()
    finally:
        s3.resume()
    assert not {"while-down", "later"} & set(s3.objects(bucket, "names"))
    a = make_server(data, config=config)
    wait_for(lambda: {"while-down", "later"} <= set(b.get("/states").json()["states"]),
             "the queued states on the other server")
    assert b.value("later", "(x, y, int(big.sum()))") == f"(1, 3, {BIG_SUM})"


def payload_blob(s3, bucket, name):
    """The key of the pickle of the one group of the remote record of state `name` (not
    the blob of the answer that made it: the manifest's `execution`)."""
    record = s3.client.get_object(Bucket=bucket, Key=f"states/names/{name}")["Body"].read()
    (group,) = decode_manifest(record)["groups"]
    return group["key"]


def record_blobs(s3, bucket, name):
    """The blob keys the remote record of state `name` names itself."""
    record = s3.client.get_object(Bucket=bucket, Key=f"states/names/{name}")["Body"].read()
    return referenced_blobs(decode_manifest(record))


def test_gc_with_two_servers_running(s3, pair, make_server, tmp_path):
    """gc --remote deletes only unreferenced blobs older than the grace period; both
    servers go on running from every state left, and the remote checks sound."""
    bucket, a, b = pair
    config = tmp_path / "remote.toml"
    config.write_text(s3.config(bucket))
    a.execute(BIG, new="keep")
    b.execute("import numpy as np\ngone = np.ones(400_000)", new="doomed")
    b.execute("kept = 7", state="keep", new="keep2")
    # Only the blobs no other state on the bucket holds: a context blob of "doomed" (its
    # sys.path, say) can be another state's too, and gc rightly keeps it.
    others = set().union(*(record_blobs(s3, bucket, name)
                           for name in s3.objects(bucket, "names") if name != "doomed"))
    doomed = record_blobs(s3, bucket, "doomed") - others
    assert a.delete("/states/doomed").json() == {"deleted": "doomed"}
    before = s3.objects(bucket, "blobs")
    done = run_script("gc_states.py", None, "--remote", "--config", str(config), timeout=120)
    assert done.returncode == 0, done.output
    assert s3.objects(bucket, "blobs").keys() == before.keys()  # all younger than 24 h
    done = run_script("gc_states.py", None, "--remote", "--config", str(config),
                      "--grace", "0s", timeout=120)
    assert done.returncode == 0, done.output
    after = s3.objects(bucket, "blobs")
    assert doomed and not doomed & after.keys(), done.output
    assert record_blobs(s3, bucket, "keep2") <= after.keys()
    done = run_script("check_store.py", None, "--remote", "--config", str(config), timeout=120)
    assert done.returncode == 0, done.output
    c = make_server(config=s3.config(bucket))  # a cold cache: everything from the remote
    for srv in (a, b, c):
        assert srv.value("keep2", "(int(big.sum()), kept)") == f"({BIG_SUM}, 7)"
    assert "doomed" not in c.get("/states").json()["states"]


def test_a_blob_that_does_not_hash_to_its_key_is_refused(s3, make_server, tmp_path):
    """A damaged blob on the remote: a cold server refuses it, check_store names it."""
    bucket = s3.bucket()
    a = make_server(config=s3.config(bucket))
    a.execute("payload = 'precious ' * 1000", new="s")
    key = payload_blob(s3, bucket, "s")
    s3.client.put_object(Bucket=bucket, Key=f"states/blobs/{key}", Body=b"Rnot the payload")
    b = make_server(config=s3.config(bucket))
    r = b.post("/execute", {"code": "len(payload)", "exec_id": "damaged", "state_name": "s"})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "StoreCorrupt"
    assert "does not hash to its key" in r.json()["error"]["message"]
    config = tmp_path / "remote.toml"
    config.write_text(s3.config(bucket))
    done = run_script("check_store.py", None, "--remote", "--config", str(config), timeout=120)
    assert done.returncode == 1 and key in done.output, done.output


def remote_format(s3, bucket):
    """The bucket's format record (bytes), or None."""
    try:
        return s3.client.get_object(Bucket=bucket, Key="states/format")["Body"].read()
    except s3.client.exceptions.NoSuchKey:
        return None


def start_refused(config, data_dir):
    """Start a server that must refuse to serve; (exit status, stderr)."""
    proc = subprocess.run([sys.executable, "main.py", "--no-auth", "--bind",
                           f"127.0.0.1:{free_port()}", "--data-dir", str(data_dir),
                           "--config", str(config)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr


def test_the_bucket_records_its_format_and_a_newer_one_is_refused(s3, make_server, tmp_path):
    """A server records its store format on the bucket, raising an older record; on a
    bucket a newer server marked, a server refuses to start and the scripts refuse to
    check or collect it, each naming the format and none advising to delete anything."""
    bucket = s3.bucket()
    config = tmp_path / "remote.toml"
    config.write_text(s3.config(bucket))
    assert remote_format(s3, bucket) is None
    a = make_server(config=s3.config(bucket))
    assert remote_format(s3, bucket) == str(FORMAT_VERSION).encode()
    a.execute("x = 1", new="s")
    a.stop()
    s3.client.put_object(Bucket=bucket, Key="states/format", Body=b"2")
    b = make_server(data_dir=tmp_path / "b", config=s3.config(bucket))
    assert remote_format(s3, bucket) == str(FORMAT_VERSION).encode()
    assert b.value("s", "x") == "1"
    b.stop()
    newer = str(FORMAT_VERSION + 1)
    s3.client.put_object(Bucket=bucket, Key="states/format", Body=newer.encode())
    status, err = start_refused(config, tmp_path / "c")
    assert status != 0 and f"has format {newer}" in err and "upgrade this server" in err, err
    assert "Traceback" not in err and "delete" not in err, err
    blobs = s3.objects(bucket, "blobs")
    for script in ("check_store.py", "gc_states.py"):
        done = run_script(script, None, "--remote", "--config", str(config),
                          *(["--match", ".*", "--grace", "0s"] if "gc" in script else []),
                          timeout=120)
        out = done.output
        assert done.returncode == 1 and f"has format {newer}" in out, out
        assert "Traceback" not in out and "delete" not in out, out
    assert s3.objects(bucket, "blobs").keys() == blobs.keys()
    assert s3.objects(bucket, "names").keys() == {"s"}
    assert remote_format(s3, bucket) == newer.encode()  # never lowered


def test_a_server_started_while_the_remote_was_down_records_its_format_once_back(
        s3, make_server):
    """The format record is checked and raised by the first look that reaches the
    remote, when the server had to start from its cache."""
    bucket = s3.bucket()
    s3.client.put_object(Bucket=bucket, Key="states/format", Body=b"2")
    s3.pause()
    try:
        a = make_server(config=s3.config(bucket, timeout_s=2.0))  # starts from its cache
    finally:
        s3.resume()
    assert remote_format(s3, bucket) == b"2"

    def raised():
        a.get("/states")  # a look at the remote's names, once the quiet period is over
        return remote_format(s3, bucket) == str(FORMAT_VERSION).encode()
    wait_for(raised, "the format record raised by the first look")


def test_a_newer_servers_blob_is_not_called_damaged(s3, make_server):
    """A blob of a record type this server does not know: while the bucket's format is
    this server's, it is damage (StoreCorrupt); once a newer server has marked the
    bucket, it is NewerFormat, and the message advises an upgrade, not deleting."""
    bucket = s3.bucket()
    a = make_server(config=s3.config(bucket))
    a.execute("payload = 'precious ' * 1000", new="s")
    key = payload_blob(s3, bucket, "s")
    record = s3.client.get_object(Bucket=bucket, Key=f"states/blobs/{key}")["Body"].read()
    assert decode_record(record, key)[0] is None
    # A record type no server of this format writes, in front of the same bytes.
    s3.client.put_object(Bucket=bucket, Key=f"states/blobs/{key}", Body=b"Q" + record[1:])
    b = make_server(config=s3.config(bucket))  # a cold cache: the blob comes from the bucket
    r = b.post("/execute", {"code": "len(payload)", "exec_id": "damaged", "state_name": "s"})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "StoreCorrupt"
    assert "unknown record type" in r.json()["error"]["message"]
    newer = str(FORMAT_VERSION + 1)
    s3.client.put_object(Bucket=bucket, Key="states/format", Body=newer.encode())
    r = b.post("/execute", {"code": "len(payload)", "exec_id": "newer", "state_name": "s"})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "NewerFormat", error
    assert f"has format {newer}" in error["message"] and "upgrade this server" in error["message"]
    assert "delete" not in error["message"] and "damaged" not in error["message"], error


def test_the_cache_stays_within_cache_gb(s3, make_server, tmp_path):
    """Past cache_gb the blobs the remote has are evicted; the states still restore."""
    bucket = s3.bucket()
    data = tmp_path / "small-cache"
    config = s3.config(bucket, extra="cache_gb = 0.01\n")  # 10 MiB
    a = make_server(data, config=config)
    sums = {}
    for i in range(3):  # 3 x 8 MB that do not compress
        a.execute(f"import numpy as np\nv{i} = np.frombuffer(np.random.default_rng({i})"
                  f".bytes(8_000_000), dtype=np.uint8).copy()", new=f"s{i}")
        sums[i] = a.value(f"s{i}", f"int(v{i}.sum())")
    a.stop()
    stored = sum(item["Size"] for item in s3.objects(bucket, "blobs").values())
    store = Store(str(data))
    try:
        with store.env.begin() as txn:
            stat = txn.stat(store.blobs)
        used = (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * \
            stat["psize"]
    finally:
        store.env.close()
    assert stored > 2 * 0.01 * 2 ** 30  # so the cache had to evict
    assert used <= 0.01 * 2 ** 30
    a = make_server(data, config=config)
    for i in range(3):
        assert a.value(f"s{i}", f"int(v{i}.sum())") == sums[i]


def test_a_cache_smaller_than_one_chunk_still_restores(s3, make_server, tmp_path):
    """Each chunk fetched is evicted at once from a cache smaller than it (as another
    process's eviction may drop it before it is read): the restore uses the chunk it
    fetched and does not read it back from the cache."""
    bucket = s3.bucket()
    data = tmp_path / "tiny-cache"
    config = s3.config(bucket, extra="cache_gb = 0.0005\n")  # 512 KiB, under a 1 MiB chunk
    a = make_server(data, config=config)
    a.execute("import numpy as np\nv = np.frombuffer(np.random.default_rng(7)"
              ".bytes(4_000_000), dtype=np.uint8).copy()", new="s")
    total = a.value("s", "int(v.sum())")
    a.stop()
    a = make_server(data, config=config)
    assert a.value("s", "int(v.sum())") == total


def test_chunks_fetched_into_an_empty_cache_are_written_over_zeros(s3, make_server,
                                                                   tmp_path):
    """38 chunks of 1 MiB fetched into an empty cache, 16 a transaction: each commit
    writes over zeros laid down first (storage/prefill.py), so the file runs past
    LMDB's last page; every chunk reads back verified from the cache, which opens
    and checks clean, and a server on it restores the value."""
    bucket = s3.bucket()
    a = make_server(tmp_path / "a", config=s3.config(bucket))
    a.execute("import numpy as np\nv = np.random.default_rng(8).random(5_000_000)", new="s")
    total = a.value("s", "float(v.sum())")
    a.stop()
    chunks = [k for k, item in s3.objects(bucket, "blobs").items() if item["Size"] > 2 ** 19]
    assert len(chunks) == 38  # and a shorter last one
    data = tmp_path / "b"
    settings_file = tmp_path / "b.toml"
    settings_file.write_text(s3.config(bucket))
    settings = config.load(settings_file, {"server.data_dir": str(data)})
    cache = CachedStore(str(data), settings)
    try:
        assert set(cache.fetch(chunks)) == set(chunks)
        assert os.path.getsize(data / "data.mdb") > \
            lmdbfile.read_meta(str(data)).needed_bytes()
        for key in chunks:
            assert hashlib.sha256(Store.blob(cache, key)).hexdigest() == key
    finally:
        cache.close()
    Store(str(data)).close()  # the data file check
    b = make_server(data, config=s3.config(bucket))
    assert b.value("s", "float(v.sum())") == total


def test_without_boto3_the_server_says_how_to_install_it(s3, tmp_path):
    """store.remote set but boto3 missing: the server refuses to start, naming the extra."""
    config = tmp_path / "remote.toml"
    config.write_text(s3.config("any-bucket"))
    code = ("import runpy, sys\nsys.modules['boto3'] = None\n"
            f"sys.argv = ['main.py', '--no-auth', '--bind', '127.0.0.1:1', '--data-dir', "
            f"{str(tmp_path / 'data')!r}, '--config', {str(config)!r}]\n"
            "runpy.run_path('main.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "pip install -e '.[s3]'" in proc.stderr, proc.stderr


def test_blob_records_on_the_remote_are_the_cache_records(s3, pair):
    """Each blob object is the LMDB record of its key: the payload hashes to the key."""
    bucket, a, _ = pair
    a.execute("import numpy as np\nm = np.eye(300)\nt = ('x' * 5000,)", new="s")
    for key in s3.objects(bucket, "blobs"):
        record = s3.client.get_object(Bucket=bucket, Key=f"states/blobs/{key}")["Body"].read()
        problem, payload = decode_record(record, key)
        assert problem is None and hashlib.sha256(payload).hexdigest() == key
