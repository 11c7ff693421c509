"""Command line and HTTP routes of the snapshot kernel server.

Parse, authenticate, call the kernel, answer JSON. Run it as
`python main.py --bind HOST:PORT --token TOKEN`, or through bottle's own
command line as `python -m bottle --server cheroot --bind HOST:PORT
--param token=TOKEN main:app` (bottle has no --token flag; --param puts
the token into the app's config, where it is read from).
"""

import argparse
import atexit
import functools
import hmac
import ipaddress
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import urllib.parse

import bottle

from api import openapi
from api.errors import BadRequest, PayloadTooLarge, status_of
from api.validation import check_body, check_state_name
from kernel import config as config_mod
from kernel import trace
from kernel.errors import InvalidRequest
from kernel.server.registry import Registry
from storage.store import StoreError, try_server_lock

app = bottle.Bottle()
log = logging.getLogger("snapshot_kernel")

_kernel = None
_runner = None
_kernel_lock = threading.Lock()
_settings = None


def lock_store(data_dir):
    """The store's server lock (one server per store), or StoreError naming the folder
    and, as the lock file says, who holds it."""
    os.makedirs(data_dir, exist_ok=True)
    lock = try_server_lock(data_dir)
    if lock is None:
        holder = lock_holder(data_dir)
        raise StoreError(f"another server is already using the store at {data_dir}"
                         f"{f' ({holder})' if holder else ''}; stop it or choose another "
                         f"--data-dir")
    return lock


def note_holder(lock, text):
    """Say in the held lock file who holds it (read when someone else is refused)."""
    lock.seek(0)
    lock.truncate()
    lock.write(text)
    lock.flush()


def lock_holder(data_dir):
    """Who holds the store's lock, as its holder wrote it ("" if it did not)."""
    try:
        with open(os.path.join(data_dir, "server.lock")) as f:
            return f.read().strip()
    except OSError:
        return ""


def settings():
    """The configuration in force (the bottle CLI form reads it from app.config)."""
    global _settings
    if _settings is None:
        overrides = {}
        if app.config.get("data_dir"):
            overrides["server.data_dir"] = os.path.abspath(app.config["data_dir"])
        _settings = config_mod.load(app.config.get("config"), overrides)
    return _settings


def get_kernel():
    """The registry of states, started on first use (so `main:app` works under bottle's CLI)."""
    global _kernel
    with _kernel_lock:
        if _kernel is None:
            s = settings()
            app.config["server_lock"] = lock_store(s["server.data_dir"])
            _kernel = Registry(s)
            atexit.register(_kernel.close)
        return _kernel


def get_runner():
    """The notebook runner on the kernel, made on first use."""
    global _runner
    kernel = get_kernel()
    with _kernel_lock:
        if _runner is None:
            # Imported on first use: a server start need not wait for it.
            from kernel.notebook.runner import Runner
            _runner = Runner(kernel)
        return _runner


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


def route(method, path, auth=True):
    """Register a JSON route: auth, error mapping, JSON encoding."""
    def wrap(handler):
        """Wrap `handler`, whose return value becomes the JSON body."""
        @functools.wraps(handler)
        def run(*args, **kwargs):
            """Answer one request."""
            if auth and not _token_ok():
                return _error_response(401, "Unauthorized", "missing or invalid token")
            try:
                result = handler(*args, **kwargs)
            except Exception as exc:
                return _failure(exc, method, path)
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
    if found is None:
        log.exception("internal error on %s %s", method, path)
        return _error_response(500, "InternalError", f"{type(exc).__name__}: {exc}")
    return _error_response(found[0], found[1], str(exc))


def body(path):
    """The request's JSON object, within max_body_mb, checked against `path`'s schema."""
    limit = settings()["server.max_body_mb"] * 2 ** 20
    length = bottle.request.content_length
    if length > limit:
        raise PayloadTooLarge(f"the body is larger than max_body_mb "
                              f"({settings()['server.max_body_mb']} MiB)")
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


