"""Output capture for one cell: streams, displays and figures as nbformat v4 outputs.

A cell's outputs are collected by an `OutputCollector`, in the order the cell
produced them. Three sources feed it:

- Python-level writes to `sys.stdout` / `sys.stderr` (a proxy stream object);
- file-descriptor-level writes to fds 1 and 2 (C extensions, `os.system`,
  child processes), redirected into anonymous memory files that are read
  back before every Python-level output, so both kinds stay in order;
- displays: `display()`, the final expression's `execute_result`, and
  matplotlib figures.

When IPython is installed, formatting goes through a private, quiet
`InteractiveShell` so that `_repr_*_` methods, `IPython.display` objects and
`IPython.display.display` behave exactly as in Jupyter; without it a small
formatter of our own implements the same display protocol.

`capture(settings)` is the context manager the cell runner uses; everything it
changes (fds 1 and 2, `sys.stdout`, `sys.stderr`, builtins, pandas options,
the matplotlib backend) is put back when it exits.
"""

import base64
import builtins
import codecs
import contextlib
import ctypes
import fcntl
import getpass
import importlib.abc
import importlib.util
import io
import json
import os
import sys
import threading
import uuid

DEFAULTS = {
    "display.max_rows": 60,
    "display.max_columns": 20,
    "display.max_colwidth": 50,
    "display.figure_format": "png",
    "display.figure_dpi": 100,
    "display.max_output_bytes": 10_000_000,
    "display.max_mime_chars": 1_000_000,
}

# Backend name under which kernel/mpl_backend.py is loaded by matplotlib.
MPL_BACKEND = "module://kernel.worker.mpl_backend"

# MIME types whose value is base64 of binary data (one string, no newlines).
_BINARY_MIMES = ("image/png", "image/jpeg", "image/gif", "application/pdf")

# The `_repr_*_` methods of the display protocol, in Jupyter's order.
_REPR_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("application/pdf", "_repr_pdf_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
)

# When set (tests, or an operator's choice), IPython is never used even if installed.
DISABLE_IPYTHON = False

_active = None  # the OutputCollector of the running cell, if any
_shell = None  # the private IPython shell, created on first use
_lent = None  # the shell's own (user_ns, user_module) while a cell's namespace is lent to it
_PUNCH_BYTES = 1 << 20  # read fd-level output is released from memory in steps of this
_user_figure_formats = [None]  # set by %config InlineBackend.figure_format(s)


def setting(settings, key):
    """Return settings[key], falling back to this module's defaults."""
    if settings and key in settings:
        return settings[key]
    return DEFAULTS[key]


def _is_json_mime(mime):
    """True for MIME types whose nbformat value is JSON, not a string."""
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def _json_clean(value):
    """Return `value` as plain JSON types (unknown objects become their repr)."""
    try:
        return json.loads(json.dumps(value, default=repr))
    except (TypeError, ValueError):
        return repr(value)


def normalize_bundle(data, metadata):
    """Make a (data, metadata) pair nbformat-valid.

    Binary images become one base64 string without newlines; text MIME values
    become strings; JSON MIME values and metadata become plain JSON.
    """
    out = {}
    for mime, value in (data or {}).items():
        if not isinstance(mime, str) or value is None:
            continue
        if mime in _BINARY_MIMES:
            if isinstance(value, (bytes, bytearray, memoryview)):
                value = base64.b64encode(bytes(value)).decode("ascii")
            elif isinstance(value, str):
                value = "".join(value.split())
            else:
                continue
        elif _is_json_mime(mime):
            if isinstance(value, (bytes, str)):
                try:
                    value = json.loads(value)
                except ValueError:
                    value = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            value = _json_clean(value)
        elif isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", "replace")
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = "".join(value)
        elif not isinstance(value, str):
            value = str(value)
        out[mime] = value
    md = metadata if isinstance(metadata, dict) else {}
    md = _json_clean(md) if md else {}
    if not isinstance(md, dict):
        md = {}
    return out, md


