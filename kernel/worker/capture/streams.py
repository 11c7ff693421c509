"""stdout, stderr and stdin of a cell (ipykernel: iostream.py).

Two kinds of writes reach the running cell's collector:

- Python-level writes to `sys.stdout` / `sys.stderr`, through a proxy
  stream object (`STDOUT`, `STDERR`);
- file-descriptor-level writes to fds 1 and 2 (C extensions, `os.system`,
  child processes), redirected by `FdCapture` into anonymous memory files
  that are read back before every Python-level output, so both kinds stay
  in order.

There is no stdin: `input()` and `getpass.getpass()` fail at once.
"""

import codecs
import contextlib
import ctypes
import fcntl
import io
import os
import sys

from snapkernel.kernel.worker.capture import collector as _collector

_PUNCH_BYTES = 1 << 20  # read fd-level output is released from memory in steps of this
# A write(2) becomes visible page by page while it is copied in, so a read that ends
# on a multiple of this may have cut one short (see FdCapture._drain).
_PAGE_BYTES = 4096


class StreamProxy(io.TextIOBase):
    """sys.stdout / sys.stderr while a cell runs: writes go to the running collector.

    One long-lived object per stream, so a logging handler created in one
    cell keeps working in later cells; outside a cell it writes to the
    process's original stream.
    """

    def __init__(self, name, fd):
        """Make the proxy for stream `name` ("stdout" or "stderr"), standing for fd `fd`."""
        super().__init__()
        self._name = name
        self._fd = fd
        self.fallback = None

    @property
    def name(self):
        """The stream's name, as on a real standard stream."""
        return f"<{self._name}>"

    @property
    def encoding(self):
        """Text written here is Unicode; fd-level output is decoded as UTF-8."""
        return "utf-8"

    @property
    def errors(self):
        """Error handler name, for code that inspects it."""
        return "strict"

    def writable(self):
        """Always writable."""
        return True

    def isatty(self):
        """Not a terminal (as in Jupyter)."""
        return False

    def fileno(self):
        """The captured file descriptor: writes to it are captured too."""
        return self._fd

    def flush(self):
        """Nothing is buffered here; a streamed cell's output goes out now."""
        collector = _collector.running()
        if collector is not None:
            collector.flush()

    @property
    def buffer(self):
        """A binary view (sys.stdout.buffer.write(b"...")), decoded as UTF-8."""
        return _BinaryProxy(self)

    def write(self, text):
        """Send text to the running cell's outputs."""
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        collector = _collector.running()
        if collector is not None:
            collector.stream(self._name, text)
        else:
            target = self.fallback or (sys.__stdout__ if self._fd == 1 else sys.__stderr__)
            if target is not None and target is not self:
                target.write(text)
        return len(text)


class _BinaryProxy(io.RawIOBase):
    """The `.buffer` of a StreamProxy: bytes in, text to the proxy."""

    def __init__(self, text_stream):
        """Wrap `text_stream`."""
        super().__init__()
        self._text = text_stream
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def writable(self):
        """Always writable."""
        return True

    def fileno(self):
        """The captured fd of the text stream."""
        return self._text.fileno()

    def write(self, data):
        """Decode and forward bytes."""
        data = bytes(data)
        self._text.write(self._decoder.decode(data))
        return len(data)


STDOUT = StreamProxy("stdout", 1)
STDERR = StreamProxy("stderr", 2)


