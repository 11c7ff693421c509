"""Serve moto's S3 API on a loopback port, one request at a time.

    python tests/s3_server.py PORT

moto checks a conditional write (If-None-Match: *, If-Match) and then
stores the object without a lock between the two, so two concurrent
writers can both pass the check; S3, MinIO and the like make the check
and the write one atomic step. Serializing the requests restores that
atomicity (the tests' rebinding race depends on it). Connections are
still served by several threads, so a client's idle keep-alive
connection does not block the others.
"""

import sys
import threading

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server


def serialized(app):
    """A WSGI app that runs `app` for one request at a time, body included."""
    lock = threading.Lock()

    def run(environ, start_response):
        """Answer one request under the lock."""
        with lock:
            return list(app(environ, start_response))
    return run


def main(port):
    """Serve until killed."""
    app = serialized(DomainDispatcherApplication(create_backend_app))
    make_server("127.0.0.1", port, app, threaded=True).serve_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]))
