"""The files notebook cells read and write, as inputs of their keys.

A cell's worker reports the files the cell opened (kernel/worker/opened.py).
After the cell, the run hashes them (SHA-256 of the bytes) and stores a
*trace* under the cell's key before files (planner.CellKeys): the paths it
read and wrote, relative to the notebook's folder when inside it (a copy
of the folder keeps its keys), with what they held. The next run takes
the trace of each cell's key and hashes what those files hold now: the
cell's key covers it, so an edited data file gives the cells that read it
new keys, and they run with their dependents; a file touched without a
change keeps its hash and its key. A file that an earlier cell of the
notebook wrote counts by that cell's key and the bytes it left instead, so
its reader follows its writer. A file some cell wrote that is gone or no
longer what the last of its writers left makes every cell that writes it
run again (`stale_writers`), so that its readers find what a clean Run All
gives them.

Hashes are cached by device, inode, size, modification and change time,
in memory and in the traces (so a serverless run does not read an
unchanged 100 MB file again either), but never for a file changed less
than two seconds before it was hashed: a second change within the same
tick of the file system's clock could keep all five.
"""

import os
import stat
import threading
import time

from snapkernel.kernel.files import sha256_file

MISSING = "missing"
_RACY_NS = 2_000_000_000


def _stamp(st):
    """What identifies a version of a file without reading it."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class FileHashes:
    """Content hashes of files, cached by their stamp (shared by a server's runs)."""

    def __init__(self):
        """An empty cache."""
        self.lock = threading.Lock()
        self.cache = {}  # absolute path -> (stamp, hash)

    def remember(self, path, entry):
        """Take a trace's [stamp..., hash] of `path` into the cache."""
        if entry:
            with self.lock:
                self.cache.setdefault(path, (entry[:-1], entry[-1]))

    def entry(self, path):
        """[stamp..., hash] of the file at `path` now; a cacheable one, else [hash]."""
        try:
            st = os.stat(path)
        except OSError:
            return [MISSING]
        if not stat.S_ISREG(st.st_mode):
            return ["not a regular file"]
        stamp = _stamp(st)
        with self.lock:
            cached = self.cache.get(path)
        if cached is not None and cached[0] == stamp:
            return [*stamp, cached[1]]
        try:
            digest = sha256_file(path)
        except OSError as exc:
            return [f"unreadable: {exc.strerror}"]
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < _RACY_NS:
            return [digest]
        with self.lock:
            self.cache[path] = (stamp, digest)
        return [*stamp, digest]

    def digest(self, path):
        """What the file at `path` holds now: its hash, or why there is none."""
        return self.entry(path)[-1]


class RunFiles:
    """The files of one notebook run: what each cell read and wrote when it last ran
    (its trace, or this run's answer), and what those files hold now."""

    def __init__(self, folder, notebook, hashes, store):
        """`folder`: the notebook's (None: paths stay absolute); `notebook`: its file
        (never an input); `hashes`: FileHashes; `store`: the NotebookStore."""
        self.folder = folder
        self.notebook = notebook
        self.hashes = hashes
        self.store = store
        self.traces = {}  # key before files -> trace (or None)
        self.ran = {}     # position -> (reads [path], writes {path: hash}) of this run
        self.new_traces = {}  # to store with the run's results

    def absolute(self, path):
        """The absolute path of a trace's path."""
        return os.path.join(self.folder, path) if self.folder else path

    def portable(self, path):
        """A path as traces hold it: relative to the notebook's folder when inside it."""
        prefix = self.folder.rstrip(os.sep) + os.sep if self.folder else None
        return path[len(prefix):] if prefix and path.startswith(prefix) else path

    def trace(self, static):
        """The stored trace of a key before files, or None."""
        if static not in self.traces:
            found = self.store.traces([static]).get(static)
            self.traces[static] = found
            for path, entry in ((found or {}).get("reads", {}) | (found or {}).get(
                    "writes", {})).items():
                self.hashes.remember(self.absolute(path), entry)
        return self.traces[static]

    def content(self, path):
        """What the file at a trace's `path` holds now."""
        return self.hashes.digest(self.absolute(path))

    def reads(self, i, static):
        """The paths cell i read: this run's, else those of its trace."""
        if i in self.ran:
            return self.ran[i][0]
        return sorted((self.trace(static) or {}).get("reads", {}))

    def writes(self, i, static, key):
        """{path: hash of what cell i left there} of the files it wrote: this run's,
        else its trace's with the hashes its stored result under `key` recorded (None
        when no result is stored)."""
        if i in self.ran:
            return self.ran[i][1]
        paths = (self.trace(static) or {}).get("writes", {})
        if not paths:
            return {}
        left = (self.store.results([key]).get(key) or {}).get("writes", {})
        return {path: left.get(path) for path in paths}

    def record(self, i, static, files_read, files_written):
        """Note what cell i (key before files `static`) read and wrote as it ran
        (absolute paths, from its answer); returns its result's {"reads", "writes"}."""
        entries = {}
        for kind, paths in (("reads", files_read), ("writes", files_written)):
            entries[kind] = {self.portable(p): self.hashes.entry(p) for p in paths
                             if p != self.notebook}
        self.ran[i] = (sorted(entries["reads"]),
                       {p: e[-1] for p, e in entries["writes"].items()})
        # Only stamps worth trusting are stored: a trace is the next run's cache too.
        self.new_traces[static] = self.traces[static] = {
            kind: {p: e if len(e) > 1 else None for p, e in found.items()}
            for kind, found in entries.items()}
        return {kind: {p: e[-1] for p, e in found.items()} for kind, found in entries.items()}

    def stale_writers(self, order, keys, static, runs):
        """The positions to run again for the files they write: every cell writing a
        file whose bytes are not what the last of its writers left, or one of whose
        writers runs (`runs`), so that the file ends as a clean run leaves it."""
        writers = {}
        for i in order:
            if keys.get(i) is None:
                continue
            for path, digest in self.writes(i, static[i], keys[i]).items():
                writers.setdefault(path, []).append((i, digest))
        found = set()
        for path, cells in writers.items():
            if any(i in runs for i, _ in cells) or cells[-1][1] != self.content(path):
                found.update(i for i, _ in cells)
        return found
