"""Zeros written ahead of a large commit (storage/prefill.py), on real LMDB files.

The zeros go into the store's own data file, beside LMDB: every test here
checks that what LMDB committed before, during and after reads back
verified, including when the writer is killed after its zeros and when a
transaction grows large enough that LMDB spills pages to the file before
its commit.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import lmdb
import numpy as np

from snapkernel.kernel import config
from snapkernel.storage import lmdbfile, snapshot
from snapkernel.storage.prefill import Prefill
from snapkernel.storage.store import Store
from support.server import ROOT, run_script

MB = 2 ** 20


def file_bytes(data_dir):
    return os.path.getsize(os.path.join(data_dir, "data.mdb"))


def save(store, name, namespace):
    manifest = snapshot.new_manifest(name)
    snapshot.commit(store, manifest, snapshot.save_groups(
        store, manifest, namespace, list(namespace), config.load()))


def load(store, name):
    loaded = {}
    for group in store.manifest(name)["groups"]:
        snapshot.load_group(store, group, loaded, name)
    return loaded


def test_a_large_save_writes_zeros_ahead_and_reads_back_verified(tmp_path):
    """A 40 MB state's commit writes over zeros laid down first: the file then
    runs past LMDB's last page (by the room left for the trees), the check
    accepts it, and every blob reads back verified. A small state writes none."""
    data = tmp_path / "store"
    store = Store(str(data), config.load())
    try:
        save(store, "small", {"a": np.arange(1000.0)})
        assert file_bytes(data) <= lmdbfile.read_meta(str(data)).needed_bytes()
        big = np.random.default_rng(1).random(5 * MB)
        save(store, "big", {"big": big})
        beyond = file_bytes(data) - lmdbfile.read_meta(str(data)).needed_bytes()
        assert 0 < beyond <= 2 * MB, beyond
    finally:
        store.close()
    checked = run_script("check_store.py", data)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    store = Store(str(data))
    try:
        assert np.array_equal(load(store, "big")["big"], big)
        assert np.array_equal(load(store, "small")["a"], np.arange(1000.0))
    finally:
        store.close()


_KILLED_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from snapkernel.kernel import config
    from snapkernel.storage import snapshot
    from snapkernel.storage.store import Store
    settings = config.load()
    store = Store(sys.argv[1], settings)
    manifest = snapshot.new_manifest("doomed")
    namespace = {"v": np.random.default_rng(2).random(40 * 2 ** 20)}
    snapshot.commit(store, manifest, snapshot.save_groups(store, manifest, namespace, ["v"],
                                                          settings))
    print("committed", flush=True)
""")


def test_a_writer_killed_after_its_zeros_leaves_every_state_whole(tmp_path):
    """SIGKILL while a 320 MB state is written, once its zeros are in the file:
    the store opens and checks clean, the state before it reads back, the
    killed one is whole or absent, and the next large save works."""
    data = tmp_path / "store"
    store = Store(str(data), config.load())
    before = np.random.default_rng(3).random(3 * MB)
    save(store, "before", {"before": before})
    store.close()
    start = file_bytes(data)
    writer = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(data)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while file_bytes(data) < start + 64 * MB and writer.poll() is None:
        assert time.monotonic() < deadline, "the writer wrote nothing in 120 s"
        time.sleep(0.005)
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    assert file_bytes(data) > lmdbfile.read_meta(str(data)).needed_bytes()  # zeros left
    checked = run_script("check_store.py", data)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    store = Store(str(data), config.load())
    try:
        assert np.array_equal(load(store, "before")["before"], before)
        if "doomed" in store.manifests():
            assert np.array_equal(load(store, "doomed")["v"],
                                  np.random.default_rng(2).random(40 * MB))
        after = np.random.default_rng(4).random(5 * MB)
        save(store, "after", {"after": after})
        assert np.array_equal(load(store, "after")["after"], after)
        assert np.array_equal(load(store, "before")["before"], before)
    finally:
        store.close()


def test_the_zeros_stop_before_lmdb_spills_and_every_record_is_kept(tmp_path):
    """One transaction of 140,000 records of 2.5 KB: LMDB runs out of room for
    dirty pages and writes some to the file before the commit (the file grows
    past the zeros). By then the zeros have stopped; after the commit every
    record, and the one committed before, reads back as written."""
    env = lmdb.open(str(tmp_path), map_size=2 ** 31, max_dbs=2, sync=False)
    db = env.open_db(b"blobs")
    noise = np.random.default_rng(5).bytes(MB)

    def value(i):
        at = (i * 7919) % (MB - 2600)
        return i.to_bytes(8, "big") + noise[at:at + 2552]

    with env.begin(write=True) as txn:
        txn.put(b"first", noise, db=db)
    ahead = Prefill(str(tmp_path))
    spilled_at = stopped_at = None
    with env.begin(write=True) as txn:
        ahead.began(env)
        for i in range(140_000):
            ahead.put(txn, i.to_bytes(8, "big"), value(i), db=db)
            if stopped_at is None and ahead.stopped:
                stopped_at, zeros_end = i, ahead.done
            if spilled_at is None and file_bytes(tmp_path) > ahead.done:
                spilled_at = i
        assert stopped_at is not None, "the zeros never stopped"
        assert ahead.done == zeros_end  # nothing written after the stop
    ahead.close()
    assert spilled_at is not None, "LMDB did not spill: the test proves nothing"
    assert stopped_at < spilled_at, (stopped_at, spilled_at)
    with env.begin(db=db) as txn:
        assert txn.get(b"first") == noise
        for i in range(140_000):
            assert txn.get(i.to_bytes(8, "big")) == value(i), i
    env.close()


def test_small_records_are_counted_by_their_bytes_not_a_page_each(tmp_path):
    """5,000 records of 200 bytes share leaf pages (LMDB's commit uses about 2 MiB): the
    zeros laid down for them stay within twice that. One page each would write 20 MiB
    of zeros that the commit never writes over, flushed at the next sync."""
    env = lmdb.open(str(tmp_path), map_size=2 ** 31, max_dbs=2)
    db = env.open_db(b"blobs")
    before = env.info()["last_pgno"]
    ahead = Prefill(str(tmp_path))
    rng = np.random.default_rng(6)
    with env.begin(write=True) as txn:
        ahead.began(env)
        for _ in range(5_000):
            ahead.put(txn, rng.bytes(32), rng.bytes(200), db=db)
        assert not ahead.stopped  # the zeros were free to go as far as the estimate
    ahead.close()
    used = (env.info()["last_pgno"] - before) * env.stat()["psize"]
    assert ahead.done - ahead.start <= 2 * used, (ahead.done - ahead.start, used)
    env.close()
