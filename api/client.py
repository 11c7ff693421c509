"""The client of this server's HTTP API: the `run --server` command, the Jupyter
kernel and the scripts all talk to a server through it.

Standard library only (http.client), so a script needs nothing the server
does not. Each thread keeps its own keep-alive connection: one thread may
wait on a long cell while another sends its interrupt. A connection the
server closed while idle is opened again once, transparently.
"""

import http.client
import json
import socket
import ssl
import threading
import time
import urllib.parse


class ServerError(Exception):
    """The server refused a request (its JSON error) or could not be reached.

    `etype` is the JSON error's type (or ServerUnreachable, ServerTimeout,
    ...); `status` the HTTP status (None without an answer); `refused` is
    True when no connection could be made at all (nothing was sent).
    """

    def __init__(self, message, etype="ServerError", status=None, refused=False):
        """Keep what the answer said."""
        super().__init__(message)
        self.etype = etype
        self.status = status
        self.refused = refused


class Client:
    """Requests to one server, with its token.

    `timeout`: seconds to connect, and to wait for a short request's answer
    (a cell's run has none). `token_in_query`: send the token as `?token=`
    (the only form the reference server reads) rather than as
    `Authorization: Bearer` (which stays out of proxy logs).
    """

    def __init__(self, url, token=None, timeout=60, token_in_query=False):
        """Talk to the server at `url` (http:// or https://)."""
        self.url = url.rstrip("/")
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http:// or https:// address: {url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path
        self.token = token
        self.timeout = timeout
        self._token_in_query = token_in_query
        self._local = threading.local()

    # Connections -------------------------------------------------------------------

    def _connection(self):
        """This thread's connection, opened if it has none."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._https:
                conn = http.client.HTTPSConnection(self._host, self._port, timeout=self.timeout,
                                                   context=ssl.create_default_context())
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
            try:
                conn.connect()
            except OSError as exc:
                conn.close()
                raise ServerError(f"cannot reach the server at {self.url}: {exc}",
                                  "ServerUnreachable", refused=True) from None
            # Small requests go out at once: no Nagle delay waiting for more bytes.
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn = conn
        return conn

    def close(self):
        """Close this thread's connection (the next request opens another)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def times(self):
        """(sent, answered): the time.monotonic() of this thread's last request and of
        the end of its answer's headers."""
        return self._local.times

    # Requests ----------------------------------------------------------------------

    def send(self, method, path, body=None, timeout=None):
        """Send one request; the http.client response, its headers read.

        `timeout` bounds the wait for the answer (None: the client's; 0: no
        bound, for a cell). The caller reads the body; the connection is
        reused once it has.
        """
        target = self._prefix + path
        headers = {}
        if self.token:
            if self._token_in_query:
                target += ("&" if "?" in target else "?") + urllib.parse.urlencode(
                    {"token": self.token})
            else:
                headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        for attempt in (0, 1):
            conn = self._connection()
            conn.sock.settimeout(None if timeout == 0 else timeout or self.timeout)
            sent = time.monotonic()
            try:
                conn.request(method, target, data, headers)
                response = conn.getresponse()
            except TimeoutError:
                self.close()
                raise ServerError(f"the server at {self.url} did not answer {method} {path} "
                                  f"in time", "ServerTimeout") from None
            except (ConnectionError, http.client.HTTPException, OSError) as exc:
                self.close()
                # A keep-alive connection the server closed while idle fails on reuse:
                # open another once. Only a fresh connection's failure is the server's.
                if attempt == 0 and isinstance(exc, (ConnectionError,
                                                     http.client.RemoteDisconnected)):
                    continue
                raise ServerError(f"the server at {self.url} stopped answering: {exc}",
                                  "ServerUnreachable") from None
            self._local.times = (sent, time.monotonic())
            return response
        raise AssertionError("unreachable")

    def call(self, method, path, body=None, timeout=None):
        """The JSON answer of one request; ServerError for an error answer."""
        response = self.send(method, path, body, timeout)
        try:
            raw = response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise ServerError(f"the server at {self.url} stopped answering: {exc}",
                              "ServerUnreachable") from None
        return _decode(response, raw, path)

    def events(self, path, body, timeout=None):
        """The events of a streamed answer (NDJSON lines), up to its last.

        An error answer before the stream began raises ServerError, as does an
        error line after it (the stream ends there). `timeout` bounds only the
        wait for the answer's start (None: the client's); lines may then come
        as slowly as the cells make them. The request is sent before this
        returns, so a server that is not there raises here.
        """
        response = self.send("POST", path, body, timeout)
        if response.status != 200:
            _decode(response, response.read(), path)
        if not response.getheader("Content-Type", "").startswith("application/x-ndjson"):
            response.read()
            raise ServerError(f"the server at {self.url} does not stream its answers "
                              f"(\"stream\": true): it is older than this client",
                              "ServerTooOld", response.status)
        self._connection().sock.settimeout(None)
        return self._lines(response)

    def _lines(self, response):
        """Decoded NDJSON lines of `response`."""
        try:
            for line in response:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "error":
                    raise ServerError(event["error"]["message"], event["error"]["type"], 200)
                yield event
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.close()
            raise ServerError(f"the server at {self.url} stopped answering while the request "
                              f"ran: {exc}", "ServerUnreachable") from None
        finally:
            response.close()

    # The API -----------------------------------------------------------------------

    def execute(self, code, exec_id, state, new_name=None, timeout=0):
        """POST /execute: the answer (no bound on the cell's time by default)."""
        body = {"code": code, "exec_id": exec_id, "state_name": state}
        if new_name is not None:
            body["new_state_name"] = new_name
        return self.call("POST", "/execute", body, timeout)

    def execute_streamed(self, code, exec_id, state, new_name=None, cwd=None,
                         message_id=None):
        """POST /execute with "stream": true: an iterator of its events,
        {"type": "output"|"clear_output", ...} as the cell makes them, then
        {"type": "answer", "answer": {...}}. `cwd`: the notebook's folder;
        `message_id`: the Jupyter message the cell answers."""
        body = {"code": code, "exec_id": exec_id, "state_name": state, "stream": True}
        if new_name is not None:
            body["new_state_name"] = new_name
        if cwd is not None:
            body["cwd"] = cwd
        if message_id is not None:
            body["message_id"] = message_id
        return self.events("/execute", body)

    def evaluate(self, code, state, exec_id, timeout=None):
        """Run `code` on `state` and store nothing (/multistate_execute): the answer."""
        return self.call("POST", "/multistate_execute",
                         {"code": code, "exec_id": exec_id, "state_mapping": {},
                          "default_state": state}, timeout)

    def run_notebook(self, request):
        """POST /notebooks/run with "stream": true: an iterator of its events,
        {"type": "cell", "cell": {...}} as each cell's status changes, then
        {"type": "answer", "answer": {...}} (the run's record)."""
        return self.events("/notebooks/run", dict(request, stream=True))

    def describe(self, name):
        """GET /states/NAME, or None when there is no such state."""
        try:
            return self.call("GET", "/states/" + urllib.parse.quote(name, safe=""))
        except ServerError as exc:
            if exc.etype == "StateNotFound":
                return None
            raise

    def interrupt(self, exec_id):
        """Stop the cell or notebook run `exec_id`; True when there was one."""
        return self.call("POST", "/interrupt", {"exec_id": exec_id})["interrupted"]

    def healthy(self):
        """True when the server answers with this token."""
        try:
            self.call("GET", "/states/initial")
            return True
        except ServerError:
            return False


def _decode(response, raw, path):
    """The JSON of an answer; ServerError for an error status or a body that is not
    JSON."""
    if response.status == 200:
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise ServerError(f"HTTP 200 on {path} with a body that is not JSON: "
                              f"{raw[:300]!r}", "NotJSON", 200) from None
    try:
        error = json.loads(raw)["error"]
        message, etype = error["message"], error["type"]
    except (ValueError, KeyError, TypeError):
        message, etype = f"HTTP {response.status} on {path}: {raw[:300]!r}", "ServerError"
    raise ServerError(message, etype, response.status)