def _entry_size(value):
    """Characters an output value takes (JSON values measured as JSON text)."""
    if isinstance(value, str):
        return len(value)
    return len(json.dumps(value))


def cap_bundle(data, max_chars):
    """Cut every MIME entry longer than `max_chars`, leaving a visible marker.

    Text is cut at the limit and ends with a note; binary images, SVG and JSON
    cannot be cut meaningfully, so they are dropped and the note goes into
    text/plain instead.
    """
    notes = []
    out = {}
    for mime, value in data.items():
        size = _entry_size(value)
        if size <= max_chars:
            out[mime] = value
            continue
        note = (f"[output truncated: {mime} was {size:,} characters, more than "
                f"display.max_mime_chars={max_chars:,}]")
        if isinstance(value, str) and mime.startswith("text/"):
            sep = "<br>" if mime == "text/html" else "\n"
            out[mime] = value[:max_chars] + sep + note
            if mime == "text/plain":
                continue
        notes.append(note)
    if notes:
        plain = out.get("text/plain")
        out["text/plain"] = "\n".join([plain, *notes] if plain else notes)
    return out


class OutputCollector:
    """The ordered outputs of one cell, with stream merging and size limits.

    `drain`, when set, is called before every new output so that output
    written at the file-descriptor level lands before it.
    """

    def __init__(self, settings=None, execution_count=None):
        """Start an empty list of outputs under the given settings."""
        self.settings = settings or {}
        self.execution_count = execution_count
        self.max_bytes = int(setting(settings, "display.max_output_bytes"))
        self.max_chars = int(setting(settings, "display.max_mime_chars"))
        self.outputs = []
        self.size = 0
        self.truncated = False
        self.drain = None
        self.namespace = None  # the cell's globals, lent to the IPython shell when it is used
        self.lock = threading.RLock()
        self._clear_pending = False

    # -- streams -------------------------------------------------------
    def stream(self, name, text, drain=True):
        """Append stream text, merged with the previous output if it is the same stream."""
        with self.lock:  # threads of the cell may print at the same time
            self._stream(name, text, drain)

    def _stream(self, name, text, drain):
        """stream() under the lock."""
        if drain and self.drain is not None:
            self.drain(False)
        if not text or self.truncated:
            return
        self._apply_pending_clear()
        room = self.max_bytes - self.size
        size = len(text) if text.isascii() else len(text.encode("utf-8", "replace"))
        if size > room:
            text = text[:max(room, 0)]
            self._append_stream(name, text)
            self._truncate()
            return
        self.size += size
        self._append_stream(name, text)

    def _append_stream(self, name, text):
        """Add text to the last output when it is the same stream, else start one."""
        if not text:
            return
        last = self.outputs[-1] if self.outputs else None
        if last is not None and last["output_type"] == "stream" and last["name"] == name:
            last["_chunks"].append(text)
        else:
            self.outputs.append({"output_type": "stream", "name": name, "_chunks": [text]})

    def _truncate(self):
        """Stop collecting and leave a visible marker at the end."""
        self.truncated = True
        self._append_stream("stderr", (
            f"\n[output truncated: the cell's output exceeded display.max_output_bytes="
            f"{self.max_bytes:,} bytes; the rest was dropped]\n"))

    # -- displays ------------------------------------------------------
    def display(self, data, metadata=None, transient=None, update=False,
                output_type="display_data"):
        """Append a display_data (or execute_result) output, or update a display by id."""
        with self.lock:
            self._display(data, metadata, transient, update, output_type)

    def _display(self, data, metadata, transient, update, output_type):
        """display() under the lock."""
        if self.drain is not None:
            self.drain()
        data, metadata = normalize_bundle(data, metadata)
        if not data:
            return
        data = cap_bundle(data, self.max_chars)
        display_id = (transient or {}).get("display_id") if isinstance(transient, dict) else None
        if update:
            # update_display: replace every earlier output of this display id.
            for out in self.outputs:
                if out.get("_display_id") == display_id and display_id is not None:
                    self.size += self._bundle_size(data) - self._bundle_size(out["data"])
                    out["data"], out["metadata"] = data, metadata
            return
        if self.truncated:
            return
        self._apply_pending_clear()
        size = self._bundle_size(data)
        if self.size + size > self.max_bytes:
            self._truncate()
            return
        self.size += size
        out = {"output_type": output_type, "data": data, "metadata": metadata}
        if output_type == "execute_result":
            out["execution_count"] = self.execution_count
        if display_id is not None:
            out["_display_id"] = display_id
        self.outputs.append(out)

    @staticmethod
    def _bundle_size(data):
        """Approximate bytes of a MIME bundle."""
        return sum(_entry_size(v) for v in data.values())

    def clear(self, wait=False):
        """clear_output(): drop what the cell showed so far (at the next output if wait)."""
        with self.lock:
            if self.drain is not None:
                self.drain()
            if wait:
                self._clear_pending = True
            else:
                self._clear_now()

    def _apply_pending_clear(self):
        """Carry out a clear_output(wait=True) now that new output arrives."""
        if self._clear_pending:
            self._clear_now()

    def _clear_now(self):
        """Forget every output collected so far."""
        self._clear_pending = False
        self.outputs = []
        self.size = 0

    def result(self):
        """Return the outputs as nbformat v4 dicts."""
        final = []
        for out in self.outputs:
            out = dict(out)
            if out["output_type"] == "stream":
                out["text"] = "".join(out.pop("_chunks"))
            out.pop("_display_id", None)
            final.append(out)
        return final


