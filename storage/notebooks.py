"""Cell results and notebook records, in the store's `notebooks` database.

Two kinds of entries, by key prefix:

- `result/<cell key>`: what running a cell with that key gave (the name of
  its state, its outputs and execution count, its volatile names, the
  provenance of its state's names). Shared by every notebook: a cell with
  the same key anywhere reuses it.
- `notebook/<name>`: the record of a notebook's last run (per cell its
  key and status; outputs only for cells without a stored result).
- `trace/<cell key before files>`: the files a cell with that key read and
  wrote when it last ran, with what they held then (size, times and hash),
  from which the next run finds the cell's key (kernel/notebook/inputs.py).

Values are zstd-compressed JSON, as manifests are. Each write is one
transaction: a notebook run writes its results and record together, at its
end. Nothing here runs user code.
"""

import lmdb

from snapkernel.storage.store import StoreFull, decode_manifest, encode_manifest

DB = b"notebooks"
_RESULT = b"result/"
_NOTEBOOK = b"notebook/"
_TRACE = b"trace/"


class NotebookStore:
    """The results and notebook records of one Store."""

    def __init__(self, store):
        """Open (creating if the store is writable) the `notebooks` database."""
        self.store = store
        try:
            self.db = store.env.open_db(DB, create=not store.readonly)
        except lmdb.NotFoundError:  # a read-only store that never ran a notebook
            self.db = None

    def _get(self, keys):
        """{key: decoded value} of the present keys (bytes)."""
        if self.db is None:
            return {}
        found = {}
        with self.store.env.begin(db=self.db) as txn:
            for key in keys:
                raw = txn.get(key)
                if raw is not None:
                    found[key] = decode_manifest(raw)
        return found

    def _scan(self, prefix):
        """{key without prefix (str): decoded value} of every entry under `prefix`."""
        if self.db is None:
            return {}
        found = {}
        with self.store.env.begin(db=self.db) as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for key, raw in cursor:
                    if not key.startswith(prefix):
                        break
                    found[key[len(prefix):].decode("utf-8", "surrogateescape")] = \
                        decode_manifest(raw)
        return found

    def _write(self, puts=(), deletes=()):
        """Put and delete entries in one transaction; StoreFull when the map is full."""
        try:
            with self.store.env.begin(db=self.db, write=True) as txn:
                for key, value in puts:
                    txn.put(key, encode_manifest(value))
                for key in deletes:
                    txn.delete(key)
        except lmdb.MapFullError:
            raise StoreFull(f"the store at {self.store.path} is full (max_store_gb); run "
                            f"scripts/gc_states.py, or raise the limit") from None

    # Results -----------------------------------------------------------------

    def results(self, keys):
        """{cell key: result} of the stored ones among `keys`."""
        found = self._get(_RESULT + k.encode() for k in keys)
        return {k[len(_RESULT):].decode(): v for k, v in found.items()}

    def all_results(self):
        """{cell key: result} of every stored result."""
        return self._scan(_RESULT)

    def traces(self, keys):
        """{cell key before files: trace} of the stored ones among `keys`."""
        found = self._get(_TRACE + k.encode() for k in keys)
        return {k[len(_TRACE):].decode(): v for k, v in found.items()}

    def put_run(self, results, name=None, record=None, traces=None):
        """Store a run's results ({cell key: result}), traces ({key: trace}) and, given a
        `name`, its record, in one transaction (a commit is a flush to disk: one per
        run, not per cell)."""
        puts = [(_RESULT + k.encode(), v) for k, v in results.items()]
        puts += [(_TRACE + k.encode(), v) for k, v in (traces or {}).items()]
        if name is not None:
            puts.append((_NOTEBOOK + name.encode("utf-8", "surrogateescape"), record))
        self._write(puts=puts)

    def delete_results(self, keys):
        """Forget results (their states are the caller's to delete)."""
        self._write(deletes=[_RESULT + k.encode() for k in keys])

    # Notebook records ----------------------------------------------------------

    def record(self, name):
        """The record of notebook `name`'s last run, or None."""
        key = _NOTEBOOK + name.encode("utf-8", "surrogateescape")
        return self._get([key]).get(key)

    def records(self):
        """{notebook name: record} of every notebook."""
        return self._scan(_NOTEBOOK)

    def delete_records(self, names):
        """Forget notebooks' records."""
        self._write(deletes=[_NOTEBOOK + n.encode("utf-8", "surrogateescape") for n in names])

    def clear(self):
        """Forget every result and record."""
        with self.store.env.begin(write=True) as txn:
            txn.drop(self.db, delete=False)
