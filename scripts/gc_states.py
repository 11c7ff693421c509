"""Delete states by rule, then the blobs no state references; optionally compact.

Run from a checkout with the package installed (`pip install -e .`), with no
server running on the store:

    python scripts/gc_states.py [--data-dir DIR] [RULES] [--dry-run] [--compact]
    python scripts/gc_states.py --remote [--config FILE] [RULES] [--grace AGE] [--dry-run]

How the rules combine:

* The selection rules are --older-than, --match and --unreachable. A state
  is deleted when it matches EVERY selection rule given (they narrow each
  other: `--match 'tmp-*' --older-than 7d` deletes the tmp-* states older
  than a week). Several --match patterns widen that one rule: a name
  matches if it matches any of them.
* --keep-last N protects the N newest states (by creation time) among those
  in scope, where the scope is the states --match selects, or every state
  without --match. Given with no selection rule it deletes everything in
  scope but the newest N.
* The state `initial` is never deleted and never counts towards N.
* With no rule at all, no state is deleted: only blobs no manifest
  references (left behind by DELETE /states/NAME, rebound names and
  interrupted writes) are removed.
* Notebook runs: a state that a notebook record (its cells' and final
  states) or a stored cell result needs is never deleted by these rules.
  --notebooks-older-than AGE deletes the records of notebooks last run
  more than AGE ago, then every stored result that no remaining record
  uses and that was stored more than AGE ago, with its state. Results
  whose state is gone (DELETE /states/NAME) are forgotten.

Manifests go first, then the unreferenced blobs, each in one transaction,
so an interruption leaves at worst blobs that the next run removes. LMDB
reuses freed pages but never shrinks its file; the script commits one more
small write after the deletes, so the very next state can reuse them (a
full store is writable again at once), and reports the space free for new
states. --compact writes a compacted copy and swaps it in. Exit status: 0 done, 1 the store cannot be used,
2 bad arguments or a server is running on the store.

With --remote the rules apply to the names of the S3-compatible store of
`store.remote`, while servers keep running on it: a name is deleted only if
its record is still the one read (If-Match), and a blob only if no name
references it, no name has referenced it for --grace (remote_grace_hours
by default; the first run that finds a blob unreferenced notes the time
in PREFIX/gc/unreferenced.json), AND the remote last wrote it more than
--grace ago. A server may be uploading a new state's blobs before its name
record, or reusing blobs of a state it saw bound a moment ago, or an old
blob (which it renews first): storage/cache.py. Each blob's time is read
once more just before it is deleted. States that the notebook records of
the local store (--data-dir, or server.data_dir) need are kept; each server
keeps its own records, so --notebooks-older-than does not apply to --remote.
"""

import argparse
import datetime
import fnmatch
import os
import re
import shutil
import sys

import lmdb

from snapkernel.kernel import config as config_mod
from snapkernel.storage.notebooks import NotebookStore
from snapkernel.storage.remote import NameConflict, RemoteStore
from snapkernel.storage.store import Store, StoreError, StoreHeld, claim_store

INITIAL = "initial"
DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGE = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


class Refused(Exception):
    """The script will not run (server running, no store): exit status 2."""


def parse_age(text):
    """A duration such as 30m, 12h, 7d or 2w, as a timedelta (argparse type)."""
    match = _AGE.fullmatch(text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an age: give a number and a unit, s m h d or w "
            f"(e.g. 30m, 12h, 7d)")
    try:
        return datetime.timedelta(seconds=float(match[1]) * _UNITS[match[2]])
    except OverflowError:
        raise argparse.ArgumentTypeError(f"{text!r} is too long an age") from None


