"""A checkpoint-per-cell baseline server for scripts/bench.py.

It runs every cell in one namespace with `exec` and then writes the whole
namespace to one file with dill, as session-pickling tools do after each
cell. It answers the same `POST /execute` JSON as the snapshot kernel, plus
`exec_ms` (the cell and its display), `dump_ms` and `checkpoint_bytes`
(what the dump wrote), so the benchmark can split a round trip into the
cell's own time and the checkpoint's. On start it loads the checkpoint if
one exists, which is this design's "restart". States are not kept: the
`state_name` of a request is ignored (the benchmark runs notebooks in order).

    python scripts/dill_baseline.py --bind 127.0.0.1:PORT --token T --checkpoint FILE
"""

import argparse
import ast
import builtins
import hmac
import json
import os
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import dill


class Session:
    """One namespace, checkpointed to `path` after every successful cell."""

    def __init__(self, path):
        """Load the checkpoint at `path` if there is one."""
        self.path = path
        self.lock = threading.Lock()
        self.namespace = {"__builtins__": builtins, "__name__": "__main__"}
        self.count = 0
        if os.path.exists(path):
            with open(path, "rb") as f:
                self.namespace.update(dill.load(f))

    def run(self, code):
        """Run a cell, display its last expression, checkpoint; return the answer."""
        with self.lock:
            # One namespace: cells are serialised, as in a single kernel.
            started = time.perf_counter()
            output, error = [], None
            try:
                output = self._exec(code)
            except BaseException as exc:
                error = {"ename": type(exc).__name__, "evalue": str(exc),
                         "traceback": traceback.format_exc().splitlines()}
            exec_s = time.perf_counter() - started
            dump_s, written = 0.0, 0
            if error is None:
                dump_s, written = self._checkpoint()
            self.count += 1
            return {"output": output, "error": error, "accessed_symbols": [],
                    "modified_symbols": [], "deleted_symbols": [],
                    "execution_count": self.count,
                    "exec_ms": exec_s * 1e3, "dump_ms": dump_s * 1e3,
                    "checkpoint_bytes": written}

    def _exec(self, code):
        """Exec `code`; the value of a final expression becomes an execute_result."""
        tree = ast.parse(code, "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), self.namespace)
        if last is None:
            return []
        value = eval(compile(last, "<cell>", "eval"), self.namespace)
        if value is None:
            return []
        data = {"text/plain": repr(value)}
        html = getattr(value, "_repr_html_", None)
        if callable(html):
            # Jupyter's front ends show the HTML table: pay for it as they do.
            text = html()
            if text is not None:
                data["text/html"] = text
        return [{"output_type": "execute_result", "data": data, "metadata": {},
                 "execution_count": self.count + 1}]

    def _checkpoint(self):
        """Dump the whole namespace with dill; return (seconds, bytes written)."""
        started = time.perf_counter()
        state = {k: v for k, v in self.namespace.items()
                 if not (k.startswith("__") and k.endswith("__"))}
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            dill.dump(state, f)
        os.replace(tmp, self.path)
        return time.perf_counter() - started, os.path.getsize(self.path)

    def reset(self):
        """Forget every variable and the checkpoint."""
        with self.lock:
            self.namespace = {"__builtins__": builtins, "__name__": "__main__"}
            if os.path.exists(self.path):
                os.unlink(self.path)


def make_handler(session, token):
    """The request handler class bound to `session`."""

    class Handler(BaseHTTPRequestHandler):
        """JSON routes: /execute, /reset, /health, DELETE /states/NAME."""

        protocol_version = "HTTP/1.1"

        def setup(self):
            """No Nagle delay between the headers and the body of an answer."""
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, *args):
            """Stay quiet, like the servers it is compared with."""

        def _answer(self, status, payload):
            """Send a JSON answer on the kept-alive connection."""
            raw = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _authorised(self):
            """True when the query carries the token."""
            given = parse_qs(urlparse(self.path).query).get("token", [""])[0]
            return hmac.compare_digest(given.encode(), token.encode())

        def _body(self):
            """The JSON body (an empty dict when there is none)."""
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            return json.loads(raw) if raw else {}

        def do_GET(self):
            """GET /health."""
            if urlparse(self.path).path == "/health":
                return self._answer(200, {"status": "ok"})
            self._answer(404, {"error": {"type": "NotFound", "message": self.path}})

        def do_DELETE(self):
            """DELETE /states/NAME: nothing is kept per state, so nothing to do."""
            self._body()  # read off the kept-alive connection
            name = urlparse(self.path).path.split("/states/", 1)[-1]
            self._answer(200, {"deleted": name})

        def do_POST(self):
            """POST /execute and /reset."""
            route = urlparse(self.path).path
            body = self._body()
            if not self._authorised():
                return self._answer(401, {"error": {"type": "Unauthorized", "message": ""}})
            if route == "/execute":
                answer = session.run(body.get("code", ""))
                answer["state_name"] = (None if answer["error"] else
                                        body.get("new_state_name") or f"s{session.count}")
                return self._answer(200, answer)
            if route == "/reset":
                session.reset()
                return self._answer(200, {"status": "ok"})
            self._answer(404, {"error": {"type": "NotFound", "message": route}})

    return Handler


def main(argv=None):
    """Serve until killed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bind", default="127.0.0.1:8090")
    p.add_argument("--token", required=True)
    p.add_argument("--checkpoint", required=True, help="file the namespace is dumped to")
    args = p.parse_args(argv)
    host, _, port = args.bind.rpartition(":")
    session = Session(args.checkpoint)
    server = ThreadingHTTPServer((host, int(port)), make_handler(session, args.token))
    server.daemon_threads = True
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
