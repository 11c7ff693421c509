"""The data file check (storage/lmdbfile.py) on real LMDB files.

LMDB leaves many healthy files shorter than their meta page's last page
number; the check must accept every one of them, and still refuse a file
cut where a tree needs a page, naming that page. The files are written by
LMDB itself (py-lmdb) and by this project's store (storage/store.py and
storage/snapshot.py, as a server saves states and gc_states.py collects
them). A file that may lack pages is read through LMDB only by a
subprocess (check_store.py), or in this process after the check has
refused it: a check that let a cut file through would kill that
subprocess with SIGBUS, or fail its test first, not kill pytest.
"""

import os
import random
import subprocess
import sys
import time

import lmdb
import numpy as np
import pytest

from snapkernel.kernel import config
from snapkernel.storage import lmdbfile, pages, snapshot
from snapkernel.storage.store import Store, StoreError
from support.server import run_script


def is_short(data_dir):
    """True when the file is shorter than (last page + 1) * page size (the old check's
    refusal)."""
    meta = lmdbfile.read_meta(str(data_dir))
    return os.path.getsize(os.path.join(data_dir, "data.mdb")) < meta.needed_bytes()


def short_store(data_dir):
    """A store of this project left shorter than its last page number, as a real
    clean-up leaves it: states saved by the store's own code, then all but three
    deleted and their blobs collected (what gc_states.py --keep-last 3 does).

    Returns {state: the sum of its array} of the states kept.
    """
    settings = config.load()
    store = Store(str(data_dir), settings)
    rng = random.Random(7)
    try:
        for round_ in range(5):
            names = []
            for i in range(300):
                # Blobs of every kind: inline in a leaf, on a few overflow pages, on many.
                size = rng.choice([4, 400, 1300, 9000])
                namespace = {"a": np.random.default_rng(i).random(size),
                             "label": f"state {round_} {i}" * rng.randint(1, 40)}
                manifest = snapshot.new_manifest(f"r{round_}-s{i}")
                snapshot.commit(store, manifest, snapshot.save_groups(
                    store, manifest, namespace, ["a", "label"], settings))
                names.append(manifest["name"])
            store.delete_states(names[:-3])
            kept = set()
            for manifest in store.manifests().values():
                kept |= store.referenced(manifest)
            store.delete_blobs([key for key in store.blob_keys() if key not in kept])
            store.release_freed()
            if is_short(data_dir):
                break
        assert is_short(data_dir), "the clean-up did not leave the file short: no reproducer"
        sums = {}
        for name in store.manifests():
            loaded = {}
            for group in store.manifest(name)["groups"]:
                snapshot.load_group(store, group, loaded, name)
            sums[name] = float(loaded["a"].sum())
        return sums
    finally:
        store.close()


def map_start(file):
    """The address at which this process maps `file` (its first mapping, at offset 0)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == file and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    raise AssertionError(f"{file} is not mapped")


def overflow_runs(data_dir):
    """{blob key: (first page, last page)} of every blob LMDB keeps on overflow pages,
    as LMDB itself maps them (where its value lies in the map)."""
    env = lmdb.open(str(data_dir), readonly=True, max_dbs=5)
    try:
        psize = env.stat()["psize"]
        # LMDB's own info() gives no map address without MDB_FIXEDMAP.
        base = map_start(os.path.realpath(os.path.join(data_dir, "data.mdb")))
        runs = {}
        with env.begin(db=env.open_db(b"blobs", create=False), buffers=True) as txn:
            for key, value in txn.cursor():
                at = pages.buffer_address(value) - base
                if at % psize == 16:  # the value starts right after an overflow page header
                    runs[bytes(key).hex()] = (at // psize, (at + len(value) - 1) // psize)
        return runs
    finally:
        env.close()


def lmdb_counts(data_dir):
    """{database: [branch, leaf, overflow pages]} as LMDB counts them, the free-page
    list's from its meta page."""
    env = lmdb.open(str(data_dir), readonly=True, max_dbs=8)
    try:
        counts = {}
        with env.begin() as txn:
            names = [bytes(key) for key, _ in txn.cursor()]
            for name in names:
                stat = txn.stat(env.open_db(name, txn=txn, create=False))
                counts[name.decode()] = [stat["branch_pages"], stat["leaf_pages"],
                                         stat["overflow_pages"]]
            stat = txn.stat()
            counts[lmdbfile.MAIN_TREE] = [stat["branch_pages"], stat["leaf_pages"],
                                          stat["overflow_pages"]]
        free = lmdbfile.read_meta(str(data_dir)).free_db
        counts[lmdbfile.FREE_TREE] = list(free[3:6])
        return {name: c for name, c in counts.items() if any(c)}
    finally:
        env.close()


