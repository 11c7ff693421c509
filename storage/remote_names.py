"""The server's side of a shared remote: other servers' names in, queued states out.

One per server process (its workers only read and write through,
storage/cache.py). It

- takes in the remote's names: at start, then at most every
  `remote_refresh_s` when the registry asks (`changes`), and at once for a
  name the registry does not know (`changes(name)`): each record whose
  ETag differs from the one seen last is read and cached in LMDB;
- publishes from an on-disk queue (in LMDB, so it survives a restart):
  with `durability = "async"` every new binding and deletion, in both
  modes the states a store held before `remote` was set. A thread drains
  it, every `remote_retry_s` while the remote is unreachable.

Rebinding one name on two servers: with "sync" the loser's execution is
refused (409, storage.remote.NameConflict) and it takes in the winner's
record, so running again rebinds the name over it. With "async" there is
no one to refuse any more: the state created last wins (manifest
`created`), on both servers, and the record is still only ever replaced by
compare-and-swap, so it is never torn.
"""

import logging
import threading
import time

from snapkernel.storage.cache import UNSHARED
from snapkernel.storage.remote import NameConflict, RemoteUnavailable
from snapkernel.storage.store import StoreError

log = logging.getLogger("snapshot_kernel")
# A name another server keeps rebinding: publishing it is retried at the next round.
_TRIES = 5


