"""The kernel's HTTP client of the snapshot server.

Each thread gets its own keep-alive connection: the shell thread may wait
on a long cell while the control thread sends its interrupt.
"""

import json
import threading

import requests


class ServerError(Exception):
    """The server refused a request (its JSON error) or could not be reached."""

    def __init__(self, message, etype="ServerError", refused=False):
        """Keep the error type; `refused` when no connection could be made at all."""
        super().__init__(message)
        self.etype = etype
        self.refused = refused


class Client:
    """Requests to one server, authenticated with its token."""

    def __init__(self, url, token, timeout):
        """`timeout`: seconds a short request may take (a cell's run has none)."""
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._local = threading.local()

    def _session(self):
        """This thread's HTTP session."""
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers["Authorization"] = f"Bearer {self.token}"
        return session

    def _request(self, method, path, body=None, timeout=None, stream=False):
        """The response to one request, or ServerError for no answer or an error answer."""
        try:
            response = self._session().request(method, self.url + path, json=body, stream=stream,
                                               timeout=timeout or self.timeout)
        except requests.ConnectionError as exc:
            raise ServerError(f"no answer from the snapshot server at {self.url}: {exc}",
                              "ServerUnreachable", refused=_refused(exc)) from None
        except requests.Timeout:
            raise ServerError(f"the snapshot server at {self.url} did not answer {path} in "
                              f"time", "ServerTimeout") from None
        if response.status_code != 200:
            try:
                error = response.json()["error"]
                raise ServerError(error["message"], error["type"])
            except (ValueError, KeyError, TypeError):
                raise ServerError(f"HTTP {response.status_code} on {path}: "
                                  f"{response.text[:300]}") from None
        return response

    def call(self, method, path, body=None, timeout=None):
        """The JSON answer of a short request."""
        return self._request(method, path, body, timeout).json()

    def execute(self, code, exec_id, state, new_name):
        """Run a cell from `state` into `new_name`: an iterator of its events.

        Events are the NDJSON lines of a streamed /execute, as the server sends
        them: {"type": "output", "output": {...}}, {"type": "clear_output",
        "wait": bool}, and last {"type": "answer", "answer": {...}}; an error
        line raises ServerError. The request is sent before this returns, so a
        server that is not there raises here.
        """
        body = {"code": code, "exec_id": exec_id, "state_name": state,
                "new_state_name": new_name, "stream": True}
        # A cell may run for hours: only the connection has a deadline.
        response = self._request("POST", "/execute", body, timeout=(self.timeout, None),
                                 stream=True)
        return self._events(response)

    def _events(self, response):
        """The events of a streamed /execute answer, up to its answer."""
        with response:
            if not response.headers.get("Content-Type", "").startswith("application/x-ndjson"):
                raise ServerError(f"the server at {self.url} does not stream its answers "
                                  f"(\"stream\": true): it is older than this kernel",
                                  "ServerTooOld")
            try:
                for line in response.iter_lines(chunk_size=None):
                    event = json.loads(line) if line else {}
                    if event.get("type") == "error":
                        # The server failed after the cell began: the stream ends here.
                        raise ServerError(event["error"]["message"], event["error"]["type"])
                    if event:
                        yield event
            except requests.RequestException as exc:
                raise ServerError(f"the snapshot server at {self.url} stopped answering "
                                  f"while the cell ran: {exc}", "ServerUnreachable") from None

    def evaluate(self, code, state, exec_id, timeout=None):
        """Run `code` on `state` and store nothing (/multistate_execute): the answer."""
        return self.call("POST", "/multistate_execute",
                         {"code": code, "exec_id": exec_id, "state_mapping": {},
                          "default_state": state}, timeout)

    def describe(self, name):
        """GET /states/NAME, or None when there is no such state."""
        try:
            return self.call("GET", "/states/" + requests.utils.quote(name, safe=""))
        except ServerError as exc:
            if exc.etype == "StateNotFound":
                return None
            raise

    def interrupt(self, exec_id):
        """Stop the cell running as `exec_id`; True when there was one."""
        return self.call("POST", "/interrupt", {"exec_id": exec_id})["interrupted"]

    def healthy(self):
        """True when the server answers with this token."""
        try:
            self.call("GET", "/states/initial")
            return True
        except ServerError:
            return False


def _refused(exc):
    """True when a ConnectionError means no connection was made (nothing was sent)."""
    reason = getattr(exc.args[0] if exc.args else None, "reason", None)
    return isinstance(reason, requests.packages.urllib3.exceptions.NewConnectionError)