def walked_counts(data_dir):
    """{tree: [branch, leaf, overflow pages]} the walk reached (empty trees left out)."""
    found = lmdbfile.walk(str(data_dir))
    return {tree: c for tree, c in found.pages.items() if any(c)}


def test_a_put_delete_loop_leaves_healthy_files_short_and_each_is_accepted(tmp_path):
    """A record put and deleted in one transaction: its pages are allocated and freed,
    never written, and the file often ends before the last page number."""
    env = lmdb.open(str(tmp_path), map_size=2 ** 28, max_dbs=2)
    db = env.open_db(b"records")
    short = 0
    for i in range(200):
        with env.begin(write=True, db=db) as txn:
            txn.put(b"scratch", os.urandom(20_000))
            txn.delete(b"scratch")
            txn.put(b"k%04d" % i, os.urandom(100))
        found = lmdbfile.walk(str(tmp_path))
        assert not found.beyond and not found.damaged, (i, found.beyond, found.damaged)
        assert found.highest < found.file_pages()
        if is_short(tmp_path):
            short += 1
            assert lmdbfile.current_meta(str(tmp_path)).txnid == found.meta.txnid
    env.close()
    assert short > 0, "no commit left the file short: the loop reproduces nothing"
    checked = run_script("check_store.py", tmp_path)  # no store format: LMDB opens it
    assert "damaged" not in checked.stderr and "cut short" not in checked.stderr


WRITER = """
import os, sys
import lmdb
env = lmdb.open(sys.argv[1], map_size=2 ** 30, max_dbs=2, sync=False, metasync=False)
db = env.open_db(b"records")
i = 0
while True:
    with env.begin(write=True, db=db) as txn:
        txn.put(b"scratch", os.urandom(20_000))
        txn.delete(b"scratch")
        txn.put(b"k%06d" % (i % 3000), os.urandom(300))
        if i % 7 == 0:
            for j in range(20):
                txn.delete(b"k%06d" % ((i * 13 + j) % 3000))
    i += 1
"""


def test_a_walk_beside_a_writer_finds_nothing_wrong(tmp_path):
    """The check reads the file while a server may commit (check_store.py, a worker
    opening the store): pages it walks may be reused under it meanwhile, which
    must never end in a refusal of the healthy file."""
    def txnid():
        """The last committed transaction (0 while the file is being made)."""
        try:
            meta = lmdbfile.read_meta(str(tmp_path))
        except lmdbfile.Truncated:
            return 0
        return meta.txnid if meta else 0

    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while txnid() < 100:
            assert writer.poll() is None and time.monotonic() < deadline, "no writer"
            time.sleep(0.01)
        start = txnid()
        settled = 0
        for _ in range(2000):
            found = lmdbfile.walk(str(tmp_path))
            assert not found.beyond and not found.damaged, (found.beyond + found.damaged)[0]
            settled += not found.unsettled
            lmdbfile.current_meta(str(tmp_path))
        assert writer.poll() is None
        # Most walks settle (one in hundreds meets reused pages, and retries); those
        # that met a writer committing all along report it, never a damage.
        assert settled > 0
        # Commits went on all along.
        assert txnid() > start + 1000
    finally:
        writer.kill()
        writer.wait()


