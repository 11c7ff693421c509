"""The remote tier: blobs and named manifests in S3-compatible object storage.

Several servers share one bucket prefix, `s3://BUCKET/PREFIX`:

    PREFIX/blobs/<sha256>   a blob record exactly as the LMDB store keeps it
                            (a flag byte, then the payload, zstd-compressed when
                            that pays), written once with If-None-Match: *
    PREFIX/names/<quoted>   the manifest (zstd JSON) a state name points to; the
                            name is percent-quoted, so any name is one key
    PREFIX/gc/unreferenced.json   when scripts/gc_states.py first found each
                            unreferenced blob unreferenced
    PREFIX/format           the store format of the newest server that wrote
                            here (as the LMDB store's format record)

A server records its format when it first reaches the remote (a newer
format recorded there stands: the record only goes up, by compare-and-swap)
and refuses a remote of a format it cannot read, as it refuses such a local
store. So a blob record of a type this server does not know is damage only
while the remote's format is one this server reads; after a newer server
has written there, it is that server's (NewerFormat, "upgrade this server").

A name record is created with If-None-Match: * and replaced or deleted only
with If-Match on the ETag its writer last saw, so two servers rebinding one
name never interleave: one of them is refused (`NameConflict`) and learns
the other's record. Blobs are immutable; the only thing that rewrites one
is `freshen`, a copy onto itself that renews its LastModified time, which
`scripts/gc_states.py` reads as "still wanted" (see storage/cache.py).

Credentials come only from the standard AWS environment variables and
profile files: the instance-metadata and container providers, which would
ask an address on the network, are taken out of boto3's chain. Every error
becomes a StoreError subclass with a sentence saying what to do:
`RemoteUnavailable` (no answer, time-out, 5xx: try again later) or
`RemoteError` (credentials, permissions, a missing bucket: fix the setup).
A process makes its client once; a forked process keeps the client it
inherited (the warm zygote makes one before forking holders) but closes
the inherited connections, which belong to its parent.
"""

import json
import os
import threading
import urllib.parse

from snapkernel.storage.store import (FORMAT_VERSION, Store, StoreError, decode_manifest, decode_record,
                           encode_manifest, format_refusal)

# Credential providers of botocore that ask the network (an EC2/ECS metadata address).
_NETWORK_PROVIDERS = ("container-role", "iam-role")
# This process's clients by endpoint and settings. Forked processes keep them (making
# one costs 5 to 150 ms, more than a cell), less the parent's connections.
_clients = {}
_clients_lock = threading.Lock()  # boto3 sessions must not be made by two threads at once


# Writes of the format record refused (another server's in between) before giving up
# until the next start: each read again first.
_FORMAT_TRIES = 5


class RemoteError(StoreError):
    """The remote store cannot be used as configured (credentials, bucket, boto3)."""


class RemoteUnavailable(StoreError):
    """The remote store did not answer in time or answered with a server error."""


class NameConflict(StoreError):
    """A name record changed on the remote since this server last saw it."""


def _forget_inherited_connections():
    """In a forked child: close the sockets inherited from the parent's clients."""
    for client in _clients.values():
        client.close()


os.register_at_fork(after_in_child=_forget_inherited_connections)