def streamed(run):
    """The answer of `run(on_output)` as NDJSON lines, sent as the cell produces them.

    An error raised before the cell produced anything is answered as usual
    (JSON error, its status); one raised later ends the stream with an
    `{"type": "error", "error": {...}}` line.
    """
    events = queue.Queue()
    exec_id = bottle.request.environ.get("snapk.exec_id")

    def work():
        """Run the request in a thread of its own, feeding `events`."""
        try:
            events.put({"type": "answer",
                        "answer": run(lambda item: events.put(item)).to_json()})
        except Exception as exc:
            events.put(exc)

    threading.Thread(target=work, name="stream", daemon=True).start()
    first = events.get()
    if isinstance(first, Exception):
        raise first

    def lines():
        """Every line up to the answer."""
        event = first
        while True:
            if isinstance(event, Exception):
                response = _failure(event, "POST", "stream")
                yield {"type": "error", "error": json.loads(response.body)["error"]}
                return
            yield event
            if event.get("type") == "answer":
                trace.stamp("reply", exec_id)
                return
            event = events.get()

    return NDJSON(lines())


@route("POST", "/execute")
def execute():
    """Run a cell from a state."""
    data = body("/execute")
    run = functools.partial(get_kernel().execute, data.get("code") or "", data["exec_id"],
                            data["state_name"], data.get("new_state_name"))
    if data.get("stream"):
        return streamed(lambda on_output: run(on_output=on_output))
    return run().to_json()


@route("POST", "/multistate_execute")
def multistate_execute():
    """Run a cell with several states under aliases; nothing is stored."""
    data = body("/multistate_execute")
    run = functools.partial(get_kernel().multistate_execute, data.get("code") or "",
                            data["exec_id"], data["state_mapping"], data.get("default_state"))
    if data.get("stream"):
        return streamed(lambda on_output: run(on_output=on_output))
    return run().to_json()


@route("GET", "/states")
def list_states():
    """Every state name."""
    return {"states": get_kernel().list_states()}


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


@route("GET", "/states/<name:path>")
def get_state(name):
    """One state's variables and lineage."""
    return get_kernel().describe(path_name(name))


@route("DELETE", "/states/<name:path>")
def delete_state(name):
    """Delete a state."""
    name = path_name(name)
    get_kernel().delete(name)
    return {"deleted": name}


@route("POST", "/symbol_hashes")
def symbol_hashes():
    """Content hashes of variables, from the manifest."""
    data = body("/symbol_hashes")
    return {"hashes": get_kernel().symbol_hashes(data["state_name"], data["symbols"],
                                                 data.get("hash_algo"))}


@route("POST", "/alias_groups")
def alias_groups():
    """Alias groups and fingerprints, from the manifest."""
    return get_kernel().alias_groups(body("/alias_groups")["state_name"])


@route("POST", "/rebuild_state")
def rebuild_state():
    """Build a state from two others' variables without running code."""
    data = body("/rebuild_state")
    return get_kernel().rebuild(data["input_state"], data["source_state"],
                                data["source_vars"], data["input_vars"],
                                data.get("new_state_name"))


@route("POST", "/reset")
def reset():
    """Drop every state, stored result and notebook record; `initial` remains."""
    get_kernel().reset()
    get_runner().clear()
    return {"status": "ok"}


@route("POST", "/interrupt")
def interrupt():
    """Interrupt a running execution, or a notebook run and its running cell."""
    wanted = body("/interrupt")["exec_id"]
    return {"interrupted": get_runner().interrupt(wanted) or get_kernel().interrupt(wanted)}


# The options of POST /notebooks/run that only a fresh run takes.
FRESH_OPTIONS = ("timeout", "cell_timeout", "env", "cwd", "expected_environment")


