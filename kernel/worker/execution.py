"""Compiling and running one notebook cell, with Jupyter's semantics.

`compile_cell` turns a cell's source into code objects: IPython syntax
(magics, `!cmd`) is transformed by IPython's input transformer, the last
expression statement is split off so its value can be shown, and the source
is registered in `linecache` under a file name unique to this execution so
tracebacks show the cell's lines. It never raises for bad user code: a
SyntaxError becomes the CompiledCell's `.error`.

`run_cell` runs the code objects in the worker's namespace under
kernel.worker.capture and returns (outputs, error): nbformat v4 outputs in
the order the cell produced them, and the error dict {ename, evalue,
traceback} (or None). Every BaseException the cell raises is reported, never
propagated. Given a sink, it also streams each output as it is produced.
"""

import ast
import asyncio
import contextlib
import inspect
import io
import itertools
import linecache
import os
import re
import signal
import tokenize
import types

from snapkernel.kernel.worker import capture

_KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))
_counter = itertools.count(1)
# File names of cells look like "<cell In[3] 1234-7>": the "In[3]" part is read
# back when formatting tracebacks, even in another process after a restore.
_CELL_FILE = re.compile(r"^<cell In\[(\d*)\] [^>]*>$")

# Sources without these never change under IPython's transformer: magics (%), shell
# escapes (!), help (?), an indented first line, pasted >>> / In [1]: prompts.
_MAYBE_IPYTHON = re.compile(r"[%!?]|\A[ \t]|^>>>|^\s*\.\.\.|^In \[", re.MULTILINE)

_TOP_LEVEL_AWAIT = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)

# Sources compiled in this process -> ((size, lines) of the Python source as linecache
# holds them, code objects, uses_ipython, has_result), oldest first: a cell run again
# (a notebook's next run, a chain of the same cell) skips IPython's transformer, the
# parse and the compile.
_compiled = {}
_COMPILED_MAX = 256


class CompiledCell:
    """A cell ready to run: its code objects, or the error that stops it."""

    def __init__(self, source, execution_count, filename, codes=(), error=None,
                 uses_ipython=False, has_result=False):
        """Hold what compile_cell produced."""
        self.source = source
        self.execution_count = execution_count
        self.filename = filename
        self.codes = list(codes)
        self.error = error
        self.uses_ipython = uses_ipython
        # True when the last code object is an expression whose value is shown.
        self.has_result = has_result

    def __repr__(self):
        """Short description for logs."""
        state = "error" if self.error else f"{len(self.codes)} code objects"
        return f"<CompiledCell In[{self.execution_count}] {state}>"


def cell_filename(execution_count):
    """A file name unique to one execution of a cell (within and across processes)."""
    return f"<cell In[{execution_count}] {os.getpid()}-{next(_counter)}>"


def _register_source(filename, source):
    """Make the cell's lines visible to linecache (tracebacks, inspect.getsource)."""
    lines = source.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    # mtime None: checkcache() never drops entries that have no file on disk.
    linecache.cache[filename] = (len(source), None, lines, filename)


def _transform(source):
    """Apply IPython's input transformer; return (python_source, uses_ipython)."""
    if not _MAYBE_IPYTHON.search(source):
        # No character IPython's transformer acts on: plain Python, skip it (~0.2 ms).
        return source, "get_ipython" in source
    from IPython.core.inputtransformer2 import TransformerManager
    try:
        transformed = TransformerManager().transform_cell(source)
    except SyntaxError:
        # Let Python's own parser report the error with a caret.
        return source, False
    return transformed, "get_ipython" in transformed


