"""Cell keys: what a cell's result is stored under.

A key is SHA-256 over the cell's source, the interpreter (implementation,
version, build), the digest of the installed distributions when the cell
imports a module outside the standard library, and, for every name the
cell needs, the key of the cell whose state gives it (so the keys of its
inputs). Not its position: moving a cell changes no key unless it changes
what the cell reads, and an import added to another cell changes only that
cell's key. A cell that imports a module from the notebook's folder (a
`helpers.py` beside it, or a package folder) also hashes that module's
files, so an edit of `helpers.py` runs again the cells that import it and,
through their keys, their dependents. A cell that opened files while it
last ran also hashes what they hold (`file_key`; kernel/notebook/inputs.py).

Every key hashes KEY_RULES, the version of these rules, so that a result
stored under the rules of an older release (which may be wrong: before
rules 2 a cell's key did not cover the files it read) is never handed back
after an upgrade: the first run after it runs the cells again.
"""

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import sys
import threading

# The version of the rules that make keys. Bump it whenever a change of those rules, or
# of what a stored result holds, could make a result stored before wrong now: every key
# changes, and no result stored under the old rules is looked up again. 2: the files a
# cell reads are inputs of its key; the context of states is taken as a clean run has it.
KEY_RULES = 2

INTERPRETER = " ".join([platform.python_implementation(), sys.version,
                        f"hexversion {sys.hexversion:x}", sys.platform])


def _sha(text):
    """Hex SHA-256 of a string."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def imports_third_party(analysis):
    """True when the cell imports (or may import) a module outside the standard library."""
    if analysis.unknown_imports:
        return True
    return any(m.startswith(".") or m.split(".")[0] not in sys.stdlib_module_names
               for m in analysis.imports)


class Environment:
    """The digest of the installed distributions (sorted name==version).

    Reading every distribution's metadata takes tens of milliseconds, so
    the digest is kept until a folder on sys.path changes: installing,
    upgrading or removing a distribution adds or removes a *.dist-info
    folder there, which changes the folder's modification time.
    """

    def __init__(self, path=None):
        """Watch `path` (default: sys.path) for installs."""
        self.path = list(path if path is not None else sys.path)
        self.lock = threading.Lock()
        self.stamp = self.value = None

    def _stamp(self):
        """Modification times of the folders distributions are found in."""
        stamp = []
        for entry in self.path:
            try:
                stamp.append((entry, os.stat(entry or ".").st_mtime_ns))
            except OSError:
                stamp.append((entry, None))
        return stamp

    def digest(self):
        """The current digest (recomputed only after a folder on the path changed)."""
        with self.lock:
            stamp = self._stamp()
            if stamp != self.stamp:
                found = set()
                for dist in importlib.metadata.distributions(path=self.path):
                    name, version = _name_and_version(dist)
                    if name:
                        # PEP 503's normalized name: the same from a folder and a METADATA
                        found.add(f"{re.sub(r'[-_.]+', '-', name).lower()}=={version}")
                self.value = _sha("\n".join(sorted(found)))
                self.stamp = stamp
            return self.value


def _name_and_version(dist):
    """A distribution's name and version, from its folder's name when that says both
    (`numpy-2.1.0.dist-info`, as wheels install it): parsing every METADATA file
    costs a server start about 150 ms of CPU."""
    folder = os.path.basename(str(getattr(dist, "_path", "")))
    stem, dot, kind = folder.rpartition(".")
    if dot and kind == "dist-info" and stem.count("-") == 1:
        name, version = stem.split("-")
        if name and version:
            return name, version
    return dist.metadata["Name"] or "", dist.version


def cell_parts(source, analysis, environment, folder=None):
    """What a cell's key hashes besides its inputs' keys: its source, the interpreter,
    the rules, the installed distributions and local modules it imports (`environment`:
    the Environment; `folder`: the notebook's)."""
    parts = {"source": source, "interpreter": INTERPRETER, "rules": KEY_RULES,
             "environment": environment.digest() if imports_third_party(analysis) else None}
    local = local_modules(analysis, folder)
    if local:
        parts["local_modules"] = local
    if analysis.runs:  # `%run FILE`: the file, also when missing (its cell fails)
        parts["run_files"] = {path: _file_digest(os.path.join(folder or "", path))
                              for path in sorted(analysis.runs)}
    return parts


def _file_digest(path):
    """SHA-256 of a file's bytes, or "missing"."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "missing"


def cell_key(parts, needs, input_keys):
    """The key of a cell of `parts` (cell_parts) before the files it reads.

    `needs` maps each name it needs to the key of the cell whose state gives
    it (None: no cell does), `input_keys` are the keys of its inputs.
    """
    return _sha(json.dumps({**parts, "needs": sorted(needs.items()),
                            "inputs": sorted(set(input_keys))}, sort_keys=True))


def file_key(key, files):
    """The key of a cell of key `key` (cell_key) that read `files` {path: what it
    found: a content hash, or the key of the cell of the run that wrote it}."""
    if not files:
        return key
    return _sha(json.dumps({"cell": key, "files": sorted(files.items()), "rules": KEY_RULES}))


def local_modules(analysis, folder):
    """{module: SHA-256 of its files} of the modules the cell imports that are files
    of the notebook's folder (`name.py`, or a package folder `name/`)."""
    if folder is None:
        return {}
    found = {}
    for module in sorted({m.split(".")[0] for m in analysis.imports if not m.startswith(".")}):
        path = os.path.join(folder, module)
        if os.path.isfile(path + ".py"):
            files = [path + ".py"]
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            files = sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                           for name in names if name.endswith(".py"))
        else:
            continue
        digest = hashlib.sha256()
        for file in files:
            try:
                with open(file, "rb") as f:
                    digest.update(os.path.relpath(file, folder).encode() + b"\0" + f.read())
            except OSError:
                digest.update(os.path.relpath(file, folder).encode() + b"\0unreadable")
        found[module] = digest.hexdigest()
    return found


def composition_key(sources, context):
    """The key of a state composed of names from other results ({name: key or None}),
    in the process context `context` ({provider: blob key}, content-addressed)."""
    return _sha(json.dumps({"compose": sorted(sources.items()), "interpreter": INTERPRETER,
                            "rules": KEY_RULES, "context": sorted(context.items())}))