@route("POST", "/notebooks/run")
def run_notebook():
    """Bring every cell of a notebook up to date, running only what could have changed;
    with "fresh": true, run every cell from scratch in a new interpreter, with a receipt."""
    data = body("/notebooks/run")
    if data.get("fresh"):
        incremental = [k for k in ("order", "rerun", "exec_id") if data.get(k) is not None]
        if incremental:
            raise BadRequest(f"{', '.join(incremental)}: not for a fresh run")
        from kernel.notebook import fresh_request
        return fresh_request.run_request(data, settings())
    fresh_only = [k for k in FRESH_OPTIONS if data.get(k) is not None]
    if fresh_only:
        raise BadRequest(f'{", ".join(fresh_only)}: only for a fresh run ("fresh": true)')
    return get_runner().run(data["notebook"], data["cells"], data.get("order") or "notebook",
                            data.get("rerun") or [], data.get("exec_id"))


@route("GET", "/notebooks")
def list_notebooks():
    """Every notebook with a record."""
    return {"notebooks": get_runner().names()}


@route("GET", "/notebooks/<name:path>")
def get_notebook(name):
    """A notebook's last run (or the one in progress), cell by cell."""
    return get_runner().get(path_name(name, "/notebooks/", "the notebook name"))


@route("DELETE", "/notebooks/<name:path>")
def delete_notebook(name):
    """Forget a notebook's record (the results stay, shared with other notebooks)."""
    name = path_name(name, "/notebooks/", "the notebook name")
    get_runner().delete(name)
    return {"deleted": name}


@route("GET", "/openapi.json")
def openapi_document():
    """The OpenAPI 3 document of every route (with the token, like all but /health)."""
    return openapi.document()


@route("GET", "/health", auth=False)
def health():
    """Liveness, without a token."""
    return {"status": "ok"}


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


