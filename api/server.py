"""Serving the routes: cheroot, optionally with TLS, until SIGTERM or Ctrl-C.

Two changes to cheroot's defaults keep one client from holding up others:
a new connection costs no thread until it sends something
(`DeferredServer`), and a TLS handshake runs in the request thread rather
than in cheroot's single accept loop (`DeferredTls`).
"""

import json
import logging
import os
import re
import signal
import socket
import ssl
import sys
import threading

from cheroot import errors, server as cheroot_server, wsgi
from cheroot.ssl.builtin import BuiltinSSLAdapter

from snapkernel.api.routes import app, named, service
from snapkernel.storage.store import StoreError, StoreHeld, note_holder

# The listen backlog: cheroot's default of 5 drops connections of a burst of clients
# (each then waits a 1 s SYN retry); let the kernel queue them.
_BACKLOG = 128
# Seconds a stop may take before the process leaves anyway (see _stop_within).
_STOP_S = 10


class BoundedRequest(cheroot_server.HTTPRequest):
    """cheroot's request, whose request line and headers past server.max_header_kb are
    answered 431, as JSON (cheroot's own answer is a plain-text 413 or 414)."""

    def read_request_line(self):
        """The request line, or False once answered 431."""
        try:
            return super().read_request_line()
        except errors.MaxSizeExceeded:
            return self._too_large("request line")

    def read_request_headers(self):
        """The headers, or False once answered 431."""
        try:
            return super().read_request_headers()
        except errors.MaxSizeExceeded:
            return self._too_large("headers")

    def _too_large(self, what):
        """Answer 431 and close the connection (the rest of the request is not read)."""
        limit_kb = self.server.max_request_header_size // 1024
        body = json.dumps({"error": {"type": "RequestHeaderFieldsTooLarge", "message": (
            f"the request's {what} went past max_header_kb ({limit_kb} KiB): send a "
            f"shorter URL or fewer, smaller headers (the code goes in the JSON body)")}})
        self.close_connection = True
        try:
            self.conn.wfile.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"Content-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
        except OSError:
            pass  # the client went away
        return False


class BoundedConnection(cheroot_server.HTTPConnection):
    """cheroot's connection, reading requests as BoundedRequest."""

    RequestHandlerClass = BoundedRequest


class DeferredServer(wsgi.Server):
    """cheroot, but a new connection costs no thread until it sends something.

    cheroot hands each accepted connection to a worker thread at once, so
    `server_threads` idle connections would hold every thread for
    socket_timeout_s; here it first waits in the selector, as kept-alive
    connections do, and is closed there once idle for socket_timeout_s.
    """

    ConnectionClass = BoundedConnection
    _queuing = False  # the main thread is handing a connection to the threads
    _leave_after = False  # a stop came meanwhile

    def process_conn(self, conn):
        """Queue a connection for a thread once it has bytes to read."""
        if not getattr(conn, "snapk_waited", False):
            conn.snapk_waited = True
            self._connections.put(conn)
            return
        if threading.current_thread() is not threading.main_thread():
            super().process_conn(conn)  # a kept-alive connection, from its thread
            return
        self._queuing = True
        try:
            super().process_conn(conn)
        finally:
            self._queuing = False
        if self._leave_after:
            raise SystemExit(0)

    def leave(self):
        """Leave the serving loop: called in the main thread by a stop signal's handler.

        Not while the main thread hands a connection to the threads: raised
        inside that queue's put, between threading.Condition.notify waking a
        thread and forgetting it, SystemExit made a later wakeup go to no
        one, so one of cheroot's threads never got the stop request it waited
        for, and the stop waited for it until _STOP_S (1 stop in 15 here).
        A stop that comes then leaves once the connection is queued.
        """
        if self._queuing:
            self._leave_after = True
        else:
            raise SystemExit(0)


class DeferredTls(BuiltinSSLAdapter):
    """TLS whose handshake runs in a worker thread, on the client's first bytes.

    cheroot's adapter shakes hands in its single accept loop, so one
    connection that sends nothing stalls every client for socket_timeout_s;
    here OpenSSL completes the handshake on the worker's first read instead.
    """

    def wrap(self, sock):
        """The TLS socket (handshake pending) and the WSGI entries."""
        tls = self.context.wrap_socket(sock, do_handshake_on_connect=False, server_side=True)
        return tls, {"wsgi.url_scheme": "https", "HTTPS": "on"}