def parse_count(text):
    """A whole number >= 0 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


def parse_args(argv):
    """The command line; argparse reports bad arguments with exit status 2."""
    p = argparse.ArgumentParser(
        prog="gc_states.py",
        description="Delete snapshot-kernel states by rule, then every blob no remaining "
                    "state references. A state is deleted when it matches every selection "
                    "rule given (--older-than, --match, --unreachable); --keep-last protects "
                    "the newest states. 'initial' is never deleted, nor a state a notebook "
                    "record or stored cell result needs. With no rule, only "
                    "unreferenced blobs are deleted. Refuses (exit 2) while a server runs "
                    "on the store, except with --dry-run, which reads one snapshot of it.",
        epilog="Examples: --unreachable --older-than 1d; --match 'scratch-*' --keep-last 5; "
               "--older-than 30d --dry-run; --compact (blobs only, then shrink the file).")
    p.add_argument("--data-dir",
                   help=f"folder of the store ({config_mod.data_dir_help()})")
    p.add_argument("--config", help="a TOML file overriding config.toml (for the default "
                                    "data_dir and max_store_gb)")
    p.add_argument("--older-than", type=parse_age, metavar="AGE",
                   help="select states created more than AGE ago (30m, 12h, 7d, 2w)")
    p.add_argument("--match", action="append", metavar="PATTERN",
                   help="select states whose name matches this glob (* ? [abc]; "
                        "case-sensitive); repeat to select several patterns")
    p.add_argument("--unreachable", action="store_true",
                   help="select auto-named states (made without new_state_name, so the "
                        "server named them with a uuid) from which no named state "
                        "descends, following parent_id links: intermediate results nothing "
                        "named leads back to. Named states and the auto-named ancestors "
                        "of a named state are kept")
    p.add_argument("--notebooks-older-than", type=parse_age, metavar="AGE",
                   help="delete the records of notebooks last run more than AGE ago, then "
                        "the stored cell results no remaining record uses that are older "
                        "than AGE, with their states")
    p.add_argument("--keep-last", type=parse_count, metavar="N",
                   help="never delete the N newest states in scope (those --match selects, "
                        "or all states); alone, delete all but the newest N")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would be deleted and freed; change nothing")
    p.add_argument("--compact", action="store_true",
                   help="after deleting, rewrite the LMDB file compacted and swap it in "
                        "(shrinks the file; needs free disk space for the copy)")
    p.add_argument("--remote", action="store_true",
                   help="collect the remote store of store.remote (S3) instead of the local "
                        "one; servers may keep running")
    p.add_argument("--grace", type=parse_age, metavar="AGE",
                   help="with --remote: keep unreferenced blobs the remote wrote less than "
                        "AGE ago (default: remote_grace_hours of the configuration)")
    args = p.parse_args(argv)
    if args.remote and args.compact:
        p.error("--compact shrinks a local LMDB file; it does not apply to --remote")
    if args.grace is not None and not args.remote:
        p.error("--grace applies to --remote only")
    if args.remote and args.notebooks_older_than is not None:
        p.error("--notebooks-older-than applies to a server's own store (notebook records "
                "are not on the remote); run it without --remote on that store")
    return args


def created_at(manifest):
    """The creation time of a state as an aware datetime, or None if unreadable."""
    text = manifest.get("created") or manifest.get("timestamp")
    try:
        when = datetime.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        # Manifests record UTC; an offset-less time is taken as UTC too.
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when


def _order_key(item):
    """Sort key oldest-first; states without a readable time count as oldest."""
    name, manifest = item
    when = created_at(manifest)
    return (when is not None, when or datetime.datetime.min, name)


def reachable_ids(manifests):
    """Ids of every named state and of every state a named state descends from."""
    by_id = {m.get("id"): m for m in manifests.values()}
    reached = set()
    for manifest in manifests.values():
        if manifest.get("auto_named"):
            continue
        current = manifest
        # Walk up parent_id; the `reached` test also stops on a (corrupt) cycle.
        while current is not None and current.get("id") not in reached:
            reached.add(current.get("id"))
            current = by_id.get(current.get("parent_id"))
    return reached


def select(manifests, args, now):
    """The names of the states the rules delete, oldest first."""
    candidates = {n: m for n, m in manifests.items() if n != INITIAL}
    if args.match:
        candidates = {n: m for n, m in candidates.items()
                      if any(fnmatch.fnmatchcase(n, p) for p in args.match)}
    in_scope = sorted(candidates.items(), key=_order_key)
    if args.keep_last is not None and args.keep_last > 0:
        protected = {n for n, _ in in_scope[-args.keep_last:]}
        candidates = {n: m for n, m in candidates.items() if n not in protected}
    if args.older_than is not None:
        try:
            cutoff = now - args.older_than
        except OverflowError:
            cutoff = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
        # A state whose time cannot be read is never taken as old.
        candidates = {n: m for n, m in candidates.items()
                      if (created_at(m) or now) < cutoff}
    if args.unreachable:
        reached = reachable_ids(manifests)
        candidates = {n: m for n, m in candidates.items()
                      if m.get("auto_named") and m.get("id") not in reached}
    return [n for n, _ in in_scope if n in candidates]


def stored_sizes(store, keys):
    """{key: bytes as stored} for the blobs among `keys` present in the store."""
    sizes = {}
    with store.env.begin(db=store.blobs, buffers=True) as txn:
        for key in keys:
            raw = txn.get(bytes.fromhex(key))
            if raw is not None:
                sizes[key] = len(raw)
    return sizes


def human(size):
    """A byte count for people (1.5 MiB), with the exact count."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            text = f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
            return f"{text} ({size} bytes)" if unit != "B" else text
        value /= 1024
    return f"{size} bytes"


