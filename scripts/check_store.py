"""Verify a snapshot-kernel store: every manifest's blobs exist and are intact.

Run from a checkout with the package installed (`pip install -e .`; a server
may keep running meanwhile: the store is opened read-only, and LMDB lets
readers work beside the writer):

    python scripts/check_store.py [--data-dir DIR]
    python scripts/check_store.py --remote [--config FILE]

It first walks, with plain reads, every B-tree of `data.mdb` that its
last transaction uses and checks that each page they reference lies in
the file and is a page of that tree (storage/lmdbfile.py): a file cut
short is reported with every page missing, not mapped (mapping it would
crash with SIGBUS). Its length alone proves nothing: LMDB leaves pages
it allocated but never wrote off the end of a healthy file. For every
state it checks that the manifest parses and that each blob its alias
groups refer to (payload and out-of-band buffers) is in the store. Every
blob in the store is then read as the server reads it (its checksum
verified, decompressed) and hashed: its SHA-256 must equal its key. A
corrupt blob is an error even when no state refers to it, because blobs
are content-addressed and written once: a later state with the same
value would reuse the damaged copy. Blobs no state refers to are
reported as information (scripts/gc_states.py removes them).

With --remote it checks the S3-compatible store of `store.remote` the same
way (every name record, every blob object downloaded and hashed) instead
of the local one; servers may keep running meanwhile.

Exit status: 0 the store is sound, 1 problems were found (each printed as
state, group members, blob key, problem) or the store cannot be opened
(a truncated file among them; nothing is changed), 2 bad arguments or no
store at that path.
"""

import argparse
import hashlib
import os
import shlex
import sys
import time

import lmdb

from snapkernel.kernel import config as config_mod
from snapkernel.storage import lmdbfile
from snapkernel.storage.remote import RemoteStore
from snapkernel.storage.store import Store, StoreCorrupt, StoreError, decode_manifest

DATA_FILE = "data.mdb"
_LISTED = 20  # unreferenced blobs listed by key; the rest are only counted


def parse_args(argv):
    """The command line."""
    p = argparse.ArgumentParser(
        prog="check_store.py",
        description="Check that every state's blobs exist and hash (SHA-256 of the "
                    "decompressed payload) to their keys. Exit 0 if sound, 1 with the list "
                    "of problems. Safe while a server runs (read-only).")
    p.add_argument("--data-dir",
                   help=f"folder of the store ({config_mod.data_dir_help()})")
    p.add_argument("--config", help="a TOML file overriding config.toml (for the default "
                                    "data_dir, and store.remote)")
    p.add_argument("--remote", action="store_true",
                   help="check the remote store of store.remote (S3) instead of the local one")
    return p.parse_args(argv)


def remote_snapshot(remote):
    """({state: stored manifest bytes}, [blob key bytes]) of a remote, as read_snapshot.

    Blobs are listed first: a state published meanwhile may then name a
    blob not listed, which is still checked (as referenced).
    """
    keys = [bytes.fromhex(k) if _is_key(k) else k.encode() for k in remote.blobs()]
    manifests = {}
    for name in remote.names():
        got = remote.name_record(name)
        if got is not None:  # deleted since the listing
            manifests[name] = got[0]
    return manifests, keys


def read_snapshot(store):
    """({state: raw manifest bytes}, [blob key bytes]) from one read transaction.

    One transaction gives a consistent view while a server keeps writing:
    no state appears without its blobs.
    """
    with store.env.begin() as txn:
        manifests = {bytes(k).decode("utf-8", "replace"): bytes(v)
                     for k, v in txn.cursor(db=store.states)}
        keys = [bytes(k) for k in txn.cursor(db=store.blobs).iternext(values=False)]
    return manifests, keys


def blob_problem(store, key):
    """None if blob `key` (hex) is present, passes its checksum and hashes to its key,
    else what is wrong."""
    problem, data = store.read_blob(key)
    if problem:
        return problem
    digest = hashlib.sha256(data).hexdigest()
    if digest != key:
        return f"corrupt: its content hashes to {digest}"
    return None