def parse_url(url):
    """(bucket, prefix) of "s3://BUCKET/PREFIX"; the prefix ends with "/" or is empty."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise RemoteError(f"store.remote must look like s3://BUCKET/PREFIX, not {url!r}")
    prefix = parts.path.strip("/")
    return parts.netloc, prefix + "/" if prefix else ""


def _epoch(when):
    """A botocore datetime as seconds since the epoch."""
    return when.timestamp()


class RemoteStore:
    """Blobs and name records under one bucket prefix."""

    def __init__(self, url, endpoint, settings):
        """Describe the remote; the client is made on first use (per process)."""
        self.url = url
        self.bucket, self.prefix = parse_url(url)
        self.endpoint = endpoint or None
        self.settings = settings

    # The client ----------------------------------------------------------

    @property
    def client(self):
        """This process's boto3 S3 client for this endpoint."""
        s = self.settings
        key = (self.endpoint, s["store.remote_timeout_s"], s["store.remote_attempts"],
               s["store.remote_parallel"])
        with _clients_lock:
            if key not in _clients:
                _clients[key] = self._make_client()
            return _clients[key]

    def _make_client(self):
        """A boto3 client: AWS environment/profile credentials, our time-outs and retries."""
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise RemoteError("store.remote is set, but boto3 is not installed: "
                              "pip install -e '.[s3]'") from None
        session = boto3.session.Session()
        resolver = session._session.get_component("credential_provider")
        for name in _NETWORK_PROVIDERS:
            resolver.remove(name)
        timeout = self.settings["store.remote_timeout_s"]
        config = Config(connect_timeout=timeout, read_timeout=timeout,
                        retries={"mode": "standard",
                                 "max_attempts": self.settings["store.remote_attempts"]},
                        max_pool_connections=2 * self.settings["store.remote_parallel"])
        return session.client("s3", endpoint_url=self.endpoint, config=config,
                              region_name=session.region_name or "us-east-1")

    def _call(self, operation, **params):
        """Run one S3 operation; errors become RemoteUnavailable or RemoteError.

        A 412 (precondition failed) or 404 is returned as the status number,
        for the caller to read; every other failure raises.
        """
        from botocore import exceptions as bx
        try:
            return getattr(self.client, operation)(Bucket=self.bucket, **params)
        except bx.ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code", "")
            if status in (404, 412) and code not in ("NoSuchBucket",):
                return status
            if status is None or status >= 500 or code in ("SlowDown", "RequestTimeout"):
                raise RemoteUnavailable(f"the remote store {self.url} answered {operation} "
                                        f"with {code or status}; try again later") from None
            raise RemoteError(f"the remote store {self.url} refused {operation}: {code} "
                              f"({exc.response.get('Error', {}).get('Message', '')}). Check "
                              f"the bucket and the AWS credentials (environment variables "
                              f"or profile)") from None
        except bx.NoCredentialsError:
            raise RemoteError("no AWS credentials for the remote store: set "
                              "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
                              "with a profile in ~/.aws/credentials") from None
        except bx.BotoCoreError as exc:
            raise RemoteUnavailable(f"the remote store {self.url} is unreachable "
                                    f"({type(exc).__name__}: {exc}); try again later") from None

    def check(self):
        """Raise unless the bucket can be reached and read, and holds a format this
        server reads; then record this server's format there (check_format)."""
        if self._call("list_objects_v2", Prefix=self.prefix, MaxKeys=1) == 404:
            raise RemoteError(f"the bucket of {self.url} does not exist")
        self.check_format(record=True)

    # The format record ----------------------------------------------------

    def check_format(self, record=False):
        """Raise NewerFormat if a newer server recorded a format this one cannot read
        (StoreError for a record that is no format). With `record`, write this
        server's format where there is none or an older one (only ever upward:
        If-None-Match or If-Match on the record read, read again when refused)."""
        key = f"{self.prefix}format"
        current = str(FORMAT_VERSION).encode()
        for _ in range(_FORMAT_TRIES):  # each refused write: another server wrote it
            answer = self._call("get_object", Key=key)
            found, etag = (None, None) if answer in (404, 412) else (
                self._body(answer, "the format record").strip(), answer["ETag"])
            if found is not None:
                refusal = format_refusal(
                    found, f"the remote store {self.url}",
                    "upgrade this server to the version that wrote it (servers sharing a "
                    "bucket must run one version)")
                if refusal:
                    raise refusal
            if not record or found == current:
                return
            condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
            if self._call("put_object", Key=key, Body=current, **condition) not in (404, 412):
                return

    def _body(self, answer, what):
        """The body of a get_object answer; RemoteUnavailable if the connection breaks."""
        try:
            return answer["Body"].read()
        except Exception as exc:  # the connection broke while the body came
            raise RemoteUnavailable(f"reading {what} from {self.url} failed: "
                                    f"{type(exc).__name__}: {exc}") from None

    # Blobs ---------------------------------------------------------------

    def _blob_key(self, key):
        """The object key of blob `key`."""
        return f"{self.prefix}blobs/{key}"

    def get_blob(self, key):
        """(record bytes, LastModified epoch) of blob `key`, or None if it is absent."""
        answer = self._call("get_object", Key=self._blob_key(key))
        if answer in (404, 412):
            return None
        return self._body(answer, f"blob {key}"), _epoch(answer["LastModified"])

    def head_blob(self, key):
        """The LastModified epoch of blob `key`, or None if it is absent."""
        answer = self._call("head_object", Key=self._blob_key(key))
        return None if answer in (404, 412) else _epoch(answer["LastModified"])

    def put_blob(self, key, record):
        """Store a blob record unless the remote has it; True if this call stored it."""
        answer = self._call("put_object", Key=self._blob_key(key), Body=bytes(record),
                            IfNoneMatch="*")
        return answer != 412

    def freshen(self, key):
        """Renew blob `key`'s LastModified (a copy onto itself); False if it is absent."""
        answer = self._call("copy_object", Key=self._blob_key(key),
                            CopySource={"Bucket": self.bucket, "Key": self._blob_key(key)},
                            MetadataDirective="REPLACE", Metadata={"freshened": "1"})
        return answer not in (404, 412)

    # The reading side of Store's interface, for scripts/check_store.py and gc_states.py.
    path = property(lambda self: self.url)
    blob = Store.blob
    chunk_list = Store.chunk_list
    referenced = Store.referenced

    def read_blob(self, key):
        """(None, verified payload) of blob `key`, or (what is wrong with it, None)."""
        got = self.get_blob(key)
        if got is None:
            return "missing from the remote", None
        return decode_record(got[0], key)

    def blobs(self):
        """{key: (LastModified epoch, size)} of every blob on the remote."""
        found = {}
        for item in self._list(f"{self.prefix}blobs/"):
            found[item["Key"].rsplit("/", 1)[1]] = (_epoch(item["LastModified"]), item["Size"])
        return found

    def delete_blob(self, key):
        """Remove blob `key` (absent is fine)."""
        self._call("delete_object", Key=self._blob_key(key))

    def gc_marks(self):
        """{blob key: when scripts/gc_states.py first found it unreferenced} (epoch)."""
        answer = self._call("get_object", Key=f"{self.prefix}gc/unreferenced.json")
        if answer in (404, 412):
            return {}
        try:
            return json.loads(answer["Body"].read())
        except ValueError:
            return {}  # damaged: the grace period starts again for every blob

    def put_gc_marks(self, marks):
        """Replace the record of when blobs were first found unreferenced."""
        self._call("put_object", Key=f"{self.prefix}gc/unreferenced.json",
                   Body=json.dumps(marks).encode())

    # Names ---------------------------------------------------------------

    def _name_key(self, name):
        """The object key of the record of state name `name`."""
        return f"{self.prefix}names/{urllib.parse.quote(name, safe='')}"

    def names(self):
        """{state name: ETag} of every name record on the remote."""
        start = len(f"{self.prefix}names/")
        return {urllib.parse.unquote(item["Key"][start:]): item["ETag"]
                for item in self._list(f"{self.prefix}names/")}

    def name_record(self, name):
        """(stored manifest bytes, ETag) of name `name`, or None if there is no such name."""
        answer = self._call("get_object", Key=self._name_key(name))
        if answer in (404, 412):
            return None
        return self._body(answer, f"the record of state {name!r}"), answer["ETag"]

    def get_name(self, name):
        """(manifest, ETag) of name `name`, or None if the remote has no such name."""
        got = self.name_record(name)
        if got is None:
            return None
        try:
            return decode_manifest(got[0]), got[1]
        except Exception as exc:  # not zstd, not JSON
            raise RemoteError(f"the record of state {name!r} on {self.url} cannot be read "
                              f"({type(exc).__name__}: {exc}); run "
                              f"scripts/check_store.py --remote") from None

    def put_name(self, name, manifest, etag):
        """Point `name` at `manifest`, if its record still has ETag `etag` (None: if
        there is no record). Returns the new ETag; raises NameConflict otherwise."""
        condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        answer = self._call("put_object", Key=self._name_key(name),
                            Body=encode_manifest(manifest), **condition)
        if answer in (404, 412):
            raise NameConflict(f"state name {name!r} was bound, rebound or deleted by "
                               f"another server since this one last saw it")
        return answer["ETag"]

    def delete_name(self, name, etag):
        """Remove `name`'s record if it still has ETag `etag`; NameConflict otherwise."""
        if self._call("delete_object", Key=self._name_key(name), IfMatch=etag) == 412:
            raise NameConflict(f"state name {name!r} was rebound by another server since "
                               f"this one last saw it; it was not deleted")

    # Listing ---------------------------------------------------------------

    def _list(self, prefix):
        """Every object under `prefix` (list_objects_v2 pages followed)."""
        token = {}
        while True:
            page = self._call("list_objects_v2", Prefix=prefix, **token)
            if page == 404:
                raise RemoteError(f"the bucket of {self.url} does not exist")
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}


def warm(settings):
    """Import boto3 and load the S3 service model once, before worker forks share it."""
    if settings["store.remote"]:
        try:
            RemoteStore(settings["store.remote"], settings["store.remote_endpoint"],
                        settings).client
        except StoreError:
            pass  # reported where the store is used