def _ends_with_semicolon(source):
    """True when the cell's last code token is ';' (Jupyter then shows no result)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return source.rstrip().endswith(";")
    skip = {tokenize.ENDMARKER, tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT,
            tokenize.INDENT, tokenize.DEDENT}
    for tok in reversed(tokens):
        if tok.type in skip:
            continue
        return tok.type == tokenize.OP and tok.string == ";"
    return False


def compile_cell(source, execution_count):
    """Compile a cell's source; never raises for the user's mistakes (see CompiledCell.error).

    A source compiled before in this process (or the process it was forked
    from) is not parsed again: its code objects are copied under this
    execution's file name.
    """
    known = _compiled.get(source)
    if known is not None:
        (size, lines), codes, uses_ipython, has_result = known
        filename = cell_filename(execution_count)
        linecache.cache[filename] = (size, None, lines, filename)
        return CompiledCell(source, execution_count, filename,
                            codes=[_renamed(code, filename) for code in codes],
                            uses_ipython=uses_ipython, has_result=has_result)
    try:
        cell = _compile(source, execution_count)
    except Exception as exc:  # e.g. a transformer bug or a recursion limit: report, don't raise
        return CompiledCell(source, execution_count, cell_filename(execution_count),
                            error=error_dict(exc, execution_count))
    if cell.error is None:
        if len(_compiled) >= _COMPILED_MAX:
            _compiled.pop(next(iter(_compiled)))
        size, _, lines, _ = linecache.cache[cell.filename]
        _compiled[source] = ((size, lines), cell.codes, cell.uses_ipython, cell.has_result)
    return cell


def _renamed(code, filename):
    """`code` and the code nested in it, under another file name."""
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c
                   for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _compile(source, execution_count):
    """compile_cell's work; may raise on internal failures."""
    filename = cell_filename(execution_count)
    python_source, uses_ipython = _transform(source)
    _register_source(filename, python_source)
    try:
        tree = ast.parse(python_source, filename=filename, mode="exec",
                         type_comments=False, feature_version=None)
    except SyntaxError:
        try:
            # Top-level await is allowed, as in Jupyter; retry with that flag.
            tree = compile(python_source, filename, "exec",
                           flags=ast.PyCF_ONLY_AST | _TOP_LEVEL_AWAIT, dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            return CompiledCell(source, execution_count, filename,
                                error=syntax_error(exc, execution_count), uses_ipython=uses_ipython)
    except ValueError as exc:  # e.g. null bytes in the source
        return CompiledCell(source, execution_count, filename,
                            error=error_dict(exc, execution_count), uses_ipython=uses_ipython)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(python_source):
        last = tree.body.pop()
    flags = _TOP_LEVEL_AWAIT
    try:
        codes = []
        if tree.body:
            codes.append(compile(tree, filename, "exec", flags=flags, dont_inherit=True))
        if last is not None:
            expr = ast.Expression(body=last.value)
            ast.copy_location(expr, last)
            codes.append(compile(expr, filename, "eval", flags=flags, dont_inherit=True))
    except (SyntaxError, ValueError) as exc:
        err = syntax_error(exc, execution_count) if isinstance(exc, SyntaxError) \
            else error_dict(exc, execution_count)
        return CompiledCell(source, execution_count, filename, error=err, uses_ipython=uses_ipython)
    return CompiledCell(source, execution_count, filename, codes=codes,
                        uses_ipython=uses_ipython, has_result=last is not None)


# -- errors -----------------------------------------------------------------

_RULE = "-" * 75
_SHOWN_REPEATS = 3  # identical consecutive frames shown before they are counted instead


def _cell_label(filename):
    """'Cell In[3]' for a cell's file name, else None."""
    match = _CELL_FILE.match(filename or "")
    return f"Cell In[{match.group(1)}]" if match else None


def _is_kernel_frame(filename):
    """True for frames of the worker itself (left out of tracebacks)."""
    return bool(filename) and os.path.abspath(filename).startswith(_KERNEL_DIR + os.sep)


def _context(filename, lineno, before=2, after=2):
    """Numbered source lines around `lineno`, the current one marked '---->'."""
    lines = linecache.getlines(filename)
    if not lines or not lineno:
        return ""
    first, last = max(1, lineno - before), min(len(lines), lineno + after)
    out = []
    width = len(str(last))
    for n in range(first, last + 1):
        mark = "---->" if n == lineno else "     "
        out.append(f"{mark} {n:>{width}} {lines[n - 1].rstrip()}")
    return "\n".join(out) + "\n"


def _frame_header(frame, filename, lineno, name):
    """The 'Cell In[3], line 2, in f()' header of one traceback entry."""
    label = _cell_label(filename)
    where = label if label else f"File {_short_path(filename)}:{lineno}"
    if label:
        where += f", line {lineno}"
    if name != "<module>":
        try:
            args = inspect.formatargvalues(*inspect.getargvalues(frame), formatvalue=lambda v: "")
            args = re.sub(r"=(?=[,)])", "", args)
        except Exception:
            args = "(...)"
        where += f", in {name}{args}"
    return where


def _short_path(path):
    """A path with the home directory written as ~, as IPython does."""
    home = os.path.expanduser("~")
    if home and home != "/" and path.startswith(home + os.sep):
        return "~" + path[len(home):]
    return path


def _exception_only(exc):
    """The last line(s): 'ZeroDivisionError: division by zero' (+ notes)."""
    name = type(exc).__name__
    text = str(exc)
    lines = [f"{name}: {text}" if text else name]
    for note in getattr(exc, "__notes__", None) or []:
        lines.append(str(note))
    return "\n".join(lines)


def _format_one(exc, execution_count):
    """Traceback chunks of one exception (without its cause or context)."""
    chunks = [_RULE, f"{type(exc).__name__:<42}Traceback (most recent call last)"]
    tb = exc.__traceback__
    last_key, repeats = None, 0
    while tb is not None:
        frame, lineno = tb.tb_frame, tb.tb_lineno
        filename = frame.f_code.co_filename
        tb = tb.tb_next
        if _is_kernel_frame(filename):
            continue
        # Deep recursion: show a frame a few times, then one line counting the rest.
        key = (filename, lineno, frame.f_code.co_name)
        repeats = repeats + 1 if key == last_key else 1
        last_key = key
        if repeats > _SHOWN_REPEATS:
            if repeats == _SHOWN_REPEATS + 1:
                chunks.append(None)
            chunks[-1] = (key, repeats - _SHOWN_REPEATS)
            continue
        header = _frame_header(frame, filename, lineno, frame.f_code.co_name)
        chunks.append(header + "\n" + _context(filename, lineno))
    chunks = [c if isinstance(c, str) else
              f"    [... skipping similar frames: {c[0][2]} at line {c[0][1]} ({c[1]} times)]"
              for c in chunks]
    if isinstance(exc, SyntaxError) and exc.filename:
        chunks.append(_syntax_block(exc))
    chunks.append(_exception_only(exc))
    return chunks


def _syntax_block(exc):
    """The 'Cell In[3], line 1' / source line / caret block of a SyntaxError."""
    label = _cell_label(exc.filename)
    where = f"{label}, line {exc.lineno}" if label else f"File {exc.filename}:{exc.lineno}"
    text = exc.text
    if text is None and exc.filename and exc.lineno:
        text = linecache.getline(exc.filename, exc.lineno)
    block = f"  {where}\n"
    if text:
        stripped = text.rstrip("\n")
        indent = len(stripped) - len(stripped.lstrip())
        block += f"    {stripped.strip()}\n"
        if exc.offset:
            caret_start = max(exc.offset - 1 - indent, 0)
            end = getattr(exc, "end_offset", None)
            width = 1
            if end and exc.end_lineno == exc.lineno and end > exc.offset:
                width = end - exc.offset
            block += "    " + " " * caret_start + "^" * width + "\n"
    return block


def syntax_error(exc, execution_count):
    """The error dict of a SyntaxError in the cell itself: the line and the caret."""
    label = _cell_label(exc.filename)
    where = f"{label}, line {exc.lineno}" if label else f"line {exc.lineno}"
    evalue = f"{exc.msg} ({where})" if exc.lineno else str(exc.msg)
    return {
        "ename": type(exc).__name__,
        "evalue": evalue,
        "traceback": [_syntax_block(exc) + f"{type(exc).__name__}: {exc.msg}"],
    }


def error_dict(exc, execution_count=None):
    """The nbformat error dict of an exception: ename, evalue and IPython-like traceback lines."""
    chunks = []
    seen = set()
    chain = []
    cur = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append(cur)
        if cur.__cause__ is not None:
            cur = cur.__cause__
        elif cur.__context__ is not None and not cur.__suppress_context__:
            cur = cur.__context__
        else:
            cur = None
    for i, item in enumerate(reversed(chain)):
        if i:
            prev = list(reversed(chain))[i - 1]
            if item.__cause__ is prev:
                chunks.append("\nThe above exception was the direct cause of the following exception:\n")
            else:
                chunks.append("\nDuring handling of the above exception, another exception occurred:\n")
        chunks.extend(_format_one(item, execution_count))
    try:
        evalue = str(exc)
    except Exception:
        evalue = f"<unprintable {type(exc).__name__} object>"
    if isinstance(exc, SyntaxError) and _cell_label(exc.filename):
        return syntax_error(exc, execution_count)
    return {"ename": type(exc).__name__, "evalue": evalue, "traceback": chunks}


# -- running ----------------------------------------------------------------

def _run_code(code, namespace):
    """exec/eval one code object, awaiting it when it uses top-level await."""
    if code.co_flags & inspect.CO_COROUTINE:
        coro = eval(code, namespace)
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(coro)
        finally:
            loop.close()
            asyncio.set_event_loop(None)
    return eval(code, namespace)


@contextlib.contextmanager
def _sigint_deferred():
    """Hold off SIGINT while the capture is being undone, so the worker is always restored."""
    hit = []
    try:
        old = signal.signal(signal.SIGINT, lambda *a: hit.append(1))
    except (ValueError, OSError):  # not the main thread: nothing to defer
        yield hit
        return
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, old)


