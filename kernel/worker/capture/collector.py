"""The outputs of one cell, in the order the cell produced them.

`OutputCollector` merges consecutive writes to one stream into one output,
carries out clear_output and display updates, and keeps the cell's output
under display.max_output_bytes. When the cell streams (a `sink` is given),
it also hands each item to the sink as it is produced, as Jupyter sends its
iopub messages; the final list is the same either way. Stream text goes to
the sink a line at a time, as a terminal shows it: when a write ends a line,
when the stream is flushed (print(..., flush=True), progress bars), and
before any other item.

`running()` is the collector of the cell running in this process (None
between cells); `publish` and `clear_output` act on it.
"""

import contextlib
import signal
import threading

from snapkernel.kernel.worker.capture.bundles import bundle_size, cap_bundle, normalize_bundle

_running = None  # the OutputCollector of the running cell, if any


def running():
    """The running cell's collector, or None outside a cell."""
    return _running


def set_running(collector):
    """Make `collector` the running cell's (None when the cell is over)."""
    global _running
    _running = collector


def running_settings():
    """The running cell's settings, or None outside a cell."""
    return _running.settings if _running is not None else None


def publish(data, metadata=None, transient=None, update=False):
    """Add a display to the running cell (nothing happens outside a cell)."""
    if _running is not None:
        _running.display(data, metadata, transient=transient, update=update)


def send_comm(item):
    """Stream a comm message ({"type": "comm", ...}) in the running cell's order; it goes
    nowhere outside a streamed cell."""
    if _running is not None:
        _running.comm(item)


def clear_output(wait=False):
    """Clear the running cell's outputs so far (at the next output when wait=True)."""
    if _running is not None:
        _running.clear(wait)


