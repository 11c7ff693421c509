"""What verifying every blob costs a restore of a 1 GiB state (BENCHMARKS.md).

Run from a checkout with the package installed (`pip install -e .`):

    python scripts/verify_cost.py [--gib 1] [--runs 5] [--dir DIR]

For a 1 GiB array of floats (stored zstd-compressed, with a frame checksum)
and one of random integers (stored raw, with an XXH3-64 digest) it writes a
state into a temporary store, then times reading all of its blobs: verified
(Store.blob, as a restore reads them), and, after rewriting them as format 1
stored them (no checksums), unverified (the read path before checksums: copy
or decompress only) and verified against their keys (SHA-256); and the whole
restore (snapshot.load_group) of both. Times are CPU seconds of this process, the best of
--runs, so other jobs on the machine disturb them less than wall time.
"""

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import zstandard

from snapkernel.kernel import config as config_mod
from snapkernel.storage import snapshot
from snapkernel.storage.store import Store


def unverified(store, key):
    """A format 1 blob's payload read as before blob checksums: no check at all."""
    with store.env.begin(db=store.blobs, buffers=True) as txn:
        raw = txn.get(bytes.fromhex(key))
        flag, body = bytes(raw[:1]), raw[1:]
        if flag == b"Z":
            return bytearray(zstandard.ZstdDecompressor().decompress(
                body, max_output_size=2 ** 40))
        return bytearray(body)


def as_format_1(store, keys):
    """Rewrite blobs as format 1 stored them: zstd without checksum, raw bare."""
    plain = zstandard.ZstdCompressor(level=3)
    with store.env.begin(db=store.blobs, write=True) as txn:
        for key in keys:
            record = txn.get(bytes.fromhex(key))
            payload = store.blob(key)
            # Format 1 compressed whatever is compressed now, shuffled or not.
            old = b"Z" + plain.compress(payload) if record[:1] in b"ZS" else b"R" + payload
            txn.put(bytes.fromhex(key), old)


def best(runs, action):
    """The least CPU time of `runs` calls of `action`."""
    times = []
    for _ in range(runs):
        start = time.process_time()
        action()
        times.append(time.process_time() - start)
    return min(times)


def measure(directory, kind, size, runs, settings):
    """Print the read and restore times of a `size`-byte state of `kind`."""
    store = Store(os.path.join(directory, kind),
                  {**settings, "store.max_store_gb": 4 * size / 2 ** 30 + 1})
    rng = np.random.default_rng(0)
    value = (rng.random(size // 8) if kind == "floats"
             else rng.integers(0, 2 ** 62, size // 8))
    manifest = snapshot.new_manifest("s")
    snapshot.commit(store, manifest, snapshot.save_groups(store, manifest, {"v": value},
                                                          ["v"], settings))
    del value
    keys = sorted(store.referenced(manifest))

    def restore():
        snapshot.load_group(store, manifest["groups"][0], {}, "s")

    checked = best(runs, lambda: [store.blob(k) for k in keys])
    whole = best(runs, restore)
    as_format_1(store, keys)
    plain = best(runs, lambda: [unverified(store, k) for k in keys])
    old = best(runs, lambda: [store.blob(k) for k in keys])
    old_whole = best(runs, restore)
    store.env.close()
    gib = size / 2 ** 30
    print(f"| {kind} ({gib:g} GiB) | {plain:.3f} s | {checked:.3f} s "
          f"(+{(checked - plain) / plain:.0%}) | {whole:.3f} s | {old:.3f} s | "
          f"{old_whole:.3f} s |")


def main(argv=None):
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    p.add_argument("--runs", type=int, default=5, help="runs per figure (the best counts)")
    p.add_argument("--dir", help="folder for the temporary stores (default: system temp)")
    p.add_argument("--config", help="a TOML file overriding config.toml (chunk size, "
                                    "zstd level)")
    args = p.parse_args(argv)
    settings = config_mod.load(args.config)
    print("| state | read, unverified (before) | read, verified | restore (load_group) | "
          "format 1 read, verified by SHA-256 | format 1 restore |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for kind in ("floats", "integers"):
            measure(directory, kind, int(args.gib * 2 ** 30), args.runs, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