def run_cell(cell, namespace, execution_count, settings, sink=None, events=True):
    """Run a compiled cell in `namespace`; return (outputs, error) and never raise.

    `outputs` are nbformat v4 output dicts in the order the cell produced
    them; `error` is None or {ename, evalue, traceback}. KeyboardInterrupt
    (the worker's interrupt), SystemExit and any other BaseException become
    the error; the outputs produced before it are kept.

    `sink`, if given, is called with each output item as the cell produces
    it, in order, one call at a time: {"type": "output", "output": o} where
    o is a stream output holding only the newly written text, a
    display_data or execute_result (with "transient": {"display_id"} when
    it has one), or an update_display_data with its "transient"; and
    {"type": "clear_output", "wait": bool}. The error is not streamed: it
    comes with the result.

    events=False (a worker's throwaway warm-up cell): IPython's cell events are
    not triggered, so that no extension or callback of the user's sees the cell.
    """
    if cell.error is not None:
        return [], cell.error
    error = None
    try:
        manager = capture.capture(settings, execution_count, namespace, sink)
        collector = manager.__enter__()
    except BaseException as exc:  # the capture could not be set up: report, run nothing
        return [], _safe_error(exc, execution_count)
    info = value = failure = None
    try:
        try:
            if events:
                info = capture.pre_run_events(cell.source)
            for code in cell.codes:
                value = _run_code(code, namespace)
            if cell.has_result and value is not None:
                data, md = capture.format_object(value)
                if data:
                    collector.display(data, md, output_type="execute_result")
        except BaseException as exc:  # the cell's error, whatever it is
            failure = exc
            error = _safe_error(exc, execution_count)
        if events:
            capture.post_run_events(info, cell.source, failure, value)
    except BaseException as exc:  # an interrupt just after the cell, or a failing hook
        if error is None:
            error = _safe_error(exc, execution_count)
    finally:
        # An interrupt now must not leave fds or sys.stdout redirected.
        with _sigint_deferred():
            try:
                capture.finish_cell(collector)
            except BaseException as exc:
                if error is None:
                    error = _safe_error(exc, execution_count)
            with contextlib.suppress(BaseException):
                manager.__exit__(None, None, None)
            result = collector.result()
            error = _cap_error(error, settings["display.max_output_bytes"])
    return result, error


