"""A cell's streamed outputs, sent to the front end as iopub messages.

The server streams each write of the cell as it happens (`print` alone
writes its items and the newline apart). Like ipykernel's OutStream,
consecutive text of one stream is gathered and sent at most every
`jupyter.stream_flush_s`, and at once before any other output, so a
saved notebook (nbclient, papermill) holds one stream output where the
cell printed one line, not a fragment per write.
"""

import base64
import threading


class OutputRelay:
    """Turns the NDJSON events of one cell into iopub messages."""

    def __init__(self, send, execution_count, flush_s):
        """`send(msg_type, content[, metadata, buffers])` publishes one message for the
        running cell."""
        self.send = send
        self.execution_count = execution_count
        self.flush_s = flush_s
        self.lock = threading.Lock()
        self.pending = None  # (stream name, [texts]) not sent yet
        self.timer = None
        self.error_shown = False

    def output(self, out):
        """Publish one nbformat output (an `output` event)."""
        kind = out["output_type"]
        if kind == "stream":
            self._gather(out["name"], out["text"])
            return
        self.flush()
        if kind == "execute_result":
            self.send("execute_result", {"execution_count": self.execution_count,
                                         "data": out["data"], "metadata": out.get("metadata", {})})
        elif kind in ("display_data", "update_display_data"):
            self.send(kind, {"data": out["data"], "metadata": out.get("metadata", {}),
                             "transient": out.get("transient", {})})
        elif kind == "error":
            self.error_shown = True
            self.send("error", {"ename": out["ename"], "evalue": out["evalue"],
                                "traceback": out["traceback"]})

    def comm(self, event):
        """Publish a comm message of the cell's process (a `comm` event: its msg_type,
        content, metadata and base64 buffers)."""
        self.flush()
        self.send(event["msg_type"], event["content"], event.get("metadata") or {},
                  [base64.b64decode(b) for b in event.get("buffers") or ()])

    def clear_output(self, wait):
        """Publish a clear_output (a `clear_output` event)."""
        self.flush()
        self.send("clear_output", {"wait": wait})

    def _gather(self, name, text):
        """Keep stream text until the flush interval ends or another output comes."""
        with self.lock:
            if self.pending is not None and self.pending[0] != name:
                self._flush_locked()
            if self.pending is None:
                self.pending = (name, [])
                self.timer = threading.Timer(self.flush_s, self.flush)
                self.timer.daemon = True
                self.timer.start()
            self.pending[1].append(text)

    def flush(self):
        """Send the gathered stream text now."""
        with self.lock:
            self._flush_locked()

    def _flush_locked(self):
        """flush() under the lock."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.pending is not None:
            name, texts = self.pending
            self.pending = None
            self.send("stream", {"name": name, "text": "".join(texts)})