def test_a_store_that_gc_left_short_opens_and_reads_back(tmp_path):
    data = tmp_path / "store"
    sums = short_store(data)
    store = Store(str(data))  # the check every server start and worker makes
    store.close()
    checked = run_script("check_store.py", data)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "OK" in checked.stdout and f"{len(sums)} state(s)" in checked.stdout
    store = Store(str(data))
    try:
        for name, total in sums.items():
            loaded = {}
            for group in store.manifest(name)["groups"]:
                snapshot.load_group(store, group, loaded, name)
            assert float(loaded["a"].sum()) == total
    finally:
        store.close()


def test_the_walk_reaches_every_page_lmdb_counts(tmp_path):
    """The parser against LMDB's own page counts, database by database, and against
    the overflow runs where LMDB maps each blob."""
    data = tmp_path / "store"
    short_store(data)
    assert walked_counts(data) == lmdb_counts(data)
    found = lmdbfile.walk(str(data))
    runs = overflow_runs(data)
    assert runs, "no blob on overflow pages"
    assert max(last for _, last in runs.values()) <= found.highest < found.file_pages()


def test_named_databases_with_sorted_duplicates_are_walked_as_lmdb_counts_them(tmp_path):
    """Not used by the store, but LMDB files may hold them: a key's duplicates in a
    tree of their own, or inside its node, or of fixed size (LEAF2 pages)."""
    env = lmdb.open(str(tmp_path), map_size=2 ** 28, max_dbs=3)
    dup = env.open_db(b"dup", dupsort=True)
    fixed = env.open_db(b"fixed", dupsort=True, dupfixed=True)
    with env.begin(write=True) as txn:
        for k in range(40):
            for v in range(k * 15):
                txn.put(b"k%03d" % k, b"v%06d" % v + os.urandom(k), db=dup)
                txn.put(b"k%03d" % k, b"%08d" % v, db=fixed)
    env.close()
    assert walked_counts(tmp_path) == lmdb_counts(tmp_path)
    found = lmdbfile.walk(str(tmp_path))
    assert not found.beyond and not found.damaged


def test_overflow_runs_are_counted_as_lmdb_lays_them_out(tmp_path):
    """Records of sizes about whole pages, where the run's first page header decides
    whether one more page is needed."""
    env = lmdb.open(str(tmp_path), map_size=2 ** 28, max_dbs=2)
    db = env.open_db(b"records")
    with env.begin(write=True, db=db) as txn:
        for pages_ in range(1, 6):
            for delta in (-17, -16, -15, -1, 0, 1):
                txn.put(b"%d%+d" % (pages_, delta), os.urandom(pages_ * 4096 + delta))
    env.close()
    assert walked_counts(tmp_path) == lmdb_counts(tmp_path)


def test_a_cut_is_refused_exactly_when_a_page_in_use_is_gone(tmp_path):
    """Cut the file a page at a time, from its end to below the highest page in use:
    only the cuts that take that page are refused, each naming a missing page."""
    data = tmp_path / "store"
    short_store(data)
    path = str(data / "data.mdb")
    found = lmdbfile.walk(str(data))
    psize, highest = found.meta.page_size, found.highest
    assert found.file_pages() >= highest + 1  # the file holds every page in use
    for kept in range(found.file_pages(), highest - 3, -1):
        os.truncate(path, kept * psize)
        if kept > highest:
            assert lmdbfile.current_meta(str(data)).txnid == found.meta.txnid, kept
            continue
        with pytest.raises(lmdbfile.Truncated) as refused:
            lmdbfile.current_meta(str(data))
        assert refused.value.findings and refused.value.size == kept * psize
        for finding in refused.value.findings:
            assert finding.last >= kept and finding.problem is None, str(finding)
        assert f"has {kept * psize} bytes" in str(refused.value)
        assert str(refused.value.findings[0]) in str(refused.value)
    # Half of it: the trees are missing pages wherever the walk can still reach.
    half = highest // 2
    os.truncate(path, half * psize)
    with pytest.raises(lmdbfile.Truncated) as refused:
        lmdbfile.current_meta(str(data))
    assert all(finding.last >= half for finding in refused.value.findings)