class StreamProxy(io.TextIOBase):
    """sys.stdout / sys.stderr while a cell runs: writes go to the active collector.

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
        """Nothing is buffered here."""

    @property
    def buffer(self):
        """A binary view (sys.stdout.buffer.write(b"...")), decoded as UTF-8."""
        return _BinaryProxy(self)

    def write(self, text):
        """Send text to the running cell's outputs."""
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        collector = _active
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


# -- formatting -------------------------------------------------------------

def _call_repr(obj, method, include=None, exclude=None):
    """Call one `_repr_*_` method, returning (data, metadata) or (None, None)."""
    fn = getattr(obj, method, None)
    if not callable(fn) or isinstance(obj, type):
        return None, None
    if method == "_repr_mimebundle_":
        result = fn(include=include, exclude=exclude)
    else:
        result = fn()
    if isinstance(result, tuple) and len(result) == 2:
        return result
    return result, None


def _own_format(obj, include=None, exclude=None):
    """The display protocol without IPython: (data, metadata) for `obj`."""
    data, md = {}, {}
    if _is_figure(obj):
        data, md = figure_bundle(obj, current_settings())
    else:
        bundle, bmd = _call_repr(obj, "_repr_mimebundle_", include, exclude)
        if isinstance(bundle, dict):
            data.update(bundle)
            md.update(bmd or {})
        for mime, method in _REPR_METHODS:
            if mime in data:
                continue
            value, vmd = _call_repr(obj, method)
            if value is not None:
                data[mime] = value
                if vmd is not None:
                    md[mime] = vmd
    if "text/plain" not in data:
        data["text/plain"] = repr(obj)
    if include:
        data = {k: v for k, v in data.items() if k in include}
        md = {k: v for k, v in md.items() if k in include}
    if exclude:
        data = {k: v for k, v in data.items() if k not in exclude}
        md = {k: v for k, v in md.items() if k not in exclude}
    return data, md


# Exact types whose Jupyter display is just their repr.
_PLAIN_TYPES = frozenset({int, float, bool, complex, str, bytes, type(None)})


