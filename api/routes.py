"""The HTTP routes: the bottle app.

Each route authenticates, reads and checks its JSON body (validation.py,
against the schemas of openapi.py), calls the registry of states or the
notebook runner, and answers JSON; a domain error becomes the JSON error
with the status errors.py chooses. What the routes serve is a `Service`,
made on first use from the app's config, so that bottle's own command line
(`python -m bottle --server cheroot ... main:app`, which sets the config
with `--param`) serves the same app as `main.py serve` (api/server.py).
"""

import atexit
import functools
import hmac
import json
import logging
import os
import threading
import urllib.parse

import bottle

from snapkernel.api import guard, openapi
from snapkernel.api.errors import BadRequest, PayloadTooLarge, status_of
from snapkernel.api.validation import check_body, check_state_name
from snapkernel.kernel import config as config_mod
from snapkernel.kernel import trace
from snapkernel.kernel.errors import ServerStopping
from snapkernel.kernel.notebook.model import STATE_KINDS, NotebookRequest, is_notebook_state
from snapkernel.kernel.relay import ERROR, EVENT, Relay
from snapkernel.kernel.server.registry import Registry
from snapkernel.storage.store import claim_store

app = bottle.Bottle()
log = logging.getLogger("snapshot_kernel")


class Service:
    """The settings, the registry of states and the notebook runner the routes use,
    each made on first use (a server start need not wait for the notebook
    machinery)."""

    def __init__(self, config):
        """Serve with bottle's `config` (token, no_auth, data_dir, config)."""
        self.config = config
        self.lock = threading.Lock()
        self._settings = self._registry = self._notebooks = None
        self.store_lock = None  # the store's server lock, held while the registry lives
        self.server_id = None  # this server's name in a fleet (api/server.py serve)
        self.draining = False  # stopping: /health says so, requests are still served

    @property
    def settings(self):
        """The configuration in force."""
        if self._settings is None:
            overrides = {}
            if self.config.get("data_dir"):
                overrides["server.data_dir"] = os.path.abspath(self.config["data_dir"])
            self._settings = config_mod.load(self.config.get("config"), overrides)
        return self._settings

    def use(self, settings):
        """Serve with `settings` (the command line's) rather than the app's config."""
        self._settings = settings

    def start(self, holder, pool=None):
        """Claim the store (`holder` says who holds it, to whoever is refused it) and
        open the registry (on `pool`, if started already: see Registry); StoreError if
        another process holds the store."""
        with self.lock:
            if self._registry is None:
                self.store_lock = claim_store(self.settings["server.data_dir"], holder)
                self._registry = Registry(self.settings, pool=pool)
                atexit.register(self.close)
            return self._registry

    @property
    def registry(self):
        """The registry of states, started on first use (bottle's command line)."""
        return self._registry or self.start(f"a server run by bottle (pid {os.getpid()})")

    @property
    def notebooks(self):
        """The incremental notebook runner, made on first use."""
        registry = self.registry
        with self.lock:
            if self._notebooks is None:
                # Imported on first use: a server start need not wait for it.
                from snapkernel.kernel.notebook.incremental import NotebookRunner
                self._notebooks = NotebookRunner(registry)
            return self._notebooks

    @property
    def stopping(self):
        """Whether the server is stopping: its registry is closed."""
        return self._registry is not None and self._registry.closed

    def close(self):
        """Stop the workers (a request waiting on one then ends at once)."""
        if self._registry is not None:
            self._registry.close()


service = Service(app.config)


# Requests and answers --------------------------------------------------------------

def _token_ok():
    """True if the request carries the server's token (compared in constant time)."""
    expected = app.config.get("token")
    if app.config.get("no_auth"):
        return True
    if not expected:
        return False
    given = bottle.request.query.get("token")
    # The raw header (WSGI's latin-1 string): bottle's UTF-8 decoding of it raises on bad bytes.
    header = bottle.request.environ.get("HTTP_AUTHORIZATION", "")
    if header.startswith("Bearer "):
        given = header[len("Bearer "):].encode("latin-1").decode("utf-8", "surrogateescape")
    return given is not None and hmac.compare_digest(
        given.encode("utf-8", "surrogateescape"), expected.encode())