class StartFailed(Exception):
    """The server cannot start; the message names the problem in one line."""


def _reason(exc):
    """The system's words for a failed bind (cheroot wraps them in its own message)."""
    found = re.findall(r"\[Errno \d+\] ([^)]*)", str(exc))
    return found[-1] if found else (getattr(exc, "strerror", None) or str(exc))


def serve(host, port, settings, token, no_auth=False, pool=None):
    """Listen on `host`:`port`, open the store, then serve the routes until SIGTERM or
    Ctrl-C, and stop every worker. StartFailed when it cannot start (the port is taken,
    the address is not this machine's, the certificate is not one, the store is held):
    the socket is bound and the certificate loaded before the store is claimed, so a
    failed start leaves no store and no lock behind. `pool`: the worker pool, started
    already (see Registry); closed on a failed start."""
    app.config["token"] = token
    app.config["bind_host"] = host
    app.config["no_auth"] = no_auth and not token
    service.use(settings)
    service.server_id = settings["server.id"] or f"{socket.gethostname()}:{port}"
    scheme = "https" if settings["server.certfile"] else "http"
    server = DeferredServer((host.strip("[]"), port), named(app),
                            numthreads=settings["server.server_threads"],
                            timeout=settings["server.socket_timeout_s"],
                            request_queue_size=_BACKLOG)
    server.max_request_header_size = settings["server.max_header_kb"] * 1024
    try:
        if settings["server.certfile"] or settings["server.keyfile"]:
            try:
                server.ssl_adapter = DeferredTls(settings["server.certfile"],
                                                 settings["server.keyfile"])
            except (OSError, ssl.SSLError) as exc:
                reason = f"not a PEM certificate and its key ({exc.args[-1]})" \
                    if isinstance(exc, ssl.SSLError) else exc.strerror
                raise StartFailed(
                    f"cannot use the certificate {settings['server.certfile']} and key "
                    f"{settings['server.keyfile']} (server.certfile, server.keyfile): "
                    f"{reason}") from None
        try:
            server.prepare()  # binds and listens: nothing is served before serve()
        except OSError as exc:
            raise StartFailed(f"cannot listen on {host}:{port}: {_reason(exc)} (choose "
                              f"another --bind)") from None
        try:
            registry = service.start(f"a server starting (pid {os.getpid()})", pool)
        except StoreError as exc:
            if isinstance(exc, StoreHeld):
                raise StartFailed(f"{exc}; stop it or choose another --data-dir") from None
            raise StartFailed(str(exc)) from None
    except StartFailed:
        if pool is not None:
            pool.close()
        if server.ready:
            _stop_within(server, _STOP_S)
        raise
    if registry.damaged:
        damaged = registry.damaged
        # Said once, before serving: while it serves, the server writes nothing on stderr.
        print(f"warning: {len(damaged)} state(s) left out, their manifests damaged: "
              f"{'; '.join(map(str, damaged[:3]))}{'; ...' if len(damaged) > 3 else ''}. "
              f"scripts/check_store.py lists what is damaged", file=sys.stderr, flush=True)
    note_holder(service.store_lock, f"a server at {scheme}://{host}:{port} "
                                    f"(pid {os.getpid()})")

    def stop(*_):
        """SIGTERM or Ctrl-C: leave the serving loop from the main thread (once)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        server.leave()

    def drain(*_):
        """SIGTERM with server.drain_s: /health says "draining" and everything is served
        for drain_s more (a load balancer takes the server out meanwhile), then stop. A
        second SIGTERM or Ctrl-C stops at once."""
        service.draining = True
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, settings["server.drain_s"])

    signal.signal(signal.SIGTERM, drain if settings["server.drain_s"] > 0 else stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        # Workers first: a request waiting on one then ends at once.
        service.close()
        _stop_within(server, _STOP_S)


def _stop_within(server, seconds):
    """server.stop(), waiting at most `seconds`.

    cheroot's stop joins, without a timeout, a request thread that missed its
    shutdown request (DeferredServer.leave keeps the one cause found from
    happening), and the process would never exit; the workers are gone by
    now, so leaving loses nothing.
    """
    stopper = threading.Thread(target=server.stop, daemon=True)
    stopper.start()
    stopper.join(seconds)
    if stopper.is_alive():
        logging.shutdown()
        os._exit(0)
