"""Work in a thread of its own whose events come back to the thread that waits.

A notebook run or a streamed cell reports its progress as it goes (a cell's
status, an output item); the thread that started it must stay free to show
them (the `run` command, which also takes Ctrl-C meanwhile) or to send them
(a streamed HTTP answer). Both use this relay.
"""

import queue
import threading

# What Relay.next() gives: an event the work reported, what it returned, what it raised.
EVENT, DONE, ERROR = "event", "done", "error"


class Relay:
    """`work(emit)` running in a thread of its own, from now on; each `emit(event)` it
    makes, then its end, comes out of `next()` in the caller's thread."""

    def __init__(self, work, name):
        """Start `work` in a daemon thread named `name`."""
        self._events = queue.Queue()
        threading.Thread(target=self._run, args=(work,), name=name, daemon=True).start()

    def _run(self, work):
        """The thread: the work, its events and its end handed to the caller."""
        try:
            self._events.put((DONE, work(lambda event: self._events.put((EVENT, event)))))
        except BaseException as exc:  # raised again where the caller wants it
            self._events.put((ERROR, exc))

    def next(self):
        """(kind, value), waiting for it: (EVENT, an event), then (DONE, what `work`
        returned) or (ERROR, what it raised) last. A Ctrl-C that interrupts the wait
        leaves the item it waited for to the next call."""
        return self._events.get()