def _cap_error(error, limit):
    """Cut an enormous error to `limit` bytes of text in all (UTF-8, its message and its
    traceback together, with visible markers): the message takes at most half, and the
    traceback's entries what is left, in order (its last entry repeats the message)."""
    if error is None:
        return None
    left = [limit]

    def cut(text, most):
        """`text` cut to `most` bytes, the budget spent."""
        head = text[:most]  # a character is at least one byte: no need to encode the rest
        size = len(head.encode("utf-8", "surrogatepass"))
        if len(text) == len(head) and size <= most:
            left[0] -= size
            return text
        head = head.encode("utf-8", "surrogatepass")[:most].decode("utf-8", "ignore")
        left[0] -= most
        return head + f"\n[truncated: the error's text went past display.max_output_bytes=" \
                      f"{limit:,}]"

    evalue = cut(error["evalue"], limit // 2)
    traceback = []
    for n, entry in enumerate(error["traceback"]):
        if left[0] <= 0:
            traceback.append(f"[truncated: {len(error['traceback']) - n:,} more traceback "
                             f"entries]")
            break
        traceback.append(cut(entry, left[0]))
    return {"ename": error["ename"], "evalue": evalue, "traceback": traceback}


def _safe_error(exc, execution_count):
    """error_dict that cannot itself fail (a broken __str__ must not escape)."""
    try:
        return error_dict(exc, execution_count)
    except BaseException:
        return {"ename": type(exc).__name__, "evalue": "",
                "traceback": [f"{type(exc).__name__} (traceback could not be formatted)"]}
