"""Turn a namespace into a state manifest and back, incrementally.

Saving re-pickles only the dirty names (those a cell touched, with the
rest of their alias groups); every other group keeps its blob keys from
the parent manifest. Loading fills a namespace from a manifest's groups,
one group at a time, so a restore can load what a cell needs first.
"""

import datetime
import hashlib
import importlib
import json
import sys
import types
import uuid

from snapkernel.storage import pages, serializer, threads
from snapkernel.storage.groups import alias_groups
from snapkernel.storage.store import StoreCorrupt

PYTHON = f"{sys.implementation.name}-{sys.version_info[0]}.{sys.version_info[1]}"
# Chunks of a buffer being restored that the disk is asked for ahead of the one read.
_PREFETCH = 32


def is_user_name(name):
    """True for a notebook variable (not a dunder such as __builtins__)."""
    return not (name.startswith("__") and name.endswith("__"))


def short_repr(value, limit):
    """A repr cut to `limit` characters, never raising."""
    try:
        text = repr(value)
    except Exception as exc:
        text = f"<repr failed: {type(exc).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def type_name(value):
    """The short type name shown for a variable."""
    return type(value).__name__


def new_manifest(name, parent=None, code="", execution_count=0, auto_named=False):
    """An empty manifest for state `name` (its groups are filled by save_groups)."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    parent = parent or {}
    return {
        "name": name, "id": uuid.uuid4().hex, "created": now, "timestamp": now,
        "parent": parent.get("name"), "parent_id": parent.get("id"),
        "code": code, "code_digest": hashlib.sha256(code.encode()).hexdigest(),
        "execution_count": execution_count, "python": PYTHON, "auto_named": auto_named,
        "groups": [], "variables": {}, "modules": {}, "volatile": {},
        # The process context (kernel/worker/context.py): {provider: blob key}, and of it
        # what the server reads without the blobs. A new state starts with its parent's.
        "context": dict(parent.get("context") or {}), "cwd": parent.get("cwd"),
        "home": parent.get("home"),
        "local_modules": dict(parent.get("local_modules") or {}),
        "unkept": list(parent.get("unkept") or []),
    }


def _sha(data):
    """Hex SHA-256 of a bytes-like object."""
    return hashlib.sha256(data).hexdigest()


def _key_and_digest(piece):
    """A new chunk's blob key and the digest that vouches for it later (storage/pages.py);
    the key is the one known for that digest, if any, else its SHA-256."""
    checked = pages.digest(piece)
    return pages.key_of(checked) or _sha(piece), checked


def _chunks(pickled, chunk, workers=1, hashed=None):
    """Split out-of-band buffers into chunks: [(piece, key)] and chunks per buffer.

    Each chunk is a blob of its own, so a changed column of a 2-D pandas
    block costs its own chunks, not the block. A chunk whose bytes are
    known unchanged since it was stored (storage/pages.py) keeps its key
    without hashing; the others are hashed (on `workers` threads when
    there are enough bytes to: threads.for_hashing), and
    hashed(piece, key) is called for each as soon as it is (a large
    state's blobs are written meanwhile: Store.records).
    """
    known, layout = [], []
    for view in pickled.buffers:
        entries = pages.known(view, chunk, workers)
        known += [(view[start:start + chunk], entry)
                  for start, entry in zip(range(0, view.nbytes, chunk), entries)]
        layout.append(len(entries))
    todo = [piece for piece, entry in known if entry is None]
    new = threads.ordered(_key_and_digest, todo,
                          threads.for_hashing(sum(piece.nbytes for piece in todo), workers))
    pieces, digests = [], []
    for piece, entry in known:
        if entry is None:
            entry = next(new)
            if hashed is not None:
                hashed(piece, entry[0])
        pieces.append((piece, entry[0]))
        digests.append(entry[1])
    at = 0
    for view, count in zip(pickled.buffers, layout):
        pages.remember(view, [key for _, key in pieces[at:at + count]], chunk,
                       digests[at:at + count])
        at += count
    return pieces, layout


def _digest(pickled, payload_key, pieces, layout):
    """Fingerprint of a pickled group: what it pickles to and how its buffers split."""
    parts = [pickled.pickler, payload_key, *(k for _, k in pieces), repr(layout)]
    return _sha("\0".join(parts).encode())


def _pickle_group(values, namespace, class_tag, settings, records, store, references):
    """Serialize one group; return its entry and what a restore gives back of it inert
    (storage/handles.py), and add the payloads of new blobs to `records`.

    A buffer of one chunk is referred to by the chunk's key; a longer one by
    the key of a chunk list (the chunks' keys, 32 bytes each), so the
    manifest stays one key per buffer however large the buffer.
    """
    pickled = serializer.dumps(values, namespace, class_tag,
                               settings["store.buffer_blob_min_bytes"], references)
    key = _sha(pickled.payload)

    def hashed(piece, k):
        """A new chunk goes to the records (and so, for a large state, to the store) now."""
        if k not in records and store.missing([k]):
            records[k] = piece

    pieces, layout = _chunks(pickled, settings["store.chunk_bytes"], settings["store.threads"],
                             hashed)
    blobs = {key: pickled.payload}
    blobs.update((k, piece) for piece, k in pieces)
    buffers, chunk_keys = [], iter([k for _, k in pieces])
    for count in layout:
        keys = [next(chunk_keys) for _ in range(count)]
        if count == 1:
            buffers.append(keys[0])
        else:
            listing = b"".join(bytes.fromhex(k) for k in keys)
            buffers.append(_sha(listing))
            blobs[buffers[-1]] = listing
    new = store.missing(blobs) - records.keys()
    for k in new:
        records[k] = blobs[k]
    return ({"key": key, "buffers": buffers, "layout": layout, "pickler": pickled.pickler,
             "fingerprint": _digest(pickled, key, pieces, layout)},
            list(dict.fromkeys(pickled.inert)))


def save_groups(store, manifest, namespace, dirty, settings, class_tag="", parent=None,
                rebound=None):
    """Group, pickle and hash the `dirty` names of `namespace` into `manifest`.

    Returns the payloads of the blobs to write ({key: bytes-like}, encoded
    as they are written: `commit`). Values neither pickler can store
    become volatile: listed in the manifest, kept live by the holder, with
    the code that makes them again: this cell's, unless the value was volatile
    in `parent` already and the cell did not rebind it (it is not in
    `rebound`, when given), which keeps the parent's maker. A group that
    pickles exactly as in `parent` (a cell only read it) keeps the parent's
    symbol hashes and reprs, which can cost more than the pickle. A group
    holding handles that a restore gives back inert (an open file: restored
    closed) lists them by member (`inert`).
    """
    pages.begin_save()
    before = {(g["fingerprint"], tuple(g["members"])): g for g in (parent or {}).get("groups", [])}
    limit = settings["store.repr_max_chars"]
    records = store.records()
    values = {}
    for name in dirty:
        value = namespace[name]
        if isinstance(value, types.ModuleType):
            manifest["modules"][name] = value.__name__
            manifest["variables"][name] = {"type": "module", "repr": short_repr(value, limit)}
        else:
            values[name] = value
    # A library's own object held under its own name is stored as that name of the library.
    references = {id(v): where for name, v in values.items()
                  if (where := serializer.library_attribute(name, v)) is not None}
    for members in alias_groups(values, namespace):
        try:
            entry, notes = _pickle_group([values[m] for m in members], namespace, class_tag,
                                         settings, records, store, references)
        except serializer.Unpicklable:
            # Store what can be stored; the rest of the group becomes volatile.
            for m in members:
                try:
                    single, notes = _pickle_group([values[m]], namespace, class_tag,
                                                  settings, records, store, references)
                except serializer.Unpicklable as exc:
                    maker = (parent or {}).get("volatile", {}).get(m)
                    if maker is None or rebound is None or m in rebound:
                        maker = {"code": manifest["code"], "state": manifest["name"]}
                    manifest["volatile"][m] = {
                        "type": type_name(values[m]), "repr": short_repr(values[m], limit),
                        "code": maker["code"], "state": maker["state"],
                        "reason": str(exc)[:300]}
                    manifest["variables"][m] = {"type": type_name(values[m]),
                                                "repr": short_repr(values[m], limit)}
                    continue
                single["members"] = [m]
                single["hashes"] = {m: single["fingerprint"]}
                if notes:
                    single["inert"] = {m: notes}
                manifest["groups"].append(single)
                manifest["variables"][m] = {"type": type_name(values[m]),
                                            "repr": short_repr(values[m], limit)}
            continue
        entry["members"] = members
        same = before.get((entry["fingerprint"], tuple(members)))
        # A file closed since pickles as it did open: only what the listing says differs.
        if same is not None and _noted(same) == set(notes):
            carry(manifest, parent, [same], [], [])
            continue
        if len(members) == 1:
            entry["hashes"] = {members[0]: entry["fingerprint"]}
            inert = {members[0]: notes} if notes else {}
        else:
            entry["hashes"], inert = {}, {}
            for m in members:
                entry["hashes"][m], held = _value_hash(values[m], namespace, class_tag,
                                                       settings, references)
                if held:
                    inert[m] = held
        if inert:
            entry["inert"] = inert
        manifest["groups"].append(entry)
        for m in members:
            manifest["variables"][m] = {"type": type_name(values[m]),
                                        "repr": short_repr(values[m], limit)}
    return records


def describe_again(manifest, namespace, held_outside, limit):
    """Describe again the variables whose value `held_outside` says is kept outside its
    pickle (a widget is pickled as its model id, its value kept in the context): their
    group is carried unchanged while what they show changed."""
    for name, described in manifest["variables"].items():
        value = namespace.get(name)
        if described["type"] != "module" and held_outside(value):
            manifest["variables"][name] = {"type": type_name(value),
                                           "repr": short_repr(value, limit)}


def _value_hash(value, namespace, class_tag, settings, references):
    """The symbol hash of one value on its own (for members of larger groups), and what
    a restore gives back of it inert."""
    pickled = serializer.dumps([value], namespace, class_tag,
                               settings["store.buffer_blob_min_bytes"], references)
    pieces, layout = _chunks(pickled, settings["store.chunk_bytes"], settings["store.threads"])
    return _digest(pickled, _sha(pickled.payload), pieces, layout), list(
        dict.fromkeys(pickled.inert))


def _noted(group):
    """Every note of a group's `inert` members."""
    return {note for notes in group.get("inert", {}).values() for note in notes}


def inert(manifest):
    """{variable: [what a restore gives back of it inert]} of a state: its open files,
    sockets, processes... (storage/handles.py)."""
    return {m: notes for group in manifest["groups"]
            for m, notes in group.get("inert", {}).items()}


def carry(manifest, parent, groups, module_names, volatile_names):
    """Copy parent groups, module variables and volatile records unchanged."""
    for group in groups:
        manifest["groups"].append(group)
        for m in group["members"]:
            manifest["variables"][m] = parent["variables"][m]
    for name in module_names:
        manifest["modules"][name] = parent["modules"][name]
        manifest["variables"][name] = parent["variables"][name]
    for name in volatile_names:
        manifest["volatile"][name] = parent["volatile"][name]
        manifest["variables"][name] = parent["variables"][name]


def record_execution(manifest, payloads, key, answer):
    """Keep with the new state the execution that made it: its execution key and its
    answer (JSON-able), the answer a blob written with the manifest (both or neither),
    so a retry of that execution is answered without running it again."""
    data = json.dumps(answer, sort_keys=True).encode()
    blob = _sha(data)
    payloads[blob] = data
    manifest["execution"] = {"key": key, "answer": blob}


def stored_answer(store, manifest):
    """The answer recorded by record_execution (a dict), or None."""
    execution = manifest.get("execution")
    return json.loads(bytes(store.blob(execution["answer"]))) if execution else None


def commit(store, manifest, payloads, replaced=None):
    """Write a new state, then forget buffer keys the state no longer holds.

    `replaced`: the parent's groups the state does not carry as they were
    (None: not known). Only those can have held a buffer the state lost;
    when every buffer of theirs is still in the state (a cell that changed
    small values, or only read a frame), listing the state's buffers (a
    chunk list per large buffer read from the store) is skipped: that cost
    a trivial cell next to a 1 GB frame about 1.2 ms.
    """
    store.write_state(manifest["name"], manifest, payloads)
    if replaced is None or _lost_buffers(manifest, replaced):
        pages.keep_only(store.referenced(manifest))


def _lost_buffers(manifest, replaced):
    """True if a group of `replaced` held a buffer no group of `manifest` holds."""
    kept = {key for group in manifest["groups"] for key in group["buffers"]}
    return any(key not in kept for group in replaced for key in group["buffers"])


def symbol_hash(manifest, name):
    """The stored hash of variable `name`, or None if the state lacks it."""
    for group in manifest["groups"]:
        if name in group["hashes"]:
            return group["hashes"][name]
    if name in manifest["modules"]:
        return _sha(f"module\0{manifest['modules'][name]}".encode())
    return None  # absent, or volatile (never pickled, so it has no hash)


class IncompatibleState(Exception):
    """A state made by another Python version cannot be loaded here."""


def check_compatible(manifest):
    """Refuse a state pickled by another interpreter version."""
    if manifest.get("python", PYTHON) != PYTHON and manifest["groups"]:
        raise IncompatibleState(
            f"state {manifest['name']!r} was made by {manifest['python']}; this server "
            f"runs {PYTHON}, and pickled code is tied to the interpreter version. Run "
            f"the server with {manifest['python']} or re-run the notebook from 'initial'")


def load_group(store, group, namespace, state, pause=None):
    """Load one group's members into `namespace` (functions bound to it); returns what
    could not be given back as it was saved (a file open for reading changed since),
    each line naming the group's variables.

    Every blob is verified before it is unpickled; a damaged or missing one
    raises StoreCorrupt naming `state` and the group's variables, and leaves
    the namespace as it was. pause(), if given, is called before each chunk
    of a large buffer is read (a holder loading in the background waits
    there while a cell's child loads: kernel/worker/holder.py).
    """
    try:
        payload = store.blob(group["key"])
        layout = group.get("layout") or [1] * len(group["buffers"])
        buffers = [_assemble(store, [key] if count == 1 else store.chunk_list(key), pause)
                   for key, count in zip(group["buffers"], layout)]
    except StoreCorrupt as exc:
        raise StoreCorrupt(
            f"state {state!r} cannot be loaded: the stored value of "
            f"{', '.join(group['members'])} is damaged ({exc}). The state's other variables "
            f"and the other states are not affected. Run scripts/check_store.py to list "
            f"every state that holds this value; delete those states and run "
            f"scripts/gc_states.py before making the value again (until then a new state "
            f"with an equal value reuses the damaged copy)") from None
    notes = []
    with serializer.loading_into(namespace):
        values = serializer.loads(payload, buffers, group["pickler"], notes)
    namespace.update(zip(group["members"], values))
    return [f"{', '.join(group['members'])}: {note}" for note in notes]


def _assemble(store, keys, pause=None):
    """One writable buffer from its chunks, each chunk's key remembered with the
    XXH3-128 of its bytes (storage/pages.py).

    Each chunk is verified and written (decompressed) straight into its
    place, so a restore needs the buffer's memory once, not twice (the
    state's save made every chunk but the last the same size). The digest
    is taken while the chunk is still in the CPU's cache: with it, a cell
    that restored a large value itself and only read it saves it again by
    that digest (about 0.2 s a GB) instead of a SHA-256 (about 1.3 s).
    """
    if len(keys) <= 1:
        buffer = store.blob(keys[0]) if keys else bytearray()
        pages.remember(memoryview(buffer), keys, max(len(buffer), 1),
                       [pages.digest(buffer)] if keys else None)
        return buffer
    first, last = store.blob(keys[0]), store.blob(keys[-1])
    chunk = len(first)
    buffer = pages.allocate(chunk * (len(keys) - 1) + len(last))
    view = memoryview(buffer)
    view[:chunk] = first
    view[len(view) - len(last):] = last
    store.prefetch(keys[1:1 + _PREFETCH])

    def read(i):
        """Chunk i into its place, the one _PREFETCH chunks on asked for meanwhile; the
        digest of its bytes."""
        if pause is not None:
            pause()
        store.prefetch(keys[i + _PREFETCH:i + _PREFETCH + 1])
        piece = view[i * chunk:(i + 1) * chunk]
        store.read_into(keys[i], piece)
        return pages.digest(piece)

    digests = [pages.digest(first), *threads.ordered(read, range(1, len(keys) - 1),
                                                     store.threads), pages.digest(last)]
    pages.remember(view, keys, chunk, digests)
    return buffer


def load_modules(manifest, namespace, names=None):
    """Import the state's module variables (by reference)."""
    for name, module in manifest["modules"].items():
        if names is None or name in names:
            namespace[name] = importlib.import_module(module)
