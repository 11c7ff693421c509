"""Compiling and running cells (kernel/cell.py): results, errors, interrupts, IPython syntax.

Cells run in a real forked process through compile_cell/run_cell, exactly
as the worker calls them; every output is validated against nbformat.
"""

import os
import types

os.environ.setdefault("MPLBACKEND", "Agg")

import IPython.core.interactiveshell  # noqa: E402,F401

from cellrun import outputs_of, run_cells, texts  # noqa: E402
from kernel.worker import runner as kcell  # noqa: E402


def no_ipython(kout):
    """Harness setup: run as if IPython were not installed."""
    kout.DISABLE_IPYTHON = True


def run(*cells, settings=None, setup=None):
    """Run cells in one forked process; return the per-cell results (outputs validated)."""
    results = run_cells(cells, settings, setup)
    for r in results:
        outputs_of(r)
        assert r["restored"], r["restore_diff"]
    return results


def test_execute_result_has_execution_count_and_follows_jupyter_rules():
    """Last expression shown with its count; not None; not after ';' (even before a comment)."""
    r = run("1 + 1", "None", "x = 3\nx;", "x;  # quiet", "x  # shown", "print('a'); 5; print('b')")
    assert r[0]["outputs"] == [{"output_type": "execute_result", "data": {"text/plain": "2"},
                                "metadata": {}, "execution_count": 1}]
    assert r[1]["outputs"] == [] and r[2]["outputs"] == [] and r[3]["outputs"] == []
    assert r[4]["outputs"][0]["execution_count"] == 5
    assert texts(r[5]["outputs"]) == [("stdout", "a\nb\n")]


def test_compile_cell_api():
    """codes are the top-level code objects; a final expression is its own code object."""
    c = kcell.compile_cell("def f():\n    return g()\nf", 3)
    assert c.error is None and not c.uses_ipython
    assert len(c.codes) == 2 and all(isinstance(x, types.CodeType) for x in c.codes)
    nested = [k for k in c.codes[0].co_consts if isinstance(k, types.CodeType)]
    assert nested and "g" in nested[0].co_names
    assert kcell.compile_cell("x = 1", 4).codes[0].co_filename != kcell.compile_cell("x = 1", 4).codes[0].co_filename
    magic = kcell.compile_cell("%time x = 1", 5)
    assert magic.error is None and magic.uses_ipython


def test_traceback_shows_cell_lines_and_hides_kernel_frames():
    """Tracebacks name Cell In[n] with the cell's line numbers and source, like IPython."""
    r = run("def ratio(a, b):\n    return a / b", "x = 1\nratio(x, 0)")
    err = r[1]["error"]
    assert err["ename"] == "ZeroDivisionError" and err["evalue"] == "division by zero"
    text = "\n".join(err["traceback"])
    assert "Cell In[2], line 2" in text and "----> 2 ratio(x, 0)" in text
    assert "Cell In[1], line 2, in ratio(a, b)" in text and "----> 2     return a / b" in text
    assert "kernel/cell.py" not in text and "kernel/outputs.py" not in text
    assert text.rstrip().endswith("ZeroDivisionError: division by zero")


def test_syntax_error_shows_line_and_caret():
    """A SyntaxError is an error result with the line and a caret, not an exception."""
    c = kcell.compile_cell("x = 1\ny = (2 +\n", 7)
    assert c.error is not None and c.codes == []
    assert c.error["ename"] == "SyntaxError"
    r = run("for i in range(3)\n    print(i)")
    err = r[0]["error"]
    assert err["ename"] == "SyntaxError" and err["evalue"].startswith("expected ':'")
    tb = "\n".join(err["traceback"])
    assert "Cell In[1], line 1" in tb and "for i in range(3)" in tb and "^" in tb
    assert run("if True:\nprint(1)")[0]["error"]["ename"] == "IndentationError"


