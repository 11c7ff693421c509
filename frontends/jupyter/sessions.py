"""Sessions: named lineages of states, each with a head that the next cell runs from.

A session is two files in the backend's sessions folder, named after a
hash of the session's name (a notebook path may be long or hold any
character): `<id>.json`, small and rewritten whole ({name, head, next}),
and `<id>.cells.jsonl`, one line appended per cell that made a state
({n, state, parent, time, line}). The lineage is read back from the
records by following `parent` from the head. A lock file per session
makes each change one step when two kernels share a session.
"""

import contextlib
import datetime
import fcntl
import hashlib
import json
import os

INITIAL = "initial"
MAX_STATE_NAME = 200


class Session:
    """One session's head and counter (the records are read on demand)."""

    def __init__(self, store, name, head=INITIAL, next=1):
        """A session as stored in `store`."""
        self.store = store
        self.name = name
        self.head = head
        self.next = next

    def state_name(self, n):
        """The name of the state that cell `n` of this session makes."""
        name = f"jupyter/{self.name}/{n}"
        if len(name) > MAX_STATE_NAME:
            name = f"jupyter/{hashlib.sha256(self.name.encode()).hexdigest()[:32]}/{n}"
        return name

    def records(self):
        """Every cell of this session that made a state, oldest first."""
        try:
            with open(self.store.path(self.name, ".cells.jsonl")) as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def lineage(self):
        """The records from the head back, as far as the session's own cells go."""
        by_state = {r["state"]: r for r in self.records()}
        chain, state = [], self.head
        while state in by_state and len(chain) <= len(by_state):
            chain.append(by_state[state])
            state = by_state[state]["parent"]
        return chain

    def cell(self, n):
        """The newest record of cell number `n`, or None."""
        found = [r for r in self.records() if r["n"] == n]
        return found[-1] if found else None


class Sessions:
    """The sessions of one backend, as files in a folder."""

    def __init__(self, folder):
        """Use `folder` (made private if missing)."""
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self.folder = folder

    def path(self, name, suffix):
        """A file of session `name`."""
        return os.path.join(self.folder, hashlib.sha256(name.encode()).hexdigest()[:32] + suffix)

    def exists(self, name):
        """True when session `name` has been saved."""
        return os.path.exists(self.path(name, ".json"))

    def load(self, name):
        """Session `name` (a new, empty one if it was never saved)."""
        try:
            with open(self.path(name, ".json")) as f:
                data = json.load(f)
            return Session(self, name, data["head"], data["next"])
        except FileNotFoundError:
            return Session(self, name)

    def names(self):
        """Every saved session's name, sorted."""
        names = []
        for entry in os.listdir(self.folder):
            if entry.endswith(".json"):
                with open(os.path.join(self.folder, entry)) as f:
                    names.append(json.load(f)["name"])
        return sorted(names)

    @contextlib.contextmanager
    def change(self, name):
        """Session `name`, read under its lock and saved when the block ends without error."""
        with open(self.path(name, ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            session = self.load(name)
            yield session
            self._save(session)

    def _save(self, session):
        """Write the session's small file atomically."""
        path = self.path(session.name, ".json")
        with open(path + ".tmp", "w") as f:
            json.dump({"name": session.name, "head": session.head, "next": session.next}, f)
        os.replace(path + ".tmp", path)

    def append(self, session, n, state, parent, code):
        """Record that cell `n` of `session` made `state` from `parent`."""
        lines = [line.strip() for line in code.splitlines() if line.strip()]
        record = {"n": n, "state": state, "parent": parent,
                  "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  "line": lines[0] if lines else ""}
        self.copy(session, [record])

    def copy(self, session, records):
        """Append records (oldest first) to `session`'s cells."""
        with open(self.path(session.name, ".cells.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