def format_object(obj, include=None, exclude=None):
    """Return the (data, metadata) MIME bundle Jupyter would show for `obj`.

    An object with `_ipython_display_` displays itself and gives ({}, {}).
    """
    if type(obj) in _PLAIN_TYPES and not include and not exclude:
        # IPython shows these as their repr; skipping its formatter machinery saves ~0.5 ms.
        return {"text/plain": repr(obj)}, {}
    shell = get_shell()
    if shell is not None:
        return shell.display_formatter.format(obj, include=include, exclude=exclude)
    fn = getattr(obj, "_ipython_display_", None)
    if callable(fn) and not isinstance(obj, type):
        fn()
        return {}, {}
    return _own_format(obj, include, exclude)


def publish(data, metadata=None, transient=None, update=False):
    """Add a display to the running cell (nothing happens outside a cell)."""
    if _active is not None:
        _active.display(data, metadata, transient=transient, update=update)


class DisplayHandle:
    """What display(..., display_id=...) returns: update or re-display by id."""

    def __init__(self, display_id=None):
        """Make a handle for `display_id` (a new random id when None)."""
        self.display_id = display_id or uuid.uuid4().hex

    def __repr__(self):
        """Show the id, like IPython's handle."""
        return f"<{type(self).__name__} display_id={self.display_id}>"

    def display(self, obj, **kwargs):
        """Show `obj` as a new output with this id."""
        display(obj, display_id=self.display_id, **kwargs)

    def update(self, obj, **kwargs):
        """Replace what earlier outputs of this id show."""
        display(obj, display_id=self.display_id, update=True, **kwargs)


def display(*objs, include=None, exclude=None, metadata=None, transient=None,
            display_id=None, raw=False, clear=False, update=False, **kwargs):
    """Show objects as display_data outputs, as IPython's display() does.

    raw=True: the objects are MIME bundles already. display_id (True for a
    new one) tags the outputs and returns a DisplayHandle.
    """
    shell = get_shell()
    if shell is not None:
        from IPython.core.display_functions import display as ipy_display
        return ipy_display(*objs, include=include, exclude=exclude, metadata=metadata,
                           transient=transient, display_id=display_id, raw=raw,
                           clear=clear, update=update, **kwargs)
    if display_id is True:
        display_id = uuid.uuid4().hex
    if display_id:
        transient = dict(transient or {}, display_id=display_id)
    if clear:
        clear_output(wait=True)
    for obj in objs:
        if raw:
            publish(obj, metadata, transient=transient, update=update)
            continue
        data, md = format_object(obj, include, exclude)
        if not data:
            continue
        if metadata:
            md = dict(md or {}, **metadata)
        publish(data, md, transient=transient, update=update)
    if display_id:
        return DisplayHandle(display_id)
    return None


def clear_output(wait=False):
    """Clear the running cell's outputs so far (at the next output when wait=True)."""
    if _active is not None:
        _active.clear(wait)


# -- IPython ----------------------------------------------------------------

def ipython_available():
    """True when IPython can be imported and is not disabled."""
    if DISABLE_IPYTHON:
        return False
    try:
        import IPython  # noqa: F401
    except Exception:
        return False
    return True


def get_shell():
    """The private IPython shell, or None without IPython.

    Created on first use, once per process: the zygote makes it while it
    warms up, but a cold worker (see kernel/worker.py) leaves it to the
    first cell that displays a rich object, calls get_ipython() or uses a
    magic. Inside a cell it works on the cell's namespace.
    """
    global _shell
    if _shell is None and not DISABLE_IPYTHON and ipython_available():
        _shell = _shell or _make_shell()  # importing IPython just now may have made it
    if _shell is not None:
        _lend_namespace(_shell)
    return _shell


def _lend_namespace(shell):
    """Point the shell at the running cell's namespace (given back when the capture ends)."""
    global _lent
    if _lent is not None or _active is None or _active.namespace is None:
        return
    _lent = (shell.user_ns, shell.user_module)
    shell.user_ns = _active.namespace
    main = sys.modules.get("__main__")
    if getattr(main, "__dict__", None) is _active.namespace:
        shell.user_module = main