def group_refs(name, manifest, problems):
    """[(members, role, key)] of a manifest's groups; malformed entries go to `problems`."""
    refs = []
    groups = manifest.get("groups") if isinstance(manifest, dict) else None
    if not isinstance(groups, list):
        problems.append((name, "-", "-", "manifest has no list of groups"))
        return refs
    for index, group in enumerate(groups):
        members = group.get("members") if isinstance(group, dict) else None
        label = ", ".join(map(str, members)) if isinstance(members, list) else f"#{index}"
        if not isinstance(group, dict) or not isinstance(group.get("buffers", []), list):
            problems.append((name, label, "-", "malformed group entry"))
            continue
        for role, key in [("payload", group.get("key")),
                          *((f"buffer {i}", k) for i, k in enumerate(group["buffers"]))]:
            if not _is_key(key):
                problems.append((name, label, str(key), f"{role} key is not a SHA-256 hex"))
            else:
                refs.append((label, role, key))
    for provider, key in (manifest.get("context") or {}).items():
        if not _is_key(key):
            problems.append((name, "-", str(key), f"context {provider} key is not a SHA-256 "
                                                  f"hex"))
        else:
            refs.append(("-", f"context {provider}", key))
    return refs


def chunk_refs(store, name, manifest, problems):
    """[(members, role, key)] of the chunks named by a manifest's chunk lists."""
    refs = []
    for group in manifest.get("groups", []) if isinstance(manifest, dict) else []:
        layout = group.get("layout") if isinstance(group, dict) else None
        if not isinstance(layout, list):
            continue
        label = ", ".join(map(str, group.get("members", [])))
        for index, (key, count) in enumerate(zip(group.get("buffers", []), layout)):
            if count == 1 or not _is_key(key) or blob_problem(store, key):
                continue  # a bad chunk list is reported as its own blob's problem
            chunks = store.chunk_list(key)
            if len(chunks) != count:
                problems.append((name, label, key, f"chunk list names {len(chunks)} "
                                                   f"chunks, the manifest {count}"))
            refs += [(label, f"chunk {i} of buffer {index}", k) for i, k in enumerate(chunks)]
    return refs


def _is_key(key):
    """True for a 64-digit lowercase hex SHA-256."""
    return (isinstance(key, str) and len(key) == 64
            and all(c in "0123456789abcdef" for c in key))


def check(store, out=print):
    """Check the store, print the findings; returns the exit status (0 or 1)."""
    raw_manifests, raw_keys = (remote_snapshot(store) if isinstance(store, RemoteStore)
                               else read_snapshot(store))
    problems = []  # (state, group members, key, problem)
    referenced = {}  # key -> [(state, members, role)]
    for name, raw in sorted(raw_manifests.items()):
        try:
            manifest = decode_manifest(raw, name)
        except StoreCorrupt as exc:
            problems.append((name, "-", "-", str(exc)))
            continue
        for members, role, key in group_refs(name, manifest, problems):
            referenced.setdefault(key, []).append((name, members, role))
        for members, role, key in chunk_refs(store, name, manifest, problems):
            referenced.setdefault(key, []).append((name, members, role))
    verdicts = {}
    for key, users in sorted(referenced.items()):
        verdicts[key] = blob_problem(store, key)
        if verdicts[key]:
            for name, members, role in users:
                problems.append((name, members, key, f"{role} blob {verdicts[key]}"))
    unreferenced = []
    for raw_key in raw_keys:
        if len(raw_key) != 32:
            problems.append(("-", "-", raw_key.hex(), "blob key is not a SHA-256"))
            continue
        key = raw_key.hex()
        if key in referenced:
            continue
        unreferenced.append(key)
        problem = blob_problem(store, key)
        if problem:
            # Not used now, but a later state with the same value would reuse it.
            problems.append(("-", "-", key, f"unreferenced blob {problem}"))
    out(f"checked {len(raw_manifests)} state(s), {len(referenced)} referenced blob(s), "
        f"{len(raw_keys)} blob(s) in {store.path}")
    if unreferenced:
        out(f"info: {len(unreferenced)} blob(s) no state references "
            f"(scripts/gc_states.py removes them):")
        for key in unreferenced[:_LISTED]:
            out(f"  {key}")
        if len(unreferenced) > _LISTED:
            out(f"  ... and {len(unreferenced) - _LISTED} more")
    if not problems:
        out("OK: every manifest's blobs are present and hash to their keys")
        return 0
    out(f"{len(problems)} problem(s):")
    for name, members, key, problem in problems:
        out(f"  state {name!r}  group [{members}]  blob {key}: {problem}")
    return 1


