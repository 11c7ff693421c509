"""What the kernel refuses or fails at, as domain errors.

Each error has a `etype`, the `type` of the JSON error the HTTP layer
answers with; which HTTP status each one gets is the HTTP layer's business
(api/errors.py). The store's own errors (storage.store.StoreError,
StoreFull, StoreCorrupt) travel the same way.
"""


class KernelError(Exception):
    """A request the kernel refuses or could not carry out."""

    etype = "KernelError"

    def __init__(self, message, etype=None):
        """`etype` overrides the class's error type (e.g. a worker's exception name)."""
        super().__init__(message)
        if etype is not None:
            self.etype = etype


class InvalidRequest(KernelError):
    """A request the kernel cannot make sense of (a bad argument value)."""

    etype = "BadRequest"


class StateNotFound(KernelError):
    """No state has that name."""

    etype = "StateNotFound"


class NotebookNotFound(KernelError):
    """No notebook has that name."""

    etype = "NotebookNotFound"


class Conflict(KernelError):
    """The request collides with the kernel's state (an exec_id in use, deleting `initial`)."""

    etype = "Conflict"


class RequestFailed(KernelError):
    """A worker could not carry out a request that is not a cell (e.g. a rebuild)."""


class ServerStopping(KernelError):
    """The server is stopping (SIGTERM, Ctrl-C): its workers and store were closed under
    a request still running."""

    etype = "ServerStopping"

    def __init__(self):
        super().__init__("the server is stopping, and this request was cut short; send "
                         "it again once the server is back")


class Refused(Exception):
    """A run that cannot start: `category` (a fresh run's receipt names it; "BAD_INPUT"
    for a problem of the request itself) and a message saying why. Not a KernelError:
    a fresh run records it in its receipt, and the `run` command exits with status 2."""

    def __init__(self, category, message):
        """Keep the category."""
        super().__init__(message)
        self.category = category