def _get_ipython():
    """get_ipython() in a cell of a process that has no shell yet: make it now."""
    return get_shell()


def _make_shell():
    """Create a quiet InteractiveShell that publishes displays into our collector."""
    import atexit
    import subprocess
    from traitlets.config import Config
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    class Publisher(DisplayPublisher):
        """Publishes IPython displays into the running cell's outputs."""

        def publish(self, data, metadata=None, source=None, *, transient=None,
                    update=False, **kwargs):
            """Add one display (or update one by display id)."""
            publish(data, metadata, transient=transient, update=update)

        def clear_output(self, wait=False):
            """IPython.display.clear_output()."""
            clear_output(wait)

    class Shell(InteractiveShell):
        """IPython's shell, used only for magics, `!cmd` and display formatting."""

        def enable_matplotlib(self, gui=None):
            """%matplotlib: figures are always shown inline here."""
            use_inline_backend()
            return "inline", MPL_BACKEND

        def enable_pylab(self, gui=None, import_all=True, welcome_message=False):
            """%pylab: inline figures, numpy and pyplot names."""
            use_inline_backend()
            exec("import numpy; import matplotlib; from matplotlib import pylab, mlab, pyplot\n"
                 "np = numpy\nplt = pyplot\n", self.user_ns)
            if import_all:
                exec("from pylab import *\nfrom numpy import *\n", self.user_ns)
            return "inline", MPL_BACKEND, False

        def system(self, cmd):
            """!cmd: run in a shell; its output is captured at the fd level, stderr merged as in Jupyter."""
            cmd = self.var_expand(cmd, depth=1)
            sys.stdout.flush()
            subprocess.call(cmd, shell=True, executable=os.environ.get("SHELL") or "/bin/sh",
                            stderr=subprocess.STDOUT)

        system_piped = system

        def reset(self, new_session=True, aggressive=False):
            """%reset: forget the user's names; the namespace gets none of IPython's."""
            for name in list(self.user_ns):
                if not (name.startswith("__") and name.endswith("__")):
                    del self.user_ns[name]

        def showtraceback(self, *args, **kwargs):
            """A failing formatter (a broken __repr__) is the cell's error here, not a printout."""
            exc = sys.exc_info()[1]
            if exc is not None:
                raise exc

        def run_line_magic(self, magic_name, line, _stack_depth=1):
            """Run a line magic with IPython's directory history in place (for %cd)."""
            with _hidden_names(self):
                return super().run_line_magic(magic_name, line, _stack_depth + 1)

        def run_cell_magic(self, magic_name, line, cell):
            """Run a cell magic with IPython's directory history in place."""
            with _hidden_names(self):
                return super().run_cell_magic(magic_name, line, cell)

    cfg = Config()
    cfg.HistoryManager.enabled = False
    main = sys.modules.get("__main__")
    saved_builtins = {k: builtins.__dict__[k] for k in ("display",) if k in builtins.__dict__}
    try:
        shell = Shell.instance(config=cfg, user_ns={}, display_pub_class=Publisher)
    finally:
        # The shell installs its own __main__ module; the worker's stays.
        if main is not None:
            sys.modules["__main__"] = main
        builtins.__dict__.pop("display", None)
        builtins.__dict__.update(saved_builtins)
    with contextlib.suppress(Exception):
        atexit.unregister(shell.atexit_operations)
    if not isinstance(shell.display_pub, Publisher):
        shell.display_pub = Publisher(shell=shell, parent=shell)
    shell._dir_history = [os.getcwd()]
    with contextlib.suppress(Exception):
        # `%config InlineBackend.figure_format = 'retina'` works as in Jupyter.
        from matplotlib_inline.config import InlineBackend
        inline = InlineBackend.instance(parent=shell)
        shell.configurables.append(inline)
        inline.observe(lambda change: _user_figure_formats.__setitem__(0, set(change["new"])),
                       names="figure_formats")
    fmt = shell.display_formatter.formatters
    fmt["image/png"].for_type_by_name("matplotlib.figure", "Figure", _figure_mime("image/png"))
    fmt["image/svg+xml"].for_type_by_name("matplotlib.figure", "Figure",
                                         _figure_mime("image/svg+xml"))
    return shell


