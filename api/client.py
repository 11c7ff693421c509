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
    `Authorization: Bearer` (which stays out of proxy logs). `affinity`: a key
    sent as X-Snapshot-Affinity with every request, so that a load balancer in
    front of a fleet (deploy/haproxy.cfg) sends a session's requests to the
    server that holds its state live. `retry_s`: how long a cell whose answer
    was cut (the server lost, a proxy's 502/503/504) is sent again with its
    exec_id (docs/fleet.md): the server answers a committed one from the store.
    """

    def __init__(self, url, token=None, timeout=60, token_in_query=False, affinity=None,
                 retry_s=60):
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
        self.affinity = affinity
        self.retry_s = retry_s
        self.server = None  # X-Snapshot-Server of the last answer (which server gave it)
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
        # Quoted: a header is latin-1, a notebook's path or a session's name need not be.
        headers = {"X-Snapshot-Affinity": urllib.parse.quote(self.affinity, safe="")} \
            if self.affinity else {}
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
            self.server = response.getheader("X-Snapshot-Server")
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

    def retried(self, request):
        """request(), sent again while its answer is cut by the loss of a server, for
        up to retry_s: a request that carries an exec_id, which makes it safe to repeat
        (an /execute that committed is answered from the store, never run twice).
        One that is still running where it was sent (409 "already running") is waited
        for. Any other error is raised at once."""
        deadline = time.monotonic() + self.retry_s
        cut = False
        while True:
            try:
                return request()
            except ServerError as exc:
                running = cut and exc.status == 409 and "already running" in str(exc)
                # A first try refused sent nothing: no server there, said at once.
                again = is_cut(exc) and (cut or not exc.refused) or running
                if not again or time.monotonic() > deadline:
                    raise
                cut = True
            self.close()
            time.sleep(_RETRY_PAUSE_S)

    def execute(self, code, exec_id, state, new_name=None, timeout=0, cwd=None):
        """POST /execute: the answer (no bound on the cell's time by default); sent
        again with its exec_id when the answer is cut (see retried)."""
        body = {"code": code, "exec_id": exec_id, "state_name": state}
        if new_name is not None:
            body["new_state_name"] = new_name
        if cwd is not None:
            body["cwd"] = cwd
        return self.retried(lambda: self.call("POST", "/execute", body, timeout))

    def execute_streamed(self, code, exec_id, state, new_name=None, cwd=None,
                         message_id=None, execution_count=None):
        """POST /execute with "stream": true: an iterator of its events,
        {"type": "output"|"clear_output", ...} as the cell makes them, then
        {"type": "answer", "answer": {...}}. `cwd`: the notebook's folder;
        `message_id`: the Jupyter message the cell answers; `execution_count`: its In[N]."""
        body = {"code": code, "exec_id": exec_id, "state_name": state, "stream": True}
        if new_name is not None:
            body["new_state_name"] = new_name
        if cwd is not None:
            body["cwd"] = cwd
        if message_id is not None:
            body["message_id"] = message_id
        if execution_count is not None:
            body["execution_count"] = execution_count
        return self.retried_events("/execute", body)

    def retried_events(self, path, body):
        """events(path, body), sent again (see retried) when the stream is cut before its
        answer; the events of the retry follow a {"type": "clear_output"} when some of
        the first try's were given: the retry's outputs replace them. The first request
        is sent before this returns, as events() does: a server that is not there raises
        here (the Jupyter kernel then starts its own again)."""
        return self._resumed(self.retried(lambda: self.events(path, body)), path, body)

    def _resumed(self, events, path, body):
        """The events of `events`, then of a retry for each cut (retried_events)."""
        given = False
        while True:
            try:
                for event in events:
                    given = True
                    yield event
                return
            except ServerError as exc:
                if not is_cut(exc):
                    raise
            events = self.retried(lambda: self.events(path, body))
            if given:
                yield {"type": "clear_output", "wait": False}

    def evaluate(self, code, state, exec_id, timeout=None):
        """Run `code` on `state` and store nothing (/multistate_execute): the answer."""
        return self.call("POST", "/multistate_execute",
                         {"code": code, "exec_id": exec_id, "state_mapping": {},
                          "default_state": state}, timeout)

    def run_notebook(self, request):
        """POST /notebooks/run with "stream": true: an iterator of its events,
        {"type": "cell", "cell": {...}} as each cell's status changes, then
        {"type": "answer", "answer": {...}} (the run's record). Sent again when cut
        (see retried_events): cells that ran are reused by their keys."""
        return self.retried_events("/notebooks/run", dict(request, stream=True))

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


# Seconds between two tries of a cut request: HAProxy's check (inter 1s fall 2) takes a
# lost server out of the pool within 2 s; a refused connection is sent elsewhere at once.
_RETRY_PAUSE_S = 0.5
# Statuses a proxy answers for a server lost under a request (HAProxy: 502 when the
# server closed without an answer, 503 when none is up, 504 past timeout server), and
# ours while stopping (503 ServerStopping).
_CUT_STATUSES = (502, 503, 504)


def is_cut(exc):
    """True when ServerError `exc` says the answer was lost on the way, not refused:
    a connection reset or closed without an answer, or a proxy's or a stopping
    server's 502/503/504. A 503 RemoteUnavailable (the bucket down) is a refusal."""
    if exc.status is None:
        return exc.etype == "ServerUnreachable"
    return exc.status in _CUT_STATUSES and exc.etype != "RemoteUnavailable"


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