class RemoteNames:
    """Keeps one server's names in step with the remote."""

    def __init__(self, store, settings):
        """Work with `store`, this server process's CachedStore."""
        self.store = store
        self.remote = store.remote
        self.refresh_s = settings["store.remote_refresh_s"]
        self.retry_s = settings["store.remote_retry_s"]
        self.list_wait_s = settings["store.remote_list_wait_s"]
        self.look_lock = threading.Lock()
        self.last_look = 0.0  # time.monotonic() of the last listing
        self.quiet_until = 0.0  # after a failed listing, none before this
        self.taken = {}  # names the publishing thread took from the remote, for `changes`
        self.taken_lock = threading.Lock()
        self.looked = threading.Event()  # set while no listing is under way
        self.looked.set()
        self.wake = threading.Event()
        self.format_checked = False  # see RemoteStore.check_format

    def start(self):
        """Take in the remote's names and start publishing the queue.

        An unreachable remote is not fatal (the server starts from its
        cache); a remote set up wrongly (credentials, bucket) or written by a
        newer server (its format record) is.
        """
        try:
            self._look(queue_local=True)
        except RemoteUnavailable as exc:
            log.warning("starting from the local cache: %s", exc)
            self.quiet_until = time.monotonic() + self.retry_s
        threading.Thread(target=self._run, name="remote-names", daemon=True).start()
        self.wake.set()

    # Taking in -----------------------------------------------------------

    def changes(self, name=None):
        """{name: manifest, or None if deleted} changed on the remote since the last call.

        With `name`, that name's record is read now. Otherwise the list of
        names is read if the last look is older than remote_refresh_s, in a
        thread of its own waited for at most remote_list_wait_s: a remote
        that hangs delays no request longer. While the remote is
        unreachable this answers from what is known.
        """
        if time.monotonic() >= self.quiet_until:
            if name is not None:
                self._guarded(lambda: self._take(self._look_name(name)))
            elif time.monotonic() - self.last_look >= self.refresh_s and self.looked.is_set():
                self.looked.clear()
                threading.Thread(target=self._look_in_thread, name="remote-names",
                                 daemon=True).start()
                self.looked.wait(self.list_wait_s)
        with self.taken_lock:
            found, self.taken = self.taken, {}
        return found

    def _look_in_thread(self):
        """Read the list of names for `changes` (then let it go on)."""
        try:
            self._guarded(lambda: self._take(self._look()))
        except StoreError as exc:  # set up wrongly, or a newer server's format: a request
            log.error("the remote's names are not refreshed: %s", exc)  # reading it says so
        finally:
            self.looked.set()

    def _guarded(self, look):
        """Run a look at the remote; while it is unreachable, no looks for remote_retry_s."""
        try:
            with self.look_lock:
                look()
        except RemoteUnavailable as exc:
            log.warning("the remote's names are not refreshed: %s", exc)
            self.quiet_until = time.monotonic() + self.retry_s

    def _take(self, found):
        """Hand changes found on the remote to the next `changes` call."""
        with self.taken_lock:
            self.taken.update(found)

    def _look(self, queue_local=False):
        """Read the remote's list of names; cache what changed; return the changes.
        The first look that reaches the remote checks it first (RemoteStore.check)."""
        if not self.format_checked:
            self.remote.check()
            self.format_checked = True
        began = time.time()
        listing = self.remote.names()
        self.last_look = time.monotonic()
        etags, queued = self.store.etags(), self.store.queued()
        wanted = [n for n, etag in listing.items()
                  if n not in UNSHARED and n not in queued and etags.get(n) != etag]
        found = {}
        for name, got in zip(wanted, self.store.each(self.remote.get_name, wanted)):
            if got is not None:  # None: deleted since the listing (the next look sees it)
                self.store.take(name, *got)
                found[name] = got[0]
        for name in etags.keys() - listing.keys() - queued.keys():
            self.store.drop(name)
            found[name] = None
        self.store.looked(began)
        if queue_local:
            # States this store held before `remote` was set (or written just before a crash).
            for name, manifest in self.store.manifests().items():
                if name not in UNSHARED | listing.keys() | queued.keys() | etags.keys():
                    self.store.queue(name, manifest["id"])
        return found

    def _look_name(self, name):
        """Read the record of one name; cache it if it changed; return the change."""
        if name in UNSHARED or name in self.store.queued():
            return {}
        got = self.remote.get_name(name)
        etag = self.store.etag(name)
        if got is None:
            if etag is None:
                return {}
            self.store.drop(name)
            return {name: None}
        if got[1] == etag:
            return {}
        self.store.take(name, *got)
        return {name: got[0]}

    # Publishing ----------------------------------------------------------

    def bound(self, manifest):
        """A name now points at `manifest`: with "async", queue it for the remote."""
        if not self.store.publish_now and manifest["name"] not in UNSHARED:
            self.store.queue(manifest["name"], manifest["id"])
            self.wake.set()

    def delete(self, name):
        """Delete `name` on the remote: at once ("sync"; may raise RemoteUnavailable or
        NameConflict, having changed nothing), or queued ("async")."""
        if name in UNSHARED:
            return
        if not self.store.publish_now:
            self.store.queue(name, "")
            self.wake.set()
            return
        etag = self.store.etag(name)
        if etag is not None:
            self.remote.delete_name(name, etag)
        self.store.forget_etag(name)
        state_id = self.store.queued().get(name)
        if state_id is not None:
            self.store.unqueue(name, state_id)

    def _run(self):
        """The publishing thread: drain the queue when woken, retry while it is not empty."""
        backlog = False
        while True:
            self.wake.wait(self.retry_s if backlog else None)
            self.wake.clear()
            try:
                self._drain()
                backlog = False
            except StoreError as exc:
                if not backlog:
                    log.warning("publishing to the remote waits: %s", exc)
                backlog = True
            except Exception:
                log.exception("publishing to the remote failed")
                backlog = True

    def _drain(self):
        """Do every queued publication and deletion (the first failure stops the round)."""
        for name, state_id in self.store.queued().items():
            if state_id:
                self._publish(name, state_id)
            else:
                self._unpublish(name)

    def _publish(self, name, state_id):
        """Publish the state `name` points at here, if it is still `state_id`."""
        manifest = self.store.manifest(name)
        if manifest is None or manifest["id"] != state_id:
            self.store.unqueue(name, state_id)  # rebound or deleted since: that is queued
            return
        for _ in range(_TRIES):
            try:
                etag, fresh = self.store.publish(name, manifest)
                break
            except NameConflict:
                got = self.remote.get_name(name)
                if got is None:
                    self.store.forget_etag(name)
                    continue
                theirs, etag = got
                if theirs["id"] == state_id:
                    fresh = {}
                    break
                if theirs["created"] > manifest["created"]:
                    # Theirs was made last: it wins here too.
                    self.store.take(name, theirs, etag)
                    self.store.unqueue(name, state_id)
                    self._take({name: theirs})
                    return
                self.store.note(name, etag, {})
        else:
            return
        self.store.note(name, etag, fresh)
        self.store.unqueue(name, state_id)

    def _unpublish(self, name):
        """Delete `name`'s record on the remote (unless another server rebound it)."""
        etag = self.store.etag(name)
        if etag is not None:
            try:
                self.remote.delete_name(name, etag)
            except NameConflict:
                pass  # rebound elsewhere meanwhile: that binding stands; the next look takes it
        self.store.forget_etag(name)
        self.store.unqueue(name, "")