@contextlib.contextmanager
def _hidden_names(shell):
    """Give IPython's own bookkeeping names to a magic, then take them out of the namespace."""
    ns = shell.user_ns
    added = []
    if "_dh" not in ns:
        ns["_dh"] = shell._dir_history
        added.append("_dh")
    try:
        yield
    finally:
        for name in added:
            if ns.get(name) is shell._dir_history:
                del ns[name]


def _figure_mime(mime):
    """An IPython formatter giving a figure's image in `mime` when that is the configured format."""
    def formatter(fig):
        """Render `fig` for IPython's display formatter (or give None for another format)."""
        data, md = figure_bundle(fig, current_settings())
        if mime not in data:
            return None
        return data[mime], md.get(mime)
    return formatter


# -- matplotlib -------------------------------------------------------------

def current_settings():
    """The running cell's settings (the defaults outside a cell)."""
    return _active.settings if _active is not None else None


def _is_figure(obj):
    """True for a matplotlib Figure, without importing matplotlib."""
    mod = sys.modules.get("matplotlib.figure")
    return mod is not None and isinstance(obj, mod.Figure)


def _png_size(png):
    """(width, height) in pixels from a PNG header."""
    if png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) >= 24:
        return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    return None, None


def figure_bundle(fig, settings=None):
    """The MIME bundle of a matplotlib figure in the configured format and dpi.

    An empty figure (no axes, no lines) shows only its text, as in Jupyter.
    """
    data = {"text/plain": repr(fig)}
    md = {}
    if not fig.axes and not getattr(fig, "lines", None):
        return data, md
    fmt = setting(settings, "display.figure_format")
    chosen = _user_figure_formats[0]
    if chosen:  # the cell's %config InlineBackend wins over the server's setting
        fmt = "retina" if chosen & {"retina", "png2x"} else "svg" if "svg" in chosen else "png"
    # The figure's own dpi, as in Jupyter: display.figure_dpi is the default of new
    # figures (rcParams["figure.dpi"]), and plt.figure(dpi=...) still wins.
    dpi = fig.dpi
    buf = io.BytesIO()
    if fmt == "svg":
        fig.canvas.print_figure(buf, format="svg", bbox_inches="tight", dpi=dpi)
        data["image/svg+xml"] = buf.getvalue().decode("utf-8")
        return data, md
    scale = 2 if fmt == "retina" else 1
    fig.canvas.print_figure(buf, format="png", bbox_inches="tight", dpi=dpi * scale)
    png = buf.getvalue()
    data["image/png"] = base64.b64encode(png).decode("ascii")
    width, height = _png_size(png)
    if width:
        md["image/png"] = {"width": width // scale, "height": height // scale}
    return data, md


def use_inline_backend():
    """Make pyplot draw with our inline backend (figures shown at show() and cell end)."""
    mpl = sys.modules.get("matplotlib")
    if mpl is None:
        return
    current = mpl.rcParams._get("backend")
    if current == MPL_BACKEND:
        return
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].switch_backend(MPL_BACKEND)
    else:
        mpl.rcParams["backend"] = MPL_BACKEND


_dpi_applied = [None]


def _prepare_matplotlib(settings=None):
    """Select the inline backend (unless the user chose their own) and the default dpi."""
    mpl = sys.modules.get("matplotlib")
    if mpl is None:
        return
    dpi = setting(settings, "display.figure_dpi")
    if _dpi_applied[0] != dpi:
        # Once per setting value, so a cell's own rcParams change is kept afterwards.
        with contextlib.suppress(Exception):
            mpl.rcParams["figure.dpi"] = dpi
            _dpi_applied[0] = dpi
    current = mpl.rcParams._get("backend")
    if not isinstance(current, str) or current.lower() in ("agg", "module://matplotlib_inline.backend_inline"):
        with contextlib.suppress(Exception):
            use_inline_backend()
        mpl.interactive(True)


