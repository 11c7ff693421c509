"""Running cells (kernel/worker/execution.py): results, errors, interrupts, IPython syntax.

Cells go through the real server and its workers (tests/conftest.py), each
from the state the previous successful cell made, as a notebook client
sends them; every output is validated against nbformat.
"""

from support.cells import run, texts


def test_execute_result_has_execution_count_and_follows_jupyter_rules(server):
    """Last expression shown with its count; not None; not after ';' (even before a comment)."""
    r = run(server, "1 + 1", "None", "x = 3\nx;", "x;  # quiet", "x  # shown",
            "print('a'); 5; print('b')")
    assert r[0]["output"] == [{"output_type": "execute_result", "data": {"text/plain": "2"},
                               "metadata": {}, "execution_count": 1}]
    assert r[1]["output"] == [] and r[2]["output"] == [] and r[3]["output"] == []
    assert r[4]["output"][0]["execution_count"] == 5
    assert texts(r[5]["output"]) == [("stdout", "a\nb\n")]


def test_reads_of_nested_code_and_of_ipython_syntax(server):
    """A function's body counts as read by the cell that defines it; a cell with IPython
    syntax (run through get_ipython()) is taken to read every name."""
    r = run(server, "def g():\n    return 1\nunused = 0", "def f():\n    return g()\nf()",
            "%time x = 1", "y = 2")
    assert r[1]["output"][0]["data"]["text/plain"] == "1"
    assert r[1]["accessed_symbols"] == ["g"]
    assert r[2]["error"] is None and r[2]["accessed_symbols"] == ["f", "g", "unused"]
    assert r[3]["accessed_symbols"] == []


def test_traceback_shows_cell_lines_and_hides_kernel_frames(server):
    """Tracebacks name Cell In[n] with the cell's line numbers and source, like IPython."""
    r = run(server, "def ratio(a, b):\n    return a / b", "x = 1\nratio(x, 0)")
    err = r[1]["error"]
    assert err["ename"] == "ZeroDivisionError" and err["evalue"] == "division by zero"
    text = "\n".join(err["traceback"])
    assert "Cell In[2], line 2" in text and "----> 2 ratio(x, 0)" in text
    assert "Cell In[1], line 2, in ratio(a, b)" in text and "----> 2     return a / b" in text
    assert "kernel/worker" not in text
    assert text.rstrip().endswith("ZeroDivisionError: division by zero")


def test_a_cell_run_again_names_its_own_execution_in_tracebacks(server):
    """The same source run again (compiled once per process, kernel/worker/execution.py)
    still shows its own In[n], lines and nested functions in a traceback."""
    code = "def inverse(a):\n    return 1 / a\nn -= 1\ninverse(n)"
    r = run(server, "n = 2", code, code)
    assert r[1]["error"] is None and r[1]["output"][0]["data"]["text/plain"] == "1.0"
    text = "\n".join(r[2]["error"]["traceback"])
    assert "Cell In[3], line 4" in text and "----> 4 inverse(n)" in text
    assert "Cell In[3], line 2, in inverse(a)" in text and "----> 2     return 1 / a" in text


def test_syntax_error_shows_line_and_caret(server):
    """A SyntaxError is an error result with the line and a caret; no state is made."""
    (r,) = run(server, "x = 1\ny = (2 +\n")
    assert r["error"]["ename"] == "SyntaxError" and r["state_name"] is None
    (r,) = run(server, "for i in range(3)\n    print(i)")
    err = r["error"]
    assert err["ename"] == "SyntaxError" and err["evalue"].startswith("expected ':'")
    tb = "\n".join(err["traceback"])
    assert "Cell In[1], line 1" in tb and "for i in range(3)" in tb and "^" in tb
    assert run(server, "if True:\nprint(1)")[0]["error"]["ename"] == "IndentationError"


def test_keyboard_interrupt_keeps_outputs_and_process_goes_on(server):
    """SIGINT during a cell becomes a KeyboardInterrupt error; earlier output is kept."""
    r = run(server, "import os, signal, time\nprint('before')\nos.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(5)\nprint('never')", "print('next cell runs')")
    assert r[0]["error"]["ename"] == "KeyboardInterrupt"
    assert texts(r[0]["output"]) == [("stdout", "before\n")]
    assert texts(r[1]["output"]) == [("stdout", "next cell runs\n")]


