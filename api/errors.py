"""Which HTTP status answers which error: the one place statuses are chosen.

The kernel and the store raise domain errors (kernel/errors.py,
storage.store); the HTTP layer answers each with its status and the JSON
error `{"error": {"type", "message"}}`.
"""

from snapkernel.kernel.errors import (Conflict, InvalidRequest, KernelError, NotebookNotFound,
                           RequestFailed, ServerStopping, StateNotFound)
from snapkernel.storage.remote import NameConflict, RemoteUnavailable
from snapkernel.storage.store import NewerFormat, StoreCorrupt, StoreError, StoreFull


class BadRequest(Exception):
    """The request is malformed: answered with 400."""


class PayloadTooLarge(Exception):
    """The body is larger than max_body_mb: answered with 413."""


# (error class, status, JSON error type or None for the error's own etype), first match wins.
_STATUSES = (
    (BadRequest, 400, "BadRequest"),
    (PayloadTooLarge, 413, "PayloadTooLarge"),
    (InvalidRequest, 400, None),
    (StateNotFound, 404, None),
    (NotebookNotFound, 404, None),
    (Conflict, 409, None),
    (RequestFailed, 500, None),
    (ServerStopping, 503, None),
    (KernelError, 500, None),
    (StoreFull, 507, "StoreFull"),
    # Damaged bytes on disk: the server's data is wrong, not the request.
    (StoreCorrupt, 500, "StoreCorrupt"),
    # Written by a newer server (a shared remote): this one must be upgraded.
    (NewerFormat, 500, "NewerFormat"),
    (NameConflict, 409, "NameConflict"),  # rebound on the shared remote meanwhile
    (RemoteUnavailable, 503, "RemoteUnavailable"),
    (StoreError, 503, "StoreUnavailable"),
)


def status_of(exc):
    """(HTTP status, error type) for a domain error; None for an unexpected exception."""
    for cls, status, etype in _STATUSES:
        if isinstance(exc, cls):
            return status, etype or exc.etype
    return None