def show_figures(close=True):
    """Display every open pyplot figure, then close them (plt.show() and cell end)."""
    pylab_helpers = sys.modules.get("matplotlib._pylab_helpers")
    if pylab_helpers is None:
        return
    managers = pylab_helpers.Gcf.get_all_fig_managers()
    try:
        for manager in managers:
            fig = manager.canvas.figure
            data, md = figure_bundle(fig, current_settings())
            publish(data, md)
    finally:
        if close and managers:
            sys.modules["matplotlib.pyplot"].close("all")


# -- pandas -----------------------------------------------------------------

_pandas_done = set()


def configure_pandas(settings):
    """Apply Jupyter's pandas display limits (overridable by the display.* settings)."""
    pd = sys.modules.get("pandas")
    if pd is None or not hasattr(pd, "set_option"):
        return
    key = (id(pd), setting(settings, "display.max_rows"), setting(settings, "display.max_columns"),
           setting(settings, "display.max_colwidth"))
    if key in _pandas_done:
        return
    with contextlib.suppress(Exception):
        pd.set_option("display.max_rows", setting(settings, "display.max_rows"))
        pd.set_option("display.max_columns", setting(settings, "display.max_columns"))
        pd.set_option("display.max_colwidth", setting(settings, "display.max_colwidth"))
        _pandas_done.clear()
        _pandas_done.add(key)


# -- the capture context ----------------------------------------------------

class StdinNotImplementedError(RuntimeError):
    """input() in a cell: the kernel has no stdin."""


def _stdin_error_class():
    """IPython's StdinNotImplementedError when installed (same name as in Jupyter), else ours."""
    if ipython_available():
        with contextlib.suppress(Exception):
            from IPython.core.error import StdinNotImplementedError as cls
            return cls
    return StdinNotImplementedError


def _no_getpass(prompt="Password: ", stream=None):
    """getpass.getpass replacement: no terminal to ask on (it would block on /dev/tty)."""
    _no_input(prompt)


def _no_input(prompt=""):
    """input() replacement: fail at once, the cell cannot be answered."""
    raise _stdin_error_class()(
        "input() was called, but the snapshot kernel has no stdin: "
        "cells cannot read input; set the value in code instead.")


@contextlib.contextmanager
def capture(settings=None, execution_count=None, namespace=None):
    """Capture everything a cell shows; yield the OutputCollector.

    Sets up fd and sys-level capture, `display` / `input` / `get_ipython` in
    builtins, pandas options and the inline matplotlib backend, and undoes all
    of it on exit (the worker may fork again right after).
    """
    global _active, _lent
    collector = OutputCollector(settings, execution_count)
    collector.namespace = namespace
    configure_pandas(settings)
    _prepare_matplotlib(settings)
    saved_sys = (sys.stdout, sys.stderr)
    saved_builtins = {k: builtins.__dict__[k] for k in ("display", "input", "get_ipython")
                      if k in builtins.__dict__}
    fds = None
    saved_getpass = None
    try:
        fds = FdCapture(collector)
        collector.drain = fds.drain
        STDOUT.fallback, STDERR.fallback = saved_sys
        sys.stdout, sys.stderr = STDOUT, STDERR
        builtins.display = display
        builtins.input = _no_input
        saved_getpass = getpass.getpass
        getpass.getpass = _no_getpass
        _active = collector
        if _shell is not None:
            _lend_namespace(_shell)
            builtins.get_ipython = _shell.get_ipython
        elif not DISABLE_IPYTHON:
            builtins.get_ipython = _get_ipython
        yield collector
    finally:
        _active = None
        if fds is not None:
            # Output written at the fd level after the last Python write still belongs here.
            _active = collector
            fds.restore()
            _active = None
        sys.stdout, sys.stderr = saved_sys
        if saved_getpass is not None:
            getpass.getpass = saved_getpass
        STDOUT.fallback = STDERR.fallback = None
        for name in ("display", "input", "get_ipython"):
            if name in saved_builtins:
                builtins.__dict__[name] = saved_builtins[name]
            else:
                builtins.__dict__.pop(name, None)
        if _lent is not None:
            _shell.user_ns, _shell.user_module = _lent
            _lent = None