def test_system_exit_and_base_exceptions_are_errors(server):
    """sys.exit(), custom BaseExceptions and a broken repr are reported, not propagated."""
    r = run(server, "import sys\nsys.exit(3)",
            "class Boom(BaseException):\n    pass\nraise Boom('b')",
            "class Bad:\n    def __repr__(self):\n        raise RuntimeError('no repr')\nBad()",
            "print('alive')")
    assert r[0]["error"]["ename"] == "SystemExit" and r[0]["error"]["evalue"] == "3"
    assert r[1]["error"]["ename"] == "Boom"
    assert r[2]["error"]["ename"] == "RuntimeError"
    # The formatting of the result goes through the worker's capture: none of its frames show.
    tb = "\n".join(r[2]["error"]["traceback"])
    assert "in __repr__(self)" in tb and "kernel/worker" not in tb
    assert texts(r[3]["output"]) == [("stdout", "alive\n")]


def test_input_fails_at_once_with_a_clear_error(server):
    """input() raises immediately: there is no stdin."""
    for code in ("input('name? ')", "import getpass\ngetpass.getpass()"):
        (r,) = run(server, code)
        assert r["error"]["ename"] == "StdinNotImplementedError"
        assert "no stdin" in r["error"]["evalue"]


def test_chained_exceptions_show_both(server):
    """'During handling...' chains are shown as IPython shows them."""
    (r,) = run(server, "try:\n    {}['k']\nexcept KeyError as e:\n    raise ValueError('wrapped') from e")
    tb = "\n".join(r["error"]["traceback"])
    assert "KeyError" in tb and "direct cause" in tb and r["error"]["ename"] == "ValueError"


_NAMES = "sorted(k for k in globals() if not k.startswith('__'))"


def test_namespace_holds_only_user_names(server):
    """No display, get_ipython, In/Out or IPython bookkeeping leaks into globals()."""
    r = run(server, "%cd /tmp\n!true\n%time a = 1", f"b = {_NAMES}", "b")
    assert r[0]["error"] is None, r[0]["error"]
    assert r[2]["output"][0]["data"]["text/plain"] == "['a']"
    assert server.value(r[2]["state_name"], _NAMES) == "['a', 'b']"


def test_reset_magic_clears_user_names_only(server):
    """%reset -f forgets the user's variables and adds none of IPython's."""
    r = run(server, "a = 1\nb = 2", "%reset -f", "c = 3")
    assert r[1]["error"] is None, r[1]["error"]
    assert r[1]["deleted_symbols"] == ["a", "b"]
    assert server.value(r[1]["state_name"], _NAMES) == "[]"
    assert server.value(r[2]["state_name"], _NAMES) == "['c']"


def test_ipython_magics_work(server):
    """%time, %%time, %timeit, !cmd, x = !cmd, %cd, %matplotlib inline, %pip."""
    r = run(server, "%matplotlib inline\n%time t = sum(range(10))\nt",
            "%%time\nu = 2\nu * 3",
            "%timeit -n 1 -r 1 pass",
            "!echo shell $t\nout = !echo captured\nout",
            "%cd /tmp",
            "import matplotlib.pyplot as plt\nplt.plot([1]);",
            "%pip --version")
    for res in r:
        assert res["error"] is None, res["error"]
    assert "Wall time" in r[0]["output"][0]["text"]
    assert r[0]["output"][-1]["data"]["text/plain"] == "45"
    assert r[1]["output"][-1]["data"]["text/plain"] == "6"
    assert "per loop" in r[2]["output"][0]["text"]
    assert r[3]["output"][0]["text"] == "shell 45\n"
    assert r[3]["output"][1]["data"]["text/plain"] == "['captured']"
    assert r[4]["output"][0]["text"] == "/tmp\n"
    assert r[5]["output"][0]["data"]["image/png"]
    assert r[6]["output"][0]["text"].startswith("pip ")