def main(argv=None):
    """Command-line entry point; returns the exit status."""
    args = parse_args(argv)
    try:
        settings = config_mod.load(args.config)
    except config_mod.ConfigError as exc:
        print(f"check_store.py: error: {exc}", file=sys.stderr)
        return 2
    if args.remote:
        return check_remote(settings)
    data_dir = os.path.abspath(args.data_dir or settings["server.data_dir"])
    if not os.path.isfile(os.path.join(data_dir, DATA_FILE)):
        print(f"check_store.py: error: no store at {data_dir} (no {DATA_FILE} there); "
              f"pass --data-dir", file=sys.stderr)
        return 2
    if not check_data_file(data_dir):
        return 1
    try:
        store = Store(data_dir, checked=True)  # walked just now
    except StoreError as exc:
        print(f"check_store.py: error: {exc}", file=sys.stderr)
        return 1
    try:
        return check(store)
    except lmdb.Error as exc:
        print(f"check_store.py: error: reading {data_dir} failed: {exc}", file=sys.stderr)
        return 1
    finally:
        store.env.close()


def check_data_file(data_dir, out=print):
    """Walk the trees of the data file and print what was found. False (the findings
    on stderr) when they use pages the file lacks, or lead to pages not theirs."""
    started = time.perf_counter()
    try:
        found = lmdbfile.walk(data_dir)
    except lmdbfile.DataFileError as exc:  # not even the two meta pages
        report_damage(data_dir, str(exc), [])
        return False
    except OSError as exc:
        print(f"check_store.py: error: cannot read {data_dir}: {exc}", file=sys.stderr)
        return False
    if found is None:
        return True  # not an LMDB file of this format: opening it gives LMDB's own message
    took = (time.perf_counter() - started) * 1000
    pages = sum(sum(counts[:2]) for counts in found.pages.values())
    out(f"{DATA_FILE}: {pages} tree page(s) of {len(found.pages)} tree(s) read in "
        f"{took:.0f} ms; the pages in use end at page {found.highest}, the file holds "
        f"{found.file_pages()} page(s) of {found.meta.page_size} bytes (transaction "
        f"{found.meta.txnid})")
    if found.unsettled:
        out(f"{DATA_FILE}: a writer committed during every walk: {len(found.unsettled)} "
            f"page(s) read may have been reused under the walk, which proves nothing; "
            f"check again while the server is idle for a conclusive walk")
    problem = lmdbfile.describe(found, os.path.join(data_dir, DATA_FILE))
    if problem is None:
        return True
    report_damage(data_dir, problem, found.beyond + found.damaged)
    return False


def report_damage(data_dir, problem, findings):
    """Print (stderr) that the data file is damaged, every finding, and what to do."""
    print(f"check_store.py: error: the store at {data_dir} is damaged: {problem}. It was "
          f"not opened (LMDB would crash on it) and is left as it is.", file=sys.stderr)
    if findings:
        print(f"{len(findings)} page reference(s) that cannot be followed:", file=sys.stderr)
        for finding in findings[:_LISTED]:
            where = "" if finding.problem else " lies beyond the end of the file"
            print(f"  {finding}{where}", file=sys.stderr)
        if len(findings) > _LISTED:
            print(f"  ... and {len(findings) - _LISTED} more", file=sys.stderr)
    backup = shlex.quote(data_dir + ".bak")
    print(f"Before trying anything on it, keep a copy: cp -a {shlex.quote(data_dir)} "
          f"{backup}. Then restore {DATA_FILE} from a backup if you have one.",
          file=sys.stderr)


def check_remote(settings):
    """Check the remote store of the configuration; returns the exit status."""
    if not settings["store.remote"]:
        print("check_store.py: error: --remote needs store.remote in the configuration "
              "(pass --config FILE)", file=sys.stderr)
        return 2
    remote = RemoteStore(settings["store.remote"], settings["store.remote_endpoint"], settings)
    try:
        remote.check_format()  # a newer server's records are not this one's to judge
        return check(remote)
    except StoreError as exc:
        print(f"check_store.py: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