def pre_run_events(source):
    """IPython's pre_execute / pre_run_cell events (autoreload and other extensions use them).

    Returns what post_run_events needs, or None without IPython.
    """
    shell = _shell  # without a shell yet, no extension can have registered for events
    if shell is None:
        return None
    from IPython.core.interactiveshell import ExecutionInfo
    info = ExecutionInfo(source, False, False, True, None)
    shell.events.trigger("pre_execute")
    shell.events.trigger("pre_run_cell", info)
    return info


def post_run_events(info, source, error=None, result=None):
    """IPython's post_execute / post_run_cell events, after the cell ran.

    Also when the cell itself made the shell (`%load_ext` in a cold
    worker): an extension it loaded sees the cell end, as in Jupyter.
    """
    shell = _shell
    if shell is None:
        return
    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult
    outcome = ExecutionResult(info or ExecutionInfo(source, False, False, True, None))
    outcome.error_in_exec = error
    outcome.result = result
    shell.events.trigger("post_execute")
    shell.events.trigger("post_run_cell", outcome)


def _stop_script_loop():
    """Stop the event-loop thread that %%bash / %%script start, so the worker may fork."""
    if _shell is None:
        return
    magics = _shell.magics_manager.registry.get("ScriptMagics")
    loop = getattr(magics, "event_loop", None)
    if loop is None:
        return
    runner = [t for t in threading.enumerate()
              if getattr(t, "_target", None) == loop.run_forever]
    loop.call_soon_threadsafe(loop.stop)
    for thread in runner:
        thread.join(5)
    if not loop.is_running():
        loop.close()
    magics.event_loop = None


def finish_cell(collector):
    """End of a cell, inside the capture: every open figure shown (then closed), helper threads stopped."""
    configure_pandas(collector.settings)
    try:
        show_figures(close=True)
    finally:
        _stop_script_loop()


def warm():
    """Import and build what cells will need, once per process (call in the zygote)."""
    get_shell()
    with contextlib.suppress(Exception):
        import matplotlib  # noqa: F401
        _prepare_matplotlib()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then` right after module `name` is first imported, then leaves sys.meta_path."""

    def __init__(self, name, then):
        """Wait for `name`."""
        self.name = name
        self.then = then

    def find_spec(self, fullname, path=None, target=None):
        """Find `name` with the other finders and wrap its loader's exec_module."""
        if fullname != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # a loader shared by many modules: leave it alone
        run = loader.exec_module

        def exec_module(module):
            """Run the module, then `then`."""
            run(module)
            self.then()

        loader.exec_module = exec_module
        return spec


# What a worker needs as soon as these are imported: Jupyter's pandas limits,
# the inline figure backend, and the shell that IPython.display functions use.
_ON_IMPORT = {
    "pandas": lambda: configure_pandas(current_settings()),
    "matplotlib": lambda: _prepare_matplotlib(current_settings()),
    "IPython": lambda: get_shell(),
}


def watch_imports():
    """Once per worker process, before any cell: set each of _ON_IMPORT up now if
    imported already, else right after a cell (or a restore) first imports it.

    So a cold worker (kernel/worker.py) need not import them before its first
    cell, and a cell that imports pandas, matplotlib or IPython.display
    finds them set up as in Jupyter.
    """
    for name, then in _ON_IMPORT.items():
        if name in sys.modules:
            then()
        else:
            sys.meta_path.insert(0, _AfterImport(name, then))