def test_keyboard_interrupt_keeps_outputs_and_process_goes_on():
    """SIGINT during a cell becomes a KeyboardInterrupt error; earlier output is kept."""
    r = run("import os, signal, time\nprint('before')\nos.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(5)\nprint('never')", "print('next cell runs')")
    assert r[0]["error"]["ename"] == "KeyboardInterrupt"
    assert texts(r[0]["outputs"]) == [("stdout", "before\n")]
    assert texts(r[1]["outputs"]) == [("stdout", "next cell runs\n")]


def test_system_exit_and_base_exceptions_are_errors():
    """sys.exit() and custom BaseExceptions are reported, not propagated."""
    r = run("import sys\nsys.exit(3)", "class Boom(BaseException):\n    pass\nraise Boom('b')",
            "class Bad:\n    def __repr__(self):\n        raise RuntimeError('no repr')\nBad()",
            "print('alive')")
    assert r[0]["error"]["ename"] == "SystemExit" and r[0]["error"]["evalue"] == "3"
    assert r[1]["error"]["ename"] == "Boom"
    assert r[2]["error"]["ename"] == "RuntimeError"
    assert texts(r[3]["outputs"]) == [("stdout", "alive\n")]


def test_input_fails_at_once_with_a_clear_error():
    """input() raises immediately: there is no stdin."""
    r = run("input('name? ')", "import getpass\ngetpass.getpass()")
    for res in r:
        assert res["error"]["ename"] == "StdinNotImplementedError"
        assert "no stdin" in res["error"]["evalue"]


def test_chained_exceptions_show_both():
    """'During handling...' chains are shown as IPython shows them."""
    (r,) = run("try:\n    {}['k']\nexcept KeyError as e:\n    raise ValueError('wrapped') from e")
    tb = "\n".join(r["error"]["traceback"])
    assert "KeyError" in tb and "direct cause" in tb and r["error"]["ename"] == "ValueError"


def test_namespace_holds_only_user_names():
    """No display, get_ipython, In/Out or IPython bookkeeping leaks into globals()."""
    r = run("%cd /tmp\n!true\n%time a = 1", "b = [k for k in globals() if not k.startswith('__')]")
    assert r[0]["error"] is None, r[0]["error"]
    assert r[1]["user_names"] == ["a", "b"]


def test_reset_magic_clears_user_names_only():
    """%reset -f forgets the user's variables and adds none of IPython's."""
    r = run("a = 1\nb = 2", "%reset -f", "c = 3")
    assert r[1]["error"] is None, r[1]["error"]
    assert r[1]["user_names"] == [] and r[2]["user_names"] == ["c"]


def test_ipython_magics_work():
    """%time, %%time, %timeit, !cmd, x = !cmd, %cd, %matplotlib inline, %pip."""
    r = run("%matplotlib inline\n%time t = sum(range(10))\nt",
            "%%time\nu = 2\nu * 3",
            "%timeit -n 1 -r 1 pass",
            "!echo shell $t\nout = !echo captured\nout",
            "%cd /tmp",
            "import matplotlib.pyplot as plt\nplt.plot([1]);",
            "%pip --version")
    for res in r:
        assert res["error"] is None, res["error"]
    assert all(res["uses_ipython"] for i, res in enumerate(r) if i != 5)
    assert "Wall time" in r[0]["outputs"][0]["text"]
    assert r[0]["outputs"][-1]["data"]["text/plain"] == "45"
    assert r[1]["outputs"][-1]["data"]["text/plain"] == "6"
    assert "per loop" in r[2]["outputs"][0]["text"]
    assert r[3]["outputs"][0]["text"] == "shell 45\n"
    assert r[3]["outputs"][1]["data"]["text/plain"] == "['captured']"
    assert r[4]["outputs"][0]["text"] == "/tmp\n"
    assert r[5]["outputs"][0]["data"]["image/png"]
    assert r[6]["outputs"][0]["text"].startswith("pip ")