def compact(store, data_dir):
    """Copy the environment compacted and swap the copy in (closes `store`).

    The caller holds the server lock. The copy is made and checked in a
    temporary folder inside data_dir (same file system, so the swap is an
    atomic rename); until that rename the original file is untouched.
    """
    path = store.path
    tmp = os.path.join(data_dir, ".compact-tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted run; we hold the lock
    os.mkdir(tmp)
    try:
        expected = len(store.manifests())
        store.env.copy(tmp, compact=True)
        copy = Store(tmp)
        try:
            if len(copy.manifests()) != expected:
                raise StoreError(f"the compacted copy in {tmp} lost states; the store "
                                 f"at {path} was left as it was")
        finally:
            copy.env.close()
        with open(os.path.join(tmp, DATA_FILE), "rb") as f:
            os.fsync(f.fileno())
        store.env.close()
        os.replace(os.path.join(tmp, DATA_FILE), os.path.join(path, DATA_FILE))
        # The old lock file caches the old file's transaction id; LMDB must
        # build a fresh one from the new file, so remove it.
        try:
            os.unlink(os.path.join(path, LOCK_FILE))
        except FileNotFoundError:
            pass
        dir_fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # Prove the swapped-in file opens as a store before reporting success.
    Store(path).env.close()


def free_on_disk(data_dir):
    """Bytes free on the file system holding the store."""
    st = os.statvfs(data_dir)
    return st.f_bavail * st.f_frsize


def file_size(data_dir):
    """Size of the LMDB data file in bytes."""
    return os.path.getsize(os.path.join(data_dir, DATA_FILE))


def run(args, out=print):
    """Apply the rules to the store; returns the exit status."""
    try:
        settings = config_mod.load(args.config)
    except config_mod.ConfigError as exc:
        raise Refused(str(exc)) from None
    if args.remote:
        return run_remote(args, settings, out)
    data_dir = os.path.abspath(args.data_dir or settings["server.data_dir"])
    if not os.path.isfile(os.path.join(data_dir, DATA_FILE)):
        raise Refused(f"no store at {data_dir} (no {DATA_FILE} there); pass --data-dir")
    if args.dry_run:
        # Read-only, from one read transaction: it cannot change a byte, so it needs no
        # lock, and a server writing meanwhile changes nothing of what it sees.
        store = Store(data_dir)
        # A database opened after a read transaction began is not in it (EINVAL): open
        # them all first (the main database's keys are their names).
        with store.env.begin() as txn:
            names = [bytes(key) for key in txn.cursor().iternext(values=False)]
        for name in names:
            store.env.open_db(name, create=False)
        store.env = Snapshot(store.env)
        try:
            return _collect(store, data_dir, args, out)
        finally:
            store.env.close()
    try:
        lock = claim_store(data_dir, f"scripts/gc_states.py (pid {os.getpid()})")
    except StoreHeld as exc:
        raise Refused(f"{exc}; stop it, then run again (--dry-run works while it "
                      f"serves)") from None
    try:
        store = Store(data_dir, settings)
        try:
            return _collect(store, data_dir, args, out)
        finally:
            store.env.close()
    finally:
        lock.close()


class Snapshot:
    """A read-only LMDB environment whose every transaction is one and the same read
    transaction, begun when it is made: whatever the store's methods read through it is
    one consistent snapshot of the store (LMDB's MVCC), however many transactions they
    begin and whatever a server commits meanwhile. Values are bytes."""

    def __init__(self, env):
        """Begin the snapshot of `env`."""
        self._env = env
        self._txn = env.begin()

    def begin(self, db=None, write=False, buffers=False):
        """The snapshot, as a transaction whose default database is `db`."""
        if write:
            raise StoreError("a dry run does not write")
        return _SnapshotView(self._txn, db)

    def close(self):
        """End the snapshot and close the environment."""
        self._txn.abort()
        self._env.close()

    def __getattr__(self, name):
        """Everything else is the environment's (open_db, info, ...)."""
        return getattr(self._env, name)


class _SnapshotView:
    """The snapshot's transaction, reading `db` unless told another."""

    def __init__(self, txn, db):
        self._txn, self._db = txn, db

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def get(self, key, default=None, db=None):
        """A value of the snapshot."""
        return self._txn.get(key, default, db=db or self._db)

    def cursor(self, db=None):
        """A cursor over the snapshot."""
        return self._txn.cursor(db=db or self._db)

    def stat(self, db):
        """A database's statistics in the snapshot."""
        return self._txn.stat(db)


def notebook_plan(notebooks, manifests, older_than, now):
    """What the notebook rules delete, and which states notebooks still need.

    Returns (records to delete, results to delete, states only those results
    held, states that must be kept).
    """
    records, results = notebooks.records(), notebooks.all_results()
    cutoff = None
    if older_than is not None:
        try:
            cutoff = now - older_than
        except OverflowError:
            cutoff = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)

    def old(text):
        """True for a time before the cutoff (an unreadable time is never old)."""
        when = created_at({"created": text})
        return cutoff is not None and when is not None and when < cutoff

    doomed_records = sorted(n for n, r in records.items()
                            if old(r.get("finished") or r.get("started")))
    used_keys, used_states = set(), set()
    for name, record in records.items():
        if name in doomed_records:
            continue
        used_states.add(record.get("state_name"))
        for cell in record.get("cells", []):
            used_keys.add(cell.get("key"))
            used_states.add(cell.get("state_name"))
    doomed_results = sorted(
        k for k, r in results.items()
        if r.get("state") not in manifests
        or (k not in used_keys and r.get("state") not in used_states and old(r.get("created"))))
    kept_results = {k: r for k, r in results.items() if k not in set(doomed_results)}
    needed = (used_states | {r["state"] for r in kept_results.values()}) - {None}
    freed = sorted(({results[k]["state"] for k in doomed_results} - needed)
                   & (set(manifests) - {INITIAL}))
    return doomed_records, doomed_results, freed, needed