def _json_response(status, payload):
    """A JSON HTTP response."""
    return bottle.HTTPResponse(status=status, body=json.dumps(payload),
                               headers={"Content-Type": "application/json"})


def _error_response(status, etype, message):
    """The JSON error every failure is answered with."""
    return _json_response(status, {"error": {"type": etype, "message": message}})


class NDJSON:
    """A streamed answer: its lines (dicts), sent as application/x-ndjson."""

    def __init__(self, lines):
        """Wrap an iterator of JSON-able lines."""
        self.lines = lines


def _refusal():
    """The error answer refusing a request a web page may have sent (a foreign Host or
    Origin: api/guard.py), or one whose body is not JSON; None when it may go on."""
    settings = service.settings
    message = guard.refusal(bottle.request.environ, app.config.get("bind_host"),
                            settings["server.allowed_hosts"],
                            settings["server.allowed_origins"])
    if message is not None:
        return _error_response(403, "Forbidden", message)
    # A plain HTML form or a no-cors fetch can send text/plain, never application/json.
    sent = bottle.request.content_length > 0 or "chunked" in \
        bottle.request.environ.get("HTTP_TRANSFER_ENCODING", "").lower()
    kind = bottle.request.content_type.split(";", 1)[0].strip().lower()
    if sent and kind != "application/json":
        return _error_response(415, "UnsupportedMediaType",
                               f"the body must be sent as Content-Type: application/json, "
                               f"not {kind or 'none'!r}")
    return None


def route(method, path, auth=True):
    """Register a JSON route: the web-page checks, auth, error mapping, JSON encoding."""
    def wrap(handler):
        """Wrap `handler`, whose return value becomes the JSON body."""
        @functools.wraps(handler)
        def run(*args, **kwargs):
            """Answer one request."""
            refused = _refusal()
            if refused is not None:
                return refused
            if auth and not _token_ok():
                return _error_response(401, "Unauthorized", "missing or invalid token")
            try:
                result = handler(*args, **kwargs)
            except Exception as exc:
                return _failure(exc, method, path)
            if isinstance(result, bottle.HTTPResponse):
                return result
            if isinstance(result, NDJSON):
                return bottle.HTTPResponse(
                    status=200, headers={"Content-Type": "application/x-ndjson"},
                    body=(json.dumps(line) + "\n" for line in result.lines))
            response = _json_response(200, result)
            trace.stamp("reply", bottle.request.environ.get("snapk.exec_id"))
            return response
        app.route(path, method, run)
        return run
    return wrap


def _failure(exc, method, path):
    """The JSON error answering `exc`."""
    found = status_of(exc)
    if found is None and service.stopping:
        # Whatever the request met once the store and workers closed under it.
        exc = ServerStopping()
        found = status_of(exc)
    if found is None:
        log.exception("internal error on %s %s", method, path)
        return _error_response(500, "InternalError", f"{type(exc).__name__}: {exc}")
    return _error_response(found[0], found[1], str(exc))