def test_magics_without_ipython_name_the_magic_and_the_fix():
    """Without IPython, a magic gives an error naming it and saying to install ipython."""
    r = run("%timeit sum([1])", "!ls", "x = 1\nx", setup=no_ipython)
    for res in r[:2]:
        assert res["error"]["ename"] == "UsageError"
        assert "pip install ipython" in res["error"]["evalue"]
    assert "%timeit" in r[0]["error"]["evalue"]
    assert r[2]["error"] is None and r[2]["outputs"][0]["data"]["text/plain"] == "1"


def test_functions_keep_their_source_and_top_level_await():
    """inspect.getsource works for cell functions; top-level await runs, as in Jupyter."""
    r = run("def f():\n    return 1", "import inspect\nprint(inspect.getsource(f))",
            "import asyncio\nawait asyncio.sleep(0)\n'awaited'")
    assert texts(r[1]["outputs"]) == [("stdout", "def f():\n    return 1\n\n")]
    assert r[2]["outputs"][0]["data"]["text/plain"] == "'awaited'"


def test_dunder_main_and_name():
    """__name__ is '__main__' in a cell, so `if __name__ == '__main__'` runs."""
    (r,) = run("if __name__ == '__main__':\n    print('main')")
    assert texts(r["outputs"]) == [("stdout", "main\n")]


def test_deep_recursion_traceback_is_collapsed_and_huge_messages_cut():
    """Repeated frames are counted, not repeated; an enormous message is cut with a marker."""
    r = run("def f(n):\n    return f(n + 1)\nf(0)", "raise ValueError('v' * 5000)",
            settings={"display.max_mime_chars": 1000})
    tb = r[0]["error"]["traceback"]
    assert len(tb) < 12 and "skipping similar frames: f at line 2" in tb[-2]
    assert len(r[1]["error"]["evalue"]) < 1100 and "truncated" in r[1]["error"]["evalue"]


def test_indented_and_prompted_cells_as_in_jupyter():
    """An indented first line is dedented and pasted >>> prompts are removed, as IPython does."""
    r = run("    x = 1\n    x + 1", ">>> y = 2\n>>> y * 2")
    assert r[0]["outputs"][0]["data"]["text/plain"] == "2"
    assert r[1]["outputs"][0]["data"]["text/plain"] == "4"


def test_autoreload_and_warnings_per_cell_as_in_jupyter(tmp_path):
    """IPython's cell events run: %autoreload picks up an edited module; a warning shows each time."""
    mod = tmp_path / "helper_mod.py"
    mod.write_text("def value():\n    return 1\n")
    r = run(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n%load_ext autoreload\n%autoreload 2\n"
            "import helper_mod\nhelper_mod.value()",
            f"open({str(mod)!r}, 'w').write('def value():\\n    return 2\\n')",
            "helper_mod.value()",
            "import warnings\nwarnings.warn('careful')", "warnings.warn('careful')")
    assert r[0]["outputs"][-1]["data"]["text/plain"] == "1"
    assert r[2]["outputs"][-1]["data"]["text/plain"] == "2"
    for res in r[3:]:
        assert "UserWarning: careful" in res["outputs"][0]["text"]


def test_cell_magics_html_capture_bash_leave_no_thread():
    """%%html, %%capture, %%writefile and %%bash work; %%bash's loop thread is stopped after."""
    r = run("%%capture cap\nprint('hidden')", "cap.stdout", "%%html\n<b>hi</b>",
            "%%bash\necho from bash\necho err >&2", "%%bash\necho again")
    assert r[0]["outputs"] == [] and r[1]["outputs"][0]["data"]["text/plain"] == "'hidden\\n'"
    assert r[2]["outputs"][0]["data"]["text/html"] == "<b>hi</b>\n"
    assert texts(r[3]["outputs"]) == [("stdout", "from bash\n"), ("stderr", "err\n")]
    assert texts(r[4]["outputs"]) == [("stdout", "again\n")]
    assert all(res["threads"] == 1 for res in r)