def _collect(store, data_dir, args, out):
    """Delete (or, dry, count) states and blobs, then compact; print the result."""
    verb = "would delete" if args.dry_run else "deleted"
    manifests = store.manifests()
    now = datetime.datetime.now(datetime.timezone.utc)
    notebooks = NotebookStore(store)
    doomed_records, doomed_results, freed, needed = notebook_plan(
        notebooks, manifests, args.notebooks_older_than, now)
    rules = (args.older_than is not None or args.match or args.unreachable
             or args.keep_last is not None)
    if rules:
        doomed = select(manifests, args, now)
        spared = [n for n in doomed if n in needed]
        doomed = [n for n in doomed if n not in needed]
        if spared:
            out(f"kept {len(spared)} state(s) the rules select that notebook records or "
                f"stored results need")
    elif args.notebooks_older_than is None:
        doomed = []
        out("no selection rule given: no state is deleted, only blobs no state references")
    else:
        doomed = []
    if args.notebooks_older_than is not None or doomed_results:
        out(f"{verb} {len(doomed_records)} notebook record(s) and {len(doomed_results)} "
            f"stored result(s)")
    doomed += [n for n in freed if n not in set(doomed)]
    kept = {n: m for n, m in manifests.items() if n not in set(doomed)}
    referenced = set()
    for manifest in kept.values():
        referenced |= store.referenced(manifest)
    orphans = [k for k in store.blob_keys() if k not in referenced]
    out(f"{verb} {len(doomed)} state(s) of {len(manifests)}" + (":" if doomed else ""))
    for name in doomed:
        out(f"  {name}  (created {manifests[name].get('created', '?')})")
    if args.dry_run:
        freed = sum(stored_sizes(store, orphans).values())
    else:
        # Records and results first, then manifests: a crash in between leaves only
        # states and blobs nothing needs, which the next run removes.
        if doomed_records or doomed_results:
            notebooks.delete_records(doomed_records)
            notebooks.delete_results(doomed_results)
        store.delete_states(doomed)
        freed = store.delete_blobs(orphans)
        # Without this, a full store would stay full for the next state.
        store.release_freed()
    out(f"{verb} {len(orphans)} blob(s), freeing {human(freed)} of blob data")
    out(f"{len(kept)} state(s) and {len(referenced)} blob(s) remain")
    if not args.dry_run:
        space = store.space()
        out(f"free for new states: {human(space['free'])} inside {DATA_FILE} (usable at "
            f"once), and up to {human(space['room'])} more as the file grows to "
            f"max_store_gb ({human(free_on_disk(data_dir))} free on its file system)")
    if args.compact:
        before = file_size(data_dir)
        if args.dry_run:
            out(f"would compact {os.path.join(data_dir, DATA_FILE)} ({human(before)} now)")
        else:
            compact(store, data_dir)
            after = file_size(data_dir)
            out(f"compacted {os.path.join(data_dir, DATA_FILE)}: {human(before)} -> "
                f"{human(after)}")
    elif freed and not args.dry_run:
        out("the file keeps its size (LMDB reuses the freed pages); --compact shrinks it")
    return 0