def test_functions_keep_their_source_and_top_level_await(server):
    """inspect.getsource works for cell functions; top-level await runs, as in Jupyter."""
    r = run(server, "def f():\n    return 1", "import inspect\nprint(inspect.getsource(f))",
            "import asyncio\nawait asyncio.sleep(0)\n'awaited'")
    assert texts(r[1]["output"]) == [("stdout", "def f():\n    return 1\n\n")]
    assert r[2]["output"][0]["data"]["text/plain"] == "'awaited'"


def test_dunder_main_and_name(server):
    """__name__ is '__main__' in a cell, so `if __name__ == '__main__'` runs."""
    (r,) = run(server, "if __name__ == '__main__':\n    print('main')")
    assert texts(r["output"]) == [("stdout", "main\n")]


def test_deep_recursion_traceback_is_collapsed_and_huge_messages_cut(make_server):
    """Repeated frames are counted, not repeated; an enormous message is cut with a marker."""
    srv = make_server(config="[display]\nmax_output_bytes = 20000\n")
    r = run(srv, "def f(n):\n    return f(n + 1)\nf(0)", "raise ValueError('v' * 50000)")
    tb = r[0]["error"]["traceback"]
    assert len(tb) < 12 and "skipping similar frames: f at line 2" in tb[-2]
    # The message takes at most half of max_output_bytes, the traceback the rest.
    assert len(r[1]["error"]["evalue"]) < 10100 and "truncated" in r[1]["error"]["evalue"]
    assert sum(map(len, r[1]["error"]["traceback"])) < 10100


def test_indented_and_prompted_cells_as_in_jupyter(server):
    """An indented first line is dedented and pasted >>> prompts are removed, as IPython does."""
    r = run(server, "    x = 1\n    x + 1", ">>> y = 2\n>>> y * 2")
    assert r[0]["output"][0]["data"]["text/plain"] == "2"
    assert r[1]["output"][0]["data"]["text/plain"] == "4"


def test_autoreload_and_warnings_per_cell_as_in_jupyter(server, tmp_path):
    """IPython's cell events run: %autoreload picks up an edited module; a warning shows each time."""
    mod = tmp_path / "helper_mod.py"
    mod.write_text("def value():\n    return 1\n")
    r = run(server,
            f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n%load_ext autoreload\n%autoreload 2\n"
            "import helper_mod\nhelper_mod.value()",
            f"open({str(mod)!r}, 'w').write('def value():\\n    return 2\\n')",
            "helper_mod.value()",
            "import warnings\nwarnings.warn('careful')", "warnings.warn('careful')")
    assert r[0]["output"][-1]["data"]["text/plain"] == "1"
    assert r[2]["output"][-1]["data"]["text/plain"] == "2"
    for res in r[3:]:
        assert "UserWarning: careful" in res["output"][0]["text"]


def test_cell_magics_html_capture_bash_leave_no_thread(server):
    """%%html, %%capture and %%bash work; %%bash's loop thread is stopped after the cell.

    (asyncio's own thread waiting for each subprocess may outlive the cell by a
    moment on a busy machine: the last cell waits for the threads to end.)
    """
    r = run(server, "import os\npid = os.getpid()",
            "%%capture cap\nprint('hidden')", "cap.stdout", "%%html\n<b>hi</b>",
            "%%bash\necho from bash\necho err >&2", "%%bash\necho again",
            "import threading, time\ndeadline = time.monotonic() + 60\n"
            "while threading.active_count() > 1 and time.monotonic() < deadline:\n"
            "    time.sleep(0.01)\n"
            "os.getpid() == pid, [t.name for t in threading.enumerate()]")
    assert r[1]["output"] == [] and r[2]["output"][0]["data"]["text/plain"] == "'hidden\\n'"
    assert r[3]["output"][0]["data"]["text/html"] == "<b>hi</b>\n"
    assert texts(r[4]["output"]) == [("stdout", "from bash\n"), ("stderr", "err\n")]
    assert texts(r[5]["output"]) == [("stdout", "again\n")]
    # The same process ran every cell, and only its main thread is left.
    assert r[6]["output"][0]["data"]["text/plain"] == "(True, ['MainThread'])"