def _is_loopback(host):
    """True for a loopback bind address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_args(argv):
    """The command line."""
    p = argparse.ArgumentParser(description="Snapshot kernel server")
    p.add_argument("--bind", default="127.0.0.1:8080", help="HOST:PORT (default %(default)s)")
    p.add_argument("--token", default=os.environ.get("SNAPSHOT_KERNEL_TOKEN"),
                   help="secret token every request must carry (or SNAPSHOT_KERNEL_TOKEN)")
    p.add_argument("--no-auth", action="store_true",
                   help="serve without a token (loopback binds only)")
    p.add_argument("--data-dir", help="folder of the state store (default: config.toml)")
    p.add_argument("--config", help="a TOML file overriding config.toml")
    p.add_argument("--display-max-rows", type=int, help="pandas display.max_rows")
    p.add_argument("--display-max-columns", type=int, help="pandas display.max_columns")
    p.add_argument("--display-max-colwidth", type=int, help="pandas display.max_colwidth")
    p.add_argument("--verbose", action="store_true", help="log to stderr")
    return p.parse_args(argv)


def main(argv=None):
    """Start the server (or, with `run` first, run a notebook; with `install-kernelspec`,
    install the Jupyter kernel); SIGTERM or Ctrl-C stop it."""
    global _settings
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        sys.exit(run_command(argv[1:]))
    if argv[:1] == ["install-kernelspec"]:
        from kernel.jupyter.kernelspec import main as install_kernelspec
        return install_kernelspec(argv[1:])
    args = parse_args(argv)
    # Workers inherit the environment: cells must not find the token there.
    os.environ.pop("SNAPSHOT_KERNEL_TOKEN", None)
    host, _, port = args.bind.rpartition(":")
    if not host or not port.isdigit():
        sys.exit(f"error: --bind must be HOST:PORT, not {args.bind!r}")
    if not args.token and not (args.no_auth and _is_loopback(host)):
        sys.exit("error: no token: pass --token or set SNAPSHOT_KERNEL_TOKEN "
                 "(--no-auth is allowed only on a loopback address)")
    overrides = {}
    if args.data_dir:
        overrides["server.data_dir"] = os.path.abspath(args.data_dir)
    for flag in ("rows", "columns", "colwidth"):
        value = getattr(args, f"display_max_{flag}")
        if value is not None:
            overrides[f"display.max_{flag}"] = value
    try:
        _settings = config_mod.load(args.config, overrides)
    except config_mod.ConfigError as exc:
        sys.exit(f"error: {exc}")
    _setup_logging(_settings["server.log_file"], args.verbose)
    app.config["token"] = args.token
    app.config["no_auth"] = args.no_auth and not args.token
    try:
        damaged = get_kernel().damaged
    except StoreError as exc:
        sys.exit(f"error: {exc}")
    if damaged:
        # Said once, before serving: while it serves, the server writes nothing on stderr.
        print(f"warning: {len(damaged)} state(s) left out, their manifests damaged: "
              f"{'; '.join(map(str, damaged[:3]))}{'; ...' if len(damaged) > 3 else ''}. "
              f"scripts/check_store.py lists what is damaged", file=sys.stderr, flush=True)
    scheme = "https" if _settings["server.certfile"] else "http"
    note_holder(app.config["server_lock"], f"a server at {scheme}://{args.bind} "
                                           f"(pid {os.getpid()})")
    serve(host.strip("[]"), int(port), _settings)


# The `run` command ------------------------------------------------------------------

def parse_run_args(argv):
    """The command line of `main.py run`; argparse exits with status 2 on bad arguments."""
    p = argparse.ArgumentParser(
        prog="main.py run",
        description="Run a notebook (.ipynb) on the state store without a server: only the "
                    "cells whose result could have changed run, the others are reused from "
                    "the store. Writes the executed notebook. Exit status 0 when every cell "
                    "ran or was reused, 1 when a cell failed or could not run, 2 on bad input.")
    p.add_argument("notebook", help="the .ipynb file to run")
    p.add_argument("-o", "--output", help="where to write the executed notebook "
                                          "(default: the notebook file itself)")
    p.add_argument("--order", choices=("notebook", "dataflow"), default="notebook",
                   help="notebook: top to bottom, as Jupyter; dataflow: each cell after the "
                        "cells defining what it reads (default %(default)s)")
    p.add_argument("--rerun", nargs="+", action="extend", default=[], metavar="ID",
                   help="run these cells (by cell id) and everything downstream of them, "
                        "even if nothing changed")
    p.add_argument("--data-dir", help="folder of the state store (default: config.toml)")
    p.add_argument("--config", help="a TOML file overriding config.toml")
    p.add_argument("--server", metavar="URL",
                   help="run through the server at URL instead (for a store a server holds)")
    p.add_argument("--token", default=os.environ.get("SNAPSHOT_KERNEL_TOKEN"),
                   help="with --server: its token (or SNAPSHOT_KERNEL_TOKEN)")
    p.add_argument("--verbose", action="store_true", help="log the kernel to stderr")
    fresh_group = p.add_argument_group(
        "fresh runs", "--fresh: every cell from scratch in a new interpreter, within limits, "
                      "without the store; the executed notebook is written only if every cell "
                      "passed, and a receipt says what ran where")
    fresh_group.add_argument("--fresh", action="store_true", help="run fresh")
    fresh_group.add_argument("--receipt", help="where to write the run's receipt (JSON)")
    fresh_group.add_argument("--timeout", type=float, help="whole-run deadline in seconds")
    fresh_group.add_argument("--cell-timeout", type=float,
                             help="longest run of one cell in seconds (0: none)")
    fresh_group.add_argument("--cwd", help="working directory of the cells "
                                           "(default: the notebook's)")
    fresh_group.add_argument("--env", action="extend", nargs="+", default=[], metavar="NAME",
                             help="pass this variable from the environment (must be set)")
    fresh_group.add_argument("--lock", help="a lock file whose hash and path the receipt "
                                            "records")
    fresh_group.add_argument("--expected-environment", metavar="SHA256",
                             help="refuse to run unless the kernel's environment has this "
                                  "hash")
    fresh_group.add_argument("--overwrite", action="store_true",
                             help="replace an existing output")
    fresh_group.add_argument("--keep-states", metavar="DIR",
                             help="keep the run's states in this new store folder")
    args = p.parse_args(argv)
    fresh_only = ("receipt", "timeout", "cell_timeout", "cwd", "env", "lock",
                  "expected_environment", "overwrite", "keep_states")
    store_only = ("rerun", "data_dir", "server")
    given = [name for name in (fresh_only if not args.fresh else store_only)
             if getattr(args, name) not in (None, [], False)]
    if args.fresh and args.order != "notebook":
        given.append("order")
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        p.error(f"{flags}: only with --fresh" if not args.fresh
                else f"{flags}: not with --fresh (a fresh run uses no store)")
    return args


class RunRefused(Exception):
    """`main.py run` cannot go on: bad input, the store is held (exit status 2)."""


def run_command(argv):
    """`main.py run NB.ipynb ...`: returns the exit status."""
    from kernel.notebook import ipynb  # nbformat: only for .ipynb files
    args = parse_run_args(argv)
    if args.fresh:
        return _run_fresh(args)
    try:
        notebook = ipynb.read(args.notebook)
        cells = ipynb.code_cells(notebook)
        name = os.path.abspath(args.notebook)
        progress = Progress(len(cells))
        if args.server:
            record = _run_through_server(args, name, cells, progress)
        else:
            record = _run_here(args, name, cells, progress)
        progress.done(record)
        executed = ipynb.executed(notebook, record)
        ipynb.write(executed, args.output or args.notebook)
    except (RunRefused, ipynb.NotebookFileError) as exc:
        print(f"main.py run: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"main.py run: error: cannot write the notebook: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output or args.notebook}", file=sys.stderr)
    return 0 if all(c["status"] in ("ran", "reused") for c in record["cells"]) else 1


def _run_fresh(args):
    """`main.py run --fresh`: the run without a server or store; the exit status."""
    from kernel.notebook import fresh, fresh_file  # nbformat: only for .ipynb files
    try:
        settings = config_mod.load(args.config)
    except config_mod.ConfigError as exc:
        print(f"main.py run: error: {exc}", file=sys.stderr)
        return 2

    def progress(cell):
        """One line per code cell as it ends."""
        took = f" {cell.seconds:.2f} s" if cell.status in ("ran", "failed") else ""
        print(f"cell {cell.index} ({cell.id}): {cell.status}{took}", file=sys.stderr,
              flush=True)

    try:
        status, receipt = fresh_file.run_file(
            args.notebook, args.output, args.receipt, settings, timeout=args.timeout,
            cell_timeout=args.cell_timeout, cwd=args.cwd, variables=args.env,
            lock=args.lock, expected_environment=args.expected_environment,
            overwrite=args.overwrite, keep_states=args.keep_states, adopt_orphans=True,
            on_cell=progress)
    except fresh.Refused as exc:
        print(f"main.py run: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"main.py run: error: cannot write the receipt {args.receipt}: {exc.strerror}",
              file=sys.stderr)
        return 2
    counts = receipt["counts"]
    print(f"{'passed' if receipt['success'] else 'FAILED ' + receipt['category']}: "
          f"{counts['completed']} cell(s) ran, {counts['failed']} failed, {counts['skipped']} "
          f"skipped, in {receipt['seconds']:.2f} s. {receipt['message']}", file=sys.stderr)
    return status


def _run_here(args, name, cells, progress):
    """Run the notebook with a kernel in this process, on the store (which must be free)."""
    overrides = {"server.data_dir": os.path.abspath(args.data_dir)} if args.data_dir else {}
    try:
        settings = config_mod.load(args.config, overrides)
    except config_mod.ConfigError as exc:
        raise RunRefused(str(exc)) from None
    data_dir = settings["server.data_dir"]
    try:
        os.makedirs(data_dir, exist_ok=True)
        lock = try_server_lock(data_dir)
    except OSError as exc:
        raise RunRefused(f"cannot use the store at {data_dir}: {exc}") from None
    if lock is None:
        raise RunRefused(
            f"{lock_holder(data_dir) or 'another process'} is using the store at {data_dir}. "
            f"Run through it with --server URL (its token in --token or "
            f"SNAPSHOT_KERNEL_TOKEN), or stop it first")
    _setup_logging(settings["server.log_file"], args.verbose)
    box = {}
    try:
        note_holder(lock, f"`main.py run {args.notebook}` (pid {os.getpid()})")
        try:
            kernel = Registry(settings)
        except StoreError as exc:
            raise RunRefused(str(exc)) from None
        try:
            from kernel.notebook.runner import Runner
            runner = Runner(kernel)
            exec_id = f"run-{os.getpid()}"

            def work():
                """The run, in a thread: Ctrl-C in the main thread interrupts it."""
                try:
                    box["record"] = runner.run(name, cells, args.order, args.rerun, exec_id,
                                               progress.cell)
                except BaseException as exc:  # handed to the main thread
                    box["error"] = exc

            _wait_interruptible(threading.Thread(target=work, daemon=True),
                                lambda: runner.interrupt(exec_id), progress)
        finally:
            kernel.close()
    finally:
        lock.close()
    if "error" in box:
        if isinstance(box["error"], InvalidRequest):
            raise RunRefused(str(box["error"]))
        raise box["error"]
    return box["record"]


def _wait_interruptible(thread, interrupt, progress):
    """Start `thread` and wait for it; Ctrl-C interrupts the run, a second one too."""
    thread.start()
    while thread.is_alive():
        try:
            thread.join(0.2)
        except KeyboardInterrupt:
            progress.note("interrupting the run (the running cell gets KeyboardInterrupt)")
            interrupt()


def _run_through_server(args, name, cells, progress):
    """Run the notebook through a server's POST /notebooks/run, polling its record."""
    import urllib.error
    import urllib.request
    base = args.server.rstrip("/")
    exec_id = f"run-{os.getpid()}-{os.urandom(4).hex()}"

    def call(method, path, payload=None):
        """One request to the server; its JSON answer."""
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(base + path, data=data, method=method, headers={
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {args.token}"} if args.token else {})})
        try:
            with urllib.request.urlopen(request, timeout=None) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = exc.reason
            raise RunRefused(f"the server answered {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise RunRefused(f"cannot reach the server at {base}: "
                             f"{getattr(exc, 'reason', exc)}") from None

    box = {}

    def work():
        """The run's request, in a thread."""
        try:
            box["record"] = call("POST", "/notebooks/run", {
                "notebook": name, "cells": cells, "order": args.order, "rerun": args.rerun,
                "exec_id": exec_id})
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    path = "/notebooks/" + urllib.parse.quote(name, safe="")
    reported = {}
    while thread.is_alive():
        try:
            thread.join(0.25)
            if thread.is_alive():
                try:
                    record = call("GET", path)
                except RunRefused:
                    continue  # not started yet
                for cell in record["cells"] if record.get("exec_id") == exec_id else ():
                    if reported.get(cell["id"]) != cell["status"]:
                        reported[cell["id"]] = cell["status"]
                        progress.cell(cell)
        except KeyboardInterrupt:
            progress.note("interrupting the run (the running cell gets KeyboardInterrupt)")
            call("POST", "/interrupt", {"exec_id": exec_id})
    if "error" in box:
        raise box["error"]
    for cell in box["record"]["cells"]:  # what the polls missed
        if reported.get(cell["id"]) != cell["status"]:
            progress.cell(cell)
    return box["record"]


class Progress:
    """Progress on stderr: a bar on a terminal, a line per finished cell otherwise."""

    def __init__(self, total):
        """For a notebook of `total` code cells."""
        self.total = total
        self.finished = 0
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()

    def cell(self, cell):
        """A cell's status changed."""
        if cell["status"] in ("pending",):
            return
        line = f"{cell['id']}: {cell['status']}"
        if cell["status"] == "ran" or cell["status"] == "failed":
            line += f" in {cell['took_s']:.2f} s"
        if cell["status"] in ("failed", "blocked") and cell.get("error"):
            line += f" ({cell['error']['ename']}: {cell['error']['evalue'][:80]})"
        if cell["status"] != "running":
            self.finished += 1
        if self.tty:
            width = 30
            filled = width * self.finished // max(self.total, 1)
            bar = "#" * filled + "-" * (width - filled)
            sys.stderr.write(f"\r\x1b[K[{bar}] {self.finished}/{self.total} {line[:60]}")
            sys.stderr.flush()
        elif cell["status"] != "running":
            print(line, file=sys.stderr, flush=True)

    def note(self, text):
        """A message between progress lines."""
        print(("\n" if self.tty else "") + text, file=sys.stderr, flush=True)

    def done(self, record):
        """The summary line."""
        counts = {}
        for cell in record["cells"]:
            counts[cell["status"]] = counts.get(cell["status"], 0) + 1
        text = ", ".join(f"{n} {status}" for status, n in counts.items())
        for d in record["diagnostics"]:
            print(("\n" if self.tty else "") + d["message"], file=sys.stderr)
        print(("\n" if self.tty else "") + f"{self.total} code cells: {text or 'none'} "
              f"({time.monotonic() - self.started:.2f} s)", file=sys.stderr, flush=True)


def _setup_logging(log_file, verbose):
    """Logs go to the log file, or to stderr with --verbose; otherwise nowhere."""
    handlers = []
    if log_file:
        handlers.append(logging.FileHandler(log_file))
    if verbose:
        handlers.append(logging.StreamHandler(sys.stderr))
    if not handlers:
        handlers.append(logging.NullHandler())
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="%(asctime)s %(levelname)s %(message)s")


def serve(host, port, s):
    """Run cheroot until SIGTERM or Ctrl-C, then stop the workers."""
    from cheroot import wsgi

    class Server(wsgi.Server):
        """cheroot, but a new connection costs no thread until it sends something.

        cheroot hands each accepted connection to a worker thread at once, so
        `server_threads` idle connections would hold every thread for
        socket_timeout_s; here it first waits in the selector, as kept-alive
        connections do, and is closed there once idle for socket_timeout_s.
        """

        def process_conn(self, conn):
            """Queue a connection for a thread once it has bytes to read."""
            if not getattr(conn, "snapk_waited", False):
                conn.snapk_waited = True
                self._connections.put(conn)
                return
            super().process_conn(conn)

    # A listen backlog of cheroot's default 5 drops connections of a burst of clients
    # (each then waits a 1 s SYN retry): let the kernel queue them.
    server = Server((host, port), app, numthreads=s["server.server_threads"],
                    timeout=s["server.socket_timeout_s"], request_queue_size=128)
    if s["server.certfile"] or s["server.keyfile"]:
        from cheroot.ssl.builtin import BuiltinSSLAdapter

        class TlsAdapter(BuiltinSSLAdapter):
            """TLS whose handshake runs in a worker thread, on the client's first bytes.

            cheroot's adapter shakes hands in its single accept loop, so one
            connection that sends nothing stalls every client for
            socket_timeout_s; here OpenSSL completes the handshake on the
            worker's first read instead.
            """

            def wrap(self, sock):
                """The TLS socket (handshake pending) and the WSGI entries."""
                tls = self.context.wrap_socket(sock, do_handshake_on_connect=False,
                                               server_side=True)
                return tls, {"wsgi.url_scheme": "https", "HTTPS": "on"}

        server.ssl_adapter = TlsAdapter(s["server.certfile"], s["server.keyfile"])

    def stop(*_):
        """Leave the serving loop from the main thread (once)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        server.start()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        # Workers first: a request waiting on one then ends at once.
        _kernel.close()
        _stop_within(server, 10)


def _stop_within(server, seconds):
    """server.stop(), waiting at most `seconds`.

    cheroot's stop joins, without a timeout, a request thread that missed its
    shutdown request (seen once in about 40 stops), and the process would
    never exit; the workers are gone by now, so leaving loses nothing.
    """
    stopper = threading.Thread(target=server.stop, daemon=True)
    stopper.start()
    stopper.join(seconds)
    if stopper.is_alive():
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