def body(path):
    """The request's JSON object, within max_body_mb, checked against `path`'s schema."""
    max_mb = service.settings["server.max_body_mb"]
    length = bottle.request.content_length
    if length > max_mb * 2 ** 20:
        raise PayloadTooLarge(f"the body is larger than max_body_mb ({max_mb} MiB)")
    raw = bottle.request.environ["wsgi.input"].read(length) if length > 0 else b""
    if not raw:
        raise BadRequest("the request needs a JSON object body")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRequest("the body is not UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    check_body(path, bottle.request.method, data)
    if "exec_id" in data:
        exec_id = bottle.request.environ["snapk.exec_id"] = str(data["exec_id"])
        trace.stamp("request", exec_id)
    return data


def answered(run, streamed, line=None):
    """The answer of `run(on_event)` (an object with `to_json()`): whole, or, when
    `streamed`, as NDJSON lines sent as the work produces them.

    `line(event)` turns each event `run` reports into its line (default: the
    event is the line, as a streamed cell's output items are). An error
    raised before the first line is answered as usual (JSON error, its
    status); one raised later ends the stream with an
    `{"type": "error", "error": {...}}` line.
    """
    if not streamed:
        return run(None).to_json()
    exec_id = bottle.request.environ.get("snapk.exec_id")
    work = Relay(lambda emit: run(
        emit if line is None else lambda event: emit(line(event))).to_json(), "stream")
    first = work.next()
    if first[0] == ERROR:
        raise first[1]

    def lines():
        """Every line up to the answer."""
        kind, value = first
        while kind == EVENT:
            yield value
            kind, value = work.next()
        if kind == ERROR:
            response = _failure(value, "POST", "stream")
            yield {"type": "error", "error": json.loads(response.body)["error"]}
            return
        yield {"type": "answer", "answer": value}
        trace.stamp("reply", exec_id)

    return NDJSON(lines())


def path_name(name, prefix="/states/", what="the state name"):
    """The state name of /states/NAME (or notebook name of /notebooks/NAME), decoded
    from the raw request path.

    The WSGI server leaves an encoded slash (%2F) encoded in the path, so a
    client that quotes `a/b` as `a%2Fb` would miss the state: decode the raw
    URI ourselves where the server gives it.
    """
    raw = bottle.request.environ.get("REQUEST_URI", "").split("?", 1)[0]
    if raw.startswith(prefix):
        # WSGI strings carry the raw bytes as latin-1; names are UTF-8.
        name = urllib.parse.unquote_to_bytes(raw[len(prefix):].encode("latin-1")).decode(
            "utf-8", "surrogateescape")
    return check_state_name(name, what)


def _cell_line(cell):
    """The line of a notebook run's cell whose status changed."""
    return {"type": "cell", "cell": cell.to_json()}


# The routes -----------------------------------------------------------------------

@route("POST", "/execute")
def execute():
    """Run a cell from a state."""
    data = body("/execute")
    return answered(lambda on_output: service.registry.execute(
        data["code"], data["exec_id"], data["state_name"],
        data.get("new_state_name"), on_output=on_output, cwd=data.get("cwd"),
        message_id=data.get("message_id"), execution_count=data.get("execution_count")),
        data.get("stream"))


@route("POST", "/multistate_execute")
def multistate_execute():
    """Run a cell with several states under aliases; nothing is stored."""
    data = body("/multistate_execute")
    return answered(lambda on_output: service.registry.multistate_execute(
        data["code"], data["exec_id"], data["state_mapping"],
        data.get("default_state"), on_output=on_output), data.get("stream"))


@route("GET", "/states")
def list_states():
    """Every state name (?kind=user: not those notebook runs made; ?kind=notebook: only
    those)."""
    kind = bottle.request.query.get("kind", "all")
    if kind not in STATE_KINDS:
        raise BadRequest(f"kind must be {', '.join(STATE_KINDS)}, not {kind!r}")
    names = service.registry.list_states()
    if kind != "all":
        names = [n for n in names if is_notebook_state(n) == (kind == "notebook")]
    return {"states": names}


@route("GET", "/states/<name:path>")
def get_state(name):
    """One state's variables and lineage."""
    return service.registry.describe(path_name(name))


@route("DELETE", "/states/<name:path>")
def delete_state(name):
    """Delete a state."""
    name = path_name(name)
    service.registry.delete(name)
    return {"deleted": name}


@route("POST", "/symbol_hashes")
def symbol_hashes():
    """Content hashes of variables, from the manifest."""
    data = body("/symbol_hashes")
    return {"hashes": service.registry.symbol_hashes(data["state_name"], data["symbols"],
                                                     data.get("hash_algo"))}


@route("POST", "/alias_groups")
def alias_groups():
    """Alias groups and fingerprints, from the manifest."""
    return service.registry.alias_groups(body("/alias_groups")["state_name"])


@route("POST", "/rebuild_state")
def rebuild_state():
    """Build a state from two others' variables without running code."""
    data = body("/rebuild_state")
    return service.registry.rebuild(data["input_state"], data["source_state"],
                                    data["source_vars"], data["input_vars"],
                                    data.get("new_state_name"))


@route("POST", "/reset")
def reset():
    """Drop every state, stored result and notebook record; `initial` remains."""
    service.registry.reset()
    service.notebooks.clear()
    return {"status": "ok"}


@route("POST", "/interrupt")
def interrupt():
    """Interrupt a running execution, or a notebook run and its running cell."""
    wanted = body("/interrupt")["exec_id"]
    return {"interrupted": service.notebooks.interrupt(wanted)
            or service.registry.interrupt(wanted)}


@route("POST", "/notebooks/run")
def run_notebook():
    """Bring every cell of a notebook up to date, running only what could have changed;
    with "fresh": true, run every cell from scratch in a new interpreter, with a receipt."""
    data = body("/notebooks/run")
    request = NotebookRequest.from_json(data)
    if request.fresh is not None:
        from snapkernel.kernel.notebook import fresh
        return answered(lambda on_cell: fresh.run_request(request, service.settings, on_cell),
                        data.get("stream"), _cell_line)
    return answered(lambda on_cell: service.notebooks.run(request, on_cell),
                    data.get("stream"), _cell_line)


@route("GET", "/notebooks")
def list_notebooks():
    """Every notebook with a record."""
    return {"notebooks": service.notebooks.names()}


@route("GET", "/notebooks/<name:path>")
def get_notebook(name):
    """A notebook's last run (or the one in progress), cell by cell."""
    return service.notebooks.get(path_name(name, "/notebooks/", "the notebook name")).to_json()


@route("DELETE", "/notebooks/<name:path>")
def delete_notebook(name):
    """Forget a notebook's record (the results stay, shared with other notebooks)."""
    name = path_name(name, "/notebooks/", "the notebook name")
    service.notebooks.delete(name)
    return {"deleted": name}


@route("GET", "/openapi.json")
def openapi_document():
    """The OpenAPI 3 document of every route (with the token, like all but /health)."""
    return openapi.document()


@route("GET", "/health", auth=False)
def health():
    """Liveness, without a token, and which server answered; 503 while the server drains
    (a load balancer then sends it nothing new)."""
    if service.draining:
        return _json_response(503, {"status": "draining", "server": _identity()})
    return {"status": "ok", "server": _identity()}


def _identity():
    """{id, pid} of this server."""
    return {"id": service.server_id, "pid": os.getpid()}


def named(wsgi_app):
    """`wsgi_app` whose every answer (errors, bottle's own 404s included) carries the
    header X-Snapshot-Server: this server's id, so a client behind a load balancer sees
    where it was routed."""
    def serve(environ, start_response):
        """Answer with the header added."""
        def start(status, headers, exc_info=None):
            """start_response, with our header."""
            return start_response(status, headers + [("X-Snapshot-Server", service.server_id)],
                                  exc_info)
        return wsgi_app(environ, start)
    return serve


@app.error(404)
@app.error(405)
@app.error(413)
@app.error(500)
def http_error(err):
    """Bottle's own errors (unknown route, wrong method) as JSON, never HTML."""
    bottle.response.content_type = "application/json"
    kind = {404: "NotFound", 405: "MethodNotAllowed", 413: "PayloadTooLarge"}.get(
        err.status_code, "InternalError")
    return json.dumps({"error": {"type": kind, "message": str(err.body)}})