def _load_libc():
    """The C library (None where it cannot be loaded)."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


_libc = _load_libc()
_c_fflush = getattr(_libc, "fflush", None)
_pread = os.pread


def _fflush():
    """Flush C stdio buffers (printf output of C extensions) into the captured fds."""
    if _c_fflush is not None:
        _c_fflush(None)


class FdCapture:
    """Redirect fds 1 and 2 into anonymous memory files and read them back in order.

    Files rather than pipes: writers never block on a full pipe, so no
    reader thread is needed and nothing is left running after the cell.
    """

    def __init__(self, collector):
        """Redirect fds 1 and 2; fd-level text goes to `collector`."""
        self.collector = collector
        for stream in (sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                stream.flush()
        _fflush()
        self.saved = {}
        self.files = {}
        self.lock = collector.lock
        self.offsets = {}
        self.punched = {}
        self.decoders = {}
        try:
            for fd in (1, 2):
                self.saved[fd] = os.dup(fd)
                self.files[fd] = self._memfile(fd)
                self.offsets[fd] = self.punched[fd] = 0
                # Append mode: writes through a reopened, truncated /dev/stdout leave no holes.
                fcntl.fcntl(self.files[fd], fcntl.F_SETFL,
                            fcntl.fcntl(self.files[fd], fcntl.F_GETFL) | os.O_APPEND)
                self.decoders[fd] = codecs.getincrementaldecoder("utf-8")("replace")
                os.dup2(self.files[fd], fd)
        except BaseException:
            self.restore()
            raise

    @staticmethod
    def _memfile(fd):
        """An anonymous file in memory (a temporary file where memfd is missing)."""
        try:
            return os.memfd_create(f"cell-fd{fd}", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            import tempfile
            f = tempfile.TemporaryFile()
            new = os.dup(f.fileno())
            f.close()
            return new

    def drain(self, full=True):
        """Move whatever was written to fds 1 and 2 since the last call into the collector.

        full=False (before each Python-level write) skips the check for a
        child that truncated the file by reopening /dev/stdout.
        """
        # Threads of the cell may print too: one reader at a time, or a chunk is read twice.
        with self.lock:
            self._drain(full)

    def _drain(self, full):
        """drain() under the lock."""
        _fflush()
        offsets = self.offsets
        for fd, name in ((1, "stdout"), (2, "stderr")):
            mem = self.files.get(fd)
            if mem is None:
                continue
            while True:
                chunk = _pread(mem, 1 << 20, offsets[fd])
                if not chunk:
                    # (Checked only on full drains: an fstat per print would double its cost.)
                    if full and os.fstat(mem).st_size < self.offsets[fd]:
                        # A child reopened /dev/stdout with O_TRUNC: the file starts over
                        # (appends land at its new end), so read it from the start.
                        self.offsets[fd] = self.punched[fd] = 0
                        continue
                    break
                self.offsets[fd] += len(chunk)
                if self.offsets[fd] % _PAGE_BYTES == 0:
                    # Another thread's write(2) may be half copied in (the file grows a
                    # page at a time). A write of nothing takes the file's lock, which
                    # a write holds to its last byte: after it, the rest is there to
                    # read now, before any other output can come between the halves.
                    os.write(mem, b"")
                if self.collector.truncated:
                    continue  # past the cell's limit: only keep the file small
                text = self.decoders[fd].decode(chunk)
                if text:
                    self.collector.stream(name, text, drain=False)
            if self.offsets[fd] - self.punched[fd] >= _PUNCH_BYTES:
                self._release(fd)

    def _release(self, fd):
        """Give the memory of what was read back to the system (the file stays sparse).

        Writers keep appending at their own offset, so only pages already read
        are dropped: nothing is lost, and a cell printing gigabytes from C code
        between two Python-level outputs is the only case that holds memory.
        """
        start = self.punched[fd]
        end = self.offsets[fd] & ~0xFFF
        if end <= start:
            return
        try:
            # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
            if _libc.fallocate(self.files[fd], 0x02 | 0x01, ctypes.c_long(start),
                               ctypes.c_long(end - start)) == 0:
                self.punched[fd] = end
        except (AttributeError, OSError, TypeError):
            self.punched[fd] = end

    def restore(self):
        """Read the last fd-level output, then put fds 1 and 2 back exactly."""
        with contextlib.suppress(Exception):
            self.drain()
        for fd in (1, 2):
            if fd in self.saved:
                with contextlib.suppress(OSError):
                    os.dup2(self.saved[fd], fd)
                with contextlib.suppress(OSError):
                    os.close(self.saved[fd])
            if fd in self.files:
                with contextlib.suppress(OSError):
                    os.close(self.files[fd])
        self.saved, self.files = {}, {}


def no_input(prompt=""):
    """input() in a cell: fail at once, there is nobody to answer."""
    # IPython's error class, the one Jupyter raises; imported only when needed
    # (a cold worker does not import IPython for cells that do not use it).
    from IPython.core.error import StdinNotImplementedError
    raise StdinNotImplementedError(
        "input() was called, but the snapshot kernel has no stdin: "
        "cells cannot read input; set the value in code instead.")


def no_getpass(prompt="Password: ", stream=None):
    """getpass.getpass in a cell: fail at once (it would block on /dev/tty)."""
    no_input(prompt)