@contextlib.contextmanager
def _sigint_held():
    """Delay SIGINT to the end of the block (in the main thread, where signals run)."""
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    hit = []
    signal.signal(signal.SIGINT, lambda *args: hit.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if hit:
            handler(*hit[0])


class OutputCollector:
    """The ordered outputs of one cell, with stream merging and size limits.

    `drain`, when set, is called before every new output so that output
    written at the file-descriptor level lands before it. `sink`, when
    given, is called with each item as it is produced (see `_emit`).
    """

    def __init__(self, settings, execution_count=None, sink=None):
        """Start an empty list of outputs under the given settings."""
        self.settings = settings
        self.execution_count = execution_count
        self.sink = sink
        self.max_bytes = settings["display.max_output_bytes"]
        self.max_chars = settings["display.max_mime_chars"]
        self.outputs = []
        self.size = 0
        self.truncated = False
        self.drain = None
        self.namespace = None  # the cell's globals, lent to the IPython shell when it is used
        self.lock = threading.RLock()
        self._clear_pending = False
        self._unsent = None  # (stream name, [chunks]) written but not yet given to the sink

    # -- streaming ------------------------------------------------------
    def _emit(self, item):
        """Hand one item to the sink: {"type": "output", "output": ...} or
        {"type": "clear_output", "wait": bool}.

        Called under the lock, so items reach the sink one at a time and in
        order, whichever thread of the cell produced them. SIGINT waits until
        the sink returns (a message cut in half would break the sink's
        channel) and is delivered then. A sink that fails ends the streaming
        of this cell; its outputs are still all in the final list.
        """
        if self.sink is None:
            return
        if self._unsent is not None:
            self._send_stream()
        self._send(item)

    def _send(self, item):
        """Call the sink, SIGINT held."""
        if self.sink is None:
            return
        with _sigint_held():
            try:
                self.sink(item)
            except Exception:
                self.sink = None

    def _send_stream(self):
        """Give the sink the stream text written since the last item."""
        name, chunks = self._unsent
        self._unsent = None
        self._send({"type": "output",
                    "output": {"output_type": "stream", "name": name, "text": "".join(chunks)}})

    def flush(self):
        """A stream was flushed, or the cell ended: what it wrote (fd level included)
        goes to the sink now."""
        if self.sink is None:
            return
        with self.lock:
            if self.drain is not None:
                self.drain(False)
            if self._unsent is not None:
                self._send_stream()

    # -- streams -------------------------------------------------------
    def stream(self, name, text, drain=True):
        """Append stream text, merged with the previous output if it is the same stream."""
        with self.lock:  # threads of the cell may print at the same time
            self._stream(name, text, drain)

    def _stream(self, name, text, drain):
        """stream() under the lock."""
        if drain and self.drain is not None:
            self.drain(False)
        if not text or self.truncated:
            return
        self._apply_pending_clear()
        room = self.max_bytes - self.size
        size = len(text) if text.isascii() else len(text.encode("utf-8", "replace"))
        if size > room:
            text = text[:max(room, 0)]
            self._append_stream(name, text)
            self._truncate()
            return
        self.size += size
        self._append_stream(name, text)

    def _append_stream(self, name, text):
        """Add text to the last output when it is the same stream, else start one."""
        if not text:
            return
        last = self.outputs[-1] if self.outputs else None
        if last is not None and last["output_type"] == "stream" and last["name"] == name:
            last["_chunks"].append(text)
        else:
            self.outputs.append({"output_type": "stream", "name": name, "_chunks": [text]})
        if self.sink is None:
            return
        if self._unsent is not None and self._unsent[0] != name:
            self._send_stream()
        if self._unsent is None:
            self._unsent = (name, [])
        self._unsent[1].append(text)
        if "\n" in text:
            self._send_stream()

    def _truncate(self):
        """Stop collecting and leave a visible marker at the end."""
        self.truncated = True
        self._append_stream("stderr", (
            f"\n[output truncated: the cell's output exceeded display.max_output_bytes="
            f"{self.max_bytes:,} bytes; the rest was dropped]\n"))

    # -- displays ------------------------------------------------------
    def display(self, data, metadata=None, transient=None, update=False,
                output_type="display_data"):
        """Append a display_data (or execute_result) output, or update a display by id."""
        with self.lock:
            self._display(data, metadata, transient, update, output_type)

    def _display(self, data, metadata, transient, update, output_type):
        """display() under the lock."""
        if self.drain is not None:
            self.drain()
        data, metadata = normalize_bundle(data, metadata)
        if not data:
            return
        data = cap_bundle(data, self.max_chars)
        display_id = (transient or {}).get("display_id") if isinstance(transient, dict) else None
        if update:
            # update_display: replace every earlier output of this display id.
            for out in self.outputs:
                if out.get("_display_id") == display_id and display_id is not None:
                    self.size += bundle_size(data) - bundle_size(out["data"])
                    out["data"], out["metadata"] = data, metadata
            if display_id is not None:
                # Streamed as Jupyter does: the front end updates wherever that id is shown.
                self._emit({"type": "output", "output": {
                    "output_type": "update_display_data", "data": data, "metadata": metadata,
                    "transient": {"display_id": display_id}}})
            return
        if self.truncated:
            return
        self._apply_pending_clear()
        size = bundle_size(data)
        if self.size + size > self.max_bytes:
            self._truncate()
            return
        self.size += size
        out = {"output_type": output_type, "data": data, "metadata": metadata}
        if output_type == "execute_result":
            out["execution_count"] = self.execution_count
        streamed = dict(out)
        if display_id is not None:
            out["_display_id"] = display_id
            streamed["transient"] = {"display_id": display_id}
        self.outputs.append(out)
        self._emit({"type": "output", "output": streamed})

    def clear(self, wait=False):
        """clear_output(): drop what the cell showed so far (at the next output if wait)."""
        with self.lock:
            if self.drain is not None:
                self.drain()
            if wait:
                self._clear_pending = True
            else:
                self._clear_now()
            self._emit({"type": "clear_output", "wait": bool(wait)})

    def comm(self, item):
        """A comm message (kernel/worker/capture/comms.py): to the sink only, it is no
        output of the cell."""
        with self.lock:
            if self.drain is not None:
                self.drain()
            self._emit(item)

    def _apply_pending_clear(self):
        """Carry out a clear_output(wait=True) now that new output arrives."""
        if self._clear_pending:
            self._clear_now()

    def _clear_now(self):
        """Forget every output collected so far."""
        self._clear_pending = False
        self.outputs = []
        self.size = 0

    def result(self):
        """Return the outputs as nbformat v4 dicts."""
        final = []
        for out in self.outputs:
            out = dict(out)
            if out["output_type"] == "stream":
                out["text"] = "".join(out.pop("_chunks"))
            out.pop("_display_id", None)
            final.append(out)
        return final