def test_the_unused_tail_cut_off_leaves_a_store_that_reads_back(tmp_path):
    """No false alarm: without the pages past the last one in use, LMDB (in
    check_store.py, a subprocess) reads every record and every blob verifies."""
    data = tmp_path / "store"
    sums = short_store(data)
    found = lmdbfile.walk(str(data))
    os.truncate(data / "data.mdb", (found.highest + 1) * found.meta.page_size)
    checked = run_script("check_store.py", data)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"checked {len(sums)} state(s)" in checked.stdout


def test_a_cut_through_a_record_names_its_overflow_pages(tmp_path):
    """A large record written last lies on the last pages of the file (the trees'
    pages are reused ones, lower down): a cut through it is refused, and the
    message names that run of overflow pages, where LMDB itself maps the record."""
    env = lmdb.open(str(tmp_path), map_size=2 ** 28, max_dbs=2)
    db = env.open_db(b"blobs")
    for i in range(100):
        with env.begin(write=True, db=db) as txn:
            txn.put(b"k%04d" % i, os.urandom(100))
    with env.begin(write=True, db=db) as txn:
        # Its last bytes on a page of their own: behind the 16-byte header of the
        # run's first page, it takes one page more than its size in pages.
        txn.put(b"large", os.urandom(25 * 4096 - 10))
    env.close()
    (first, last), = overflow_runs(tmp_path).values()
    assert lmdbfile.walk(str(tmp_path)).highest == last, "the record is not on the last page"
    psize = lmdbfile.read_meta(str(tmp_path)).page_size
    os.truncate(tmp_path / "data.mdb", last * psize)  # one page short
    run = f"overflow pages {first} to {last} of database 'blobs'"
    with pytest.raises(lmdbfile.Truncated) as refused:
        lmdbfile.current_meta(str(tmp_path))
    assert [str(finding).split(" (")[0] for finding in refused.value.findings] == [run]
    with pytest.raises(StoreError) as opened:
        Store(str(tmp_path))
    message = str(opened.value)
    assert f"has {last * psize} bytes" in message and run in message, message
    assert "cut short" in message and "SIGBUS" in message
    assert f"cp -a {tmp_path} {tmp_path}.bak" in message and "check_store.py" in message
    assert "empty" not in message and "aside" not in message
    checked = run_script("check_store.py", tmp_path)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert f"  {run} (referenced by page" in checked.stderr
    assert "lies beyond the end of the file" in checked.stderr
    assert f"cp -a {tmp_path} {tmp_path}.bak" in checked.stderr
    assert "Traceback" not in checked.stderr


def test_a_tree_page_overwritten_is_refused_as_damaged(tmp_path):
    """A page a tree references but that holds something else (here zeros) is not
    followed: LMDB would read wherever its bytes point."""
    data = tmp_path / "store"
    short_store(data)
    meta = lmdbfile.read_meta(str(data))
    root = meta.main_db[7]  # the main database's root: the named databases' records
    with open(data / "data.mdb", "r+b") as f:
        f.seek(root * meta.page_size)
        f.write(bytes(meta.page_size))
    with pytest.raises(lmdbfile.Damaged) as refused:
        lmdbfile.current_meta(str(data))
    assert f"root page {root} of the main database" in str(refused.value)
    assert "holds page 0 instead" in str(refused.value)
    with pytest.raises(StoreError) as opened:
        Store(str(data))
    assert "damaged" in str(opened.value) and "cp -a" in str(opened.value)
    assert "empty" not in str(opened.value)


def test_a_meta_page_naming_an_impossible_page_size_is_refused(tmp_path):
    """A damaged meta page must not steer the reads (pages of a gigabyte each)."""
    env = lmdb.open(str(tmp_path))
    with env.begin(write=True) as txn:
        txn.put(b"key", b"value")
    env.close()
    with open(tmp_path / "data.mdb", "r+b") as f:
        f.seek(16 + 24)  # the free-page list's md_pad in the first meta page: the page size
        f.write((2 ** 30).to_bytes(4, "little"))
    with pytest.raises(lmdbfile.Damaged) as refused:
        lmdbfile.current_meta(str(tmp_path))
    assert "pages of 1073741824 bytes" in str(refused.value)
    checked = run_script("check_store.py", tmp_path)
    assert checked.returncode == 1 and "damaged" in checked.stderr
    assert "Traceback" not in checked.stderr