def run_remote(args, settings, out):
    """Apply the rules to the remote's names, then delete old unreferenced blobs."""
    if not settings["store.remote"]:
        raise Refused("--remote needs store.remote in the configuration (pass --config FILE)")
    remote = RemoteStore(settings["store.remote"], settings["store.remote_endpoint"], settings)
    remote.check_format()  # what a newer server's manifests reference is not ours to judge
    grace = args.grace if args.grace is not None else datetime.timedelta(
        hours=settings["store.remote_grace_hours"])
    verb = "would delete" if args.dry_run else "deleted"
    # Blobs are listed before the names: a blob uploaded after this listing is never a
    # candidate, and a state published before it is among the names read next.
    listed = remote.blobs()
    records = {name: remote.get_name(name) for name in remote.names()}
    records = {name: got for name, got in records.items() if got is not None}
    manifests = {name: manifest for name, (manifest, _) in records.items()}
    rules = (args.older_than is not None or args.match or args.unreachable
             or args.keep_last is not None)
    now = datetime.datetime.now(datetime.timezone.utc)
    doomed = select(manifests, args, now) if rules else []
    needed = local_notebook_needs(args, settings, manifests, now)
    spared = [n for n in doomed if n in needed]
    if spared:
        doomed = [n for n in doomed if n not in needed]
        out(f"kept {len(spared)} state(s) the rules select that notebook records or "
            f"stored results of the local store need")
    if not rules:
        out("no selection rule given: no state is deleted, only blobs no state references")
    out(f"{verb} {len(doomed)} state(s) of {len(manifests)}" + (":" if doomed else ""))
    for name in doomed:
        if args.dry_run:
            out(f"  {name}  (created {manifests[name].get('created', '?')})")
            continue
        try:
            remote.delete_name(name, records[name][1])
            out(f"  {name}  (created {manifests[name].get('created', '?')})")
        except NameConflict:
            out(f"  {name}: kept, rebound by a server meanwhile")
            doomed.remove(name)
    referenced = set()
    for name, manifest in manifests.items():
        if name not in doomed:
            referenced |= remote.referenced(manifest)  # StoreCorrupt: nothing more deleted
    cutoff = (now - grace).timestamp()
    marks = remote.gc_marks()
    unreferenced = {k: marks.get(k, now.timestamp()) for k in listed if k not in referenced}
    orphans = [k for k, since in unreferenced.items()
               if since <= cutoff and listed[k][0] <= cutoff]
    freed = 0
    for key in orphans:
        unreferenced.pop(key)
        if args.dry_run:
            freed += listed[key][1]
            continue
        modified = remote.head_blob(key)
        if modified is not None and modified <= cutoff:  # not renewed by a server since
            remote.delete_blob(key)
            freed += listed[key][1]
    if not args.dry_run:
        remote.put_gc_marks(unreferenced)
    out(f"{verb} {len(orphans)} blob(s) unreferenced and unwritten for "
        f"{grace.total_seconds() / 3600:g} h, freeing {human(freed)}; kept "
        f"{len(unreferenced)} unreferenced blob(s) until then")
    out(f"{len(manifests) - len(doomed)} state(s) and {len(referenced)} blob(s) remain "
        f"on {remote.url}")
    return 0


def local_notebook_needs(args, settings, manifests, now):
    """The remote states that the notebook records and stored results of this machine's
    store (--data-dir, or server.data_dir) need; none if there is no store there.

    Each server keeps its notebook records in its own store, so a state that only
    another machine's notebooks need is not protected: run gc there with --data-dir.
    """
    data_dir = os.path.abspath(args.data_dir or settings["server.data_dir"])
    if not os.path.isfile(os.path.join(data_dir, DATA_FILE)):
        return set()
    # Read-only: a server may be running on it.
    store = Store(data_dir)
    try:
        return notebook_plan(NotebookStore(store), manifests, None, now)[3]
    finally:
        store.env.close()


def main(argv=None):
    """Command-line entry point; returns the exit status."""
    args = parse_args(argv)
    try:
        return run(args)
    except Refused as exc:
        print(f"gc_states.py: refused: {exc}", file=sys.stderr)
        return 2
    except (StoreError, lmdb.Error, OSError) as exc:
        print(f"gc_states.py: error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, KeyError, TypeError) as exc:
        # A malformed manifest: stop before deleting anything it might reference.
        print(f"gc_states.py: error: a manifest cannot be read ({type(exc).__name__}: "
              f"{exc}); nothing was deleted. Run scripts/check_store.py", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
