"""Output capture (kernel/worker/capture/): order, fd-level streams, display protocol,
figures, limits, streaming.

Cells go through the real server and its workers (tests/conftest.py); every
output is validated against nbformat's v4 schema. The streaming hook is
tested at the cell runner, in a process of its own.
"""

import base64
import contextlib
import json
import os
import subprocess
import sys

import pytest
import requests

from support.cells import run, texts, validated
from support.server import ROOT, wait_for

LIMITS = "[display]\nmax_output_bytes = 50000\nmax_mime_chars = 1000\n"


def one(server, source):
    """Run one cell from the initial state; return (outputs, error), validated."""
    (answer,) = run(server, source)
    return answer["output"], answer["error"]


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A server with small output limits."""
    from support.server import Server
    srv = Server(tmp_path_factory.mktemp("limited") / "data", config=LIMITS)
    yield srv
    srv.stop()


def test_streams_and_displays_in_order_with_fd_level_output(server):
    """Python prints, os.system, child processes, raw fd writes and displays keep their order."""
    outs, err = one(server,
                    "import os, subprocess, sys, ctypes\n"
                    "print('one', end='')\n"
                    "sys.stdout.buffer.write(b'\\n')\n"
                    "os.system('echo two')\n"
                    "subprocess.run(['echo', 'three'])\n"
                    "os.write(1, b'four\\n')\n"
                    "ctypes.CDLL(None).printf(b'five\\n')\n"
                    "display('shown')\n"
                    "sys.stderr.write('err one\\n')\n"
                    "os.system('echo err two >&2')\n"
                    "print('six')\n")
    assert err is None
    assert texts(outs) == [
        ("stdout", "one\ntwo\nthree\nfour\nfive\n"),
        ("display_data", ("text/plain",)),
        ("stderr", "err one\nerr two\n"),
        ("stdout", "six\n"),
    ]


def test_consecutive_chunks_are_merged_into_one_string(server):
    """A loop of prints gives one stream output whose text is one string."""
    outs, _ = one(server, "for i in range(500):\n    print(i, end=' ')\n")
    assert len(outs) == 1 and isinstance(outs[0]["text"], str)
    assert outs[0]["text"].split() == [str(i) for i in range(500)]


def _process_state(pid):
    """What a cell must leave as it found in its process: fds 1 and 2, the pipes,
    memory files and sockets it has open (libraries may keep regular files open,
    fonts), its threads."""
    links = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            links[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return {"fd1": links.get("1"), "fd2": links.get("2"),
            "fds": sorted(f"{fd}:{link}" for fd, link in links.items()
                          if link.startswith(("pipe:", "/memfd:", "socket:"))),
            "threads": len(os.listdir(f"/proc/{pid}/task"))}


def test_worker_state_restored_and_no_threads_left(server):
    """After every cell, its process has fds 1/2, open fds and threads as before it, and
    builtins gain nothing but IPython's marker (set once per process, as in Jupyter)."""
    (first,) = run(server, "import builtins, os\nnames = set(vars(builtins))\nos.getpid()")
    pid = int(first["output"][0]["data"]["text/plain"])
    # After its answer the child forks its holder and rehearses a throwaway cell, its
    # output capture included: the state to compare with is the idle one after that.
    def idle():
        """The process's state once it is idle (one thread, no capture memfd; the
        zygote's child-loads memfd stays, kernel/worker/holder.py ChildLock)."""
        state = _process_state(pid)
        return state if state["threads"] == 1 and "memfd:cell-fd" not in str(state) else None

    before = wait_for(idle, f"process {pid} to be idle after its warm-up")
    state = first["state_name"]
    for code in ["print('x')", "os.system('echo y')", "!echo z",
                 "import subprocess\nsubprocess.run(['echo', 'w'])",
                 "import ctypes\nctypes.CDLL(None).printf(b'c\\n')",
                 "os.system('echo hi > /dev/stdout')",
                 "import threading\nt = threading.Thread(target=print, args=('t',))\n"
                 "t.start(); t.join(); del t",
                 "import matplotlib.pyplot as plt; plt.plot([1]); plt.show()"]:
        # os.getpid() last: the same process ran the cell (the child that ran one
        # stays as the first spare of the state it made).
        answer = validated(server.execute(code + "\nos.getpid()", state))
        assert answer["output"][-1]["data"]["text/plain"] == str(pid), code
        state = answer["state_name"]
        # (after its answer the child forks a holder and rehearses a cell: a moment)
        wait_for(lambda: _process_state(pid) == before,
                 f"process {pid} to be as before ({before}), after {code!r}: "
                 f"{_process_state(pid)}")
    added = server.value(state, "sorted(set(vars(builtins)) ^ names)")
    assert added in ("[]", "['__IPYTHON__']")


def test_display_protocol_repr_methods_and_metadata(server):
    """_repr_*_ methods (with (data, metadata) returns) give their MIME types."""
    outs, err = one(server, """
class Rich:
    def _repr_html_(self): return '<b>h</b>'
    def _repr_markdown_(self): return '**m**'
    def _repr_svg_(self): return '<svg xmlns="http://www.w3.org/2000/svg"></svg>'
    def _repr_png_(self): return b'\\x89PNG\\r\\n\\x1a\\nfake', {'width': 3}
    def _repr_jpeg_(self): return b'\\xff\\xd8jpeg'
    def _repr_latex_(self): return '$x$'
    def _repr_json_(self): return {'a': 1}
    def _repr_pdf_(self): return b'%PDF-1.4'
    def __repr__(self): return 'Rich()'
Rich()
""")
    assert err is None
    (res,) = outs
    assert res["output_type"] == "execute_result" and res["execution_count"] == 1
    data = res["data"]
    assert set(data) == {"text/plain", "text/html", "text/markdown", "image/svg+xml",
                         "image/png", "image/jpeg", "text/latex", "application/json",
                         "application/pdf"}
    assert data["text/plain"] == "Rich()"
    assert base64.b64decode(data["image/png"]).startswith(b"\x89PNG")
    assert "\n" not in data["image/png"]
    assert data["application/json"] == {"a": 1}
    assert res["metadata"]["image/png"] == {"width": 3}


def test_mimebundle_ipython_display_raw_and_display_id(server):
    """_repr_mimebundle_, _ipython_display_, display(*objs), raw=True, display_id updates."""
    outs, err = one(server, """
class B:
    def _repr_mimebundle_(self, include=None, exclude=None):
        return {'text/plain': 'B', 'text/html': '<i>B</i>'}, {'text/html': {'isolated': True}}
class Self:
    def _ipython_display_(self):
        print('self-displayed')
display(B(), 7)
display({'text/plain': 'raw', 'text/html': '<u>raw</u>'}, raw=True)
h = display('v1', display_id='d1')
h.update('v2')
Self()
""")
    assert err is None, err
    assert texts(outs) == [
        ("display_data", ("text/html", "text/plain")),
        ("display_data", ("text/plain",)),
        ("display_data", ("text/html", "text/plain")),
        ("display_data", ("text/plain",)),
        ("stdout", "self-displayed\n"),
    ]
    assert outs[0]["metadata"] == {"text/html": {"isolated": True}}
    assert outs[1]["data"]["text/plain"] == "7"
    assert outs[3]["data"]["text/plain"] == "'v2'"


def test_ipython_display_objects_and_display_function(server):
    """IPython.display objects render with Jupyter's MIME types."""
    outs, err = one(server, """
from IPython.display import HTML, Markdown, Image, JSON, Latex, SVG, display
display(HTML('<b>x</b>'), Markdown('*y*'), Latex('$z$'), JSON({'k': [1]}),
        SVG('<svg xmlns="http://www.w3.org/2000/svg" width="1" height="1"></svg>'))
import io, matplotlib.pyplot as plt
f = plt.figure(figsize=(1, 1)); b = io.BytesIO(); f.savefig(b, format='png'); plt.close(f)
Image(data=b.getvalue())
""")
    assert err is None, err
    kinds = [tuple(sorted(o["data"])) for o in outs]
    assert kinds == [("text/html", "text/plain"), ("text/markdown", "text/plain"),
                     ("text/latex", "text/plain"), ("application/json", "text/plain"),
                     ("image/svg+xml", "text/plain"), ("image/png", "text/plain")]
    assert outs[-1]["output_type"] == "execute_result"


def test_display_is_a_builtin_the_user_can_shadow(server):
    """display is not in globals(); a user-defined display wins."""
    r = run(server, "x = 1\nsorted(k for k in globals() if not k.startswith('__'))",
            "def display(x):\n    print('mine', x)\ndisplay(1)")
    assert r[0]["output"][0]["data"]["text/plain"] == "['x']"
    assert texts(r[1]["output"]) == [("stdout", "mine 1\n")]


def test_matplotlib_show_and_cell_end_then_closed(server):
    """Figures appear at plt.show() and at cell end, as PNG with size metadata, never twice."""
    r = run(server,
            "import matplotlib.pyplot as plt\n"
            "for i in range(2):\n    print('fig', i)\n    plt.plot([0, i])\n    plt.show()\n"
            "plt.figure(figsize=(2, 1)); plt.plot([1, 2])\nprint('end')",
            "print(len(plt.get_fignums()))",
            "fig, ax = plt.subplots(); ax.plot([1, 3]); plt.close(fig)")
    outs = r[0]["output"]
    assert [t[0] for t in texts(outs)] == ["stdout", "display_data", "stdout", "display_data",
                                           "stdout", "display_data"]
    for out in outs[1::2]:
        png = base64.b64decode(out["data"]["image/png"])
        assert png.startswith(b"\x89PNG")
        meta = out["metadata"]["image/png"]
        assert meta["width"] == int.from_bytes(png[16:20], "big")
        assert meta["height"] == int.from_bytes(png[20:24], "big")
    assert outs[-1]["metadata"]["image/png"]["width"] < outs[1]["metadata"]["image/png"]["width"]
    assert texts(r[1]["output"]) == [("stdout", "0\n")]
    assert r[2]["output"] == []


def test_a_figure_is_drawn_only_when_shown(server):
    """As with ipykernel's inline backend, pyplot and pandas draw nothing before the figure
    is shown (pyplot's own draw_if_interactive drew it whole at each plt.figure() and
    pandas plot)."""
    (answer,) = run(server,
                    "import matplotlib.pyplot as plt, pandas as pd\n"
                    "draws = []\n"
                    "fig = plt.figure()\n"
                    "fig.canvas.mpl_connect('draw_event', lambda event: draws.append(1))\n"
                    "pd.Series([1, 2]).plot.barh(ax=fig.gca())\n"
                    "plt.figure()\n"
                    "print('before show', len(draws))\n"
                    "plt.show()\n"
                    "print('after show', len(draws))")
    assert answer["error"] is None
    printed = [text for kind, text in texts(answer["output"]) if kind == "stdout"]
    assert printed[0] == "before show 0\n"
    assert printed[1] != "after show 0\n"  # shown: drawn (twice, for its tight bounding box)


def test_figures_of_a_backend_the_notebook_chose_are_not_shown_until_inline_draws(server):
    """As in ipykernel: after matplotlib.use('svg') a figure is not shown and stays open;
    once a cell draws with the inline backend again, every open figure is shown."""
    r = run(server, "import matplotlib.pyplot as plt\nplt.plot([1, 2])",
            "import matplotlib\nmatplotlib.use('svg')\nimport matplotlib.pyplot as plt",
            "fig, ax = plt.subplots()\nax.plot([1, 2])",
            "%matplotlib inline\nprint(len(plt.get_fignums()))",
            "plt.figure()\nplt.plot([3, 4])")
    shown = [[o["output_type"] for o in answer["output"]] for answer in r]
    assert shown == [["execute_result", "display_data"], [], ["execute_result"], ["stream"],
                     ["execute_result", "display_data", "display_data"]]
    assert texts(r[3]["output"]) == [("stdout", "1\n")]


def test_an_unknown_backend_is_refused_as_in_ipykernel(server):
    """After pyplot has drawn, `matplotlib.use('Qt4Agg')` lists the valid backends as in
    ipykernel with the same IPython (matplotlib's own, "inline", and ipykernel's inline
    module where IPython resolves backends through matplotlib's registry), never the
    module our inline backend is loaded from."""
    from support.jupyter import Kernel
    pytest.importorskip("ipykernel")
    cells = ("import matplotlib.pyplot as plt\nplt.plot([1, 2])",
             "import matplotlib\nmatplotlib.use('Qt4Agg')")
    k = Kernel(spec="python3")
    try:
        assert k.run(cells[0])[0]["status"] == "ok"
        expected = k.run(cells[1])[0]
        backend = k.run("print(matplotlib.get_backend())")[1]
    finally:
        k.stop()
    # The reference drew with Jupyter's inline backend, whatever the test's environment sets.
    assert backend == [{"name": "stdout", "text": "module://matplotlib_inline.backend_inline\n",
                        "msg_type": "stream"}]
    assert "'inline'" in expected["evalue"]
    r = run(server, *cells)
    assert (r[1]["error"]["ename"], r[1]["error"]["evalue"]) == (
        expected["ename"], expected["evalue"])


@pytest.mark.parametrize("fmt", ["svg", "retina"])
def test_figure_format_and_dpi_settings(make_server, fmt):
    """display.figure_format and display.figure_dpi change the figure output."""
    srv = make_server(config=f'[display]\nfigure_format = "{fmt}"\nfigure_dpi = 50\n')
    outs, err = one(srv, "import matplotlib.pyplot as plt\nplt.figure(figsize=(4, 2)); plt.plot([1, 2])")
    assert err is None
    (out,) = [o for o in outs if o["output_type"] == "display_data"]
    if fmt == "svg":
        assert out["data"]["image/svg+xml"].lstrip().startswith("<?xml")
    else:
        png = base64.b64decode(out["data"]["image/png"])
        width = int.from_bytes(png[16:20], "big")
        assert out["metadata"]["image/png"]["width"] == width // 2
        assert 300 < width <= 400  # 4 inches at 2 x 50 dpi, cropped tight


def test_figure_dpi_setting_is_the_default_and_a_figure_dpi_wins(make_server):
    """display.figure_dpi sets new figures' dpi; plt.figure(dpi=...) overrides it, as in Jupyter."""
    srv = make_server(config="[display]\nfigure_dpi = 50\n")
    outs, err = one(srv, "import matplotlib.pyplot as plt\n"
                         "plt.figure(figsize=(4, 2)); plt.plot([1, 2])\n"
                         "plt.figure(figsize=(4, 2), dpi=100); plt.plot([1, 2]);")
    assert err is None
    small, large = (o["metadata"]["image/png"]["width"] for o in outs)
    assert small < 210 < 300 < large <= 400
    assert outs[0]["data"]["text/plain"] == "<Figure size 200x100 with 1 Axes>"


_PANDAS_CELL = ("import pandas as pd\n"
                "df = pd.DataFrame({'a': range(100), 'b': ['x'] * 100})\n"
                "display(df)\ndisplay(df['a'])\ndisplay(df.head(3).style.highlight_max())\n"
                "pd.DataFrame({f'c{i}': [i] for i in range(30)})")


def test_pandas_jupyter_display_and_limits(server):
    """DataFrame/Series/Styler show HTML and text; Jupyter's limits apply."""
    outs, err = one(server, _PANDAS_CELL)
    assert err is None
    frame, series, styler, wide = outs
    assert set(frame["data"]) == {"text/plain", "text/html"}
    assert "[100 rows x 2 columns]" in frame["data"]["text/plain"]
    assert len(frame["data"]["text/plain"].splitlines()) < 15  # truncated to min_rows
    assert frame["data"]["text/html"].count("<tr>") < 70  # 60 rows max, as in Jupyter
    assert "Name: a, Length: 100" in series["data"]["text/plain"]
    assert "<style" in styler["data"]["text/html"]
    assert "..." in wide["data"]["text/plain"]  # 20 columns max


def test_display_max_flags_reach_pandas_through_the_server(make_server):
    """--display-max-rows/--display-max-columns override Jupyter's limits, end to end."""
    srv = make_server(extra_args=["--display-max-rows", "200", "--display-max-columns", "50"])
    outs, err = one(srv, _PANDAS_CELL)
    assert err is None
    assert len(outs[0]["data"]["text/plain"].splitlines()) == 101
    assert "..." not in outs[3]["data"]["text/plain"]


def test_output_byte_limit_cuts_with_marker(limited):
    """Past display.max_output_bytes the output is cut with a visible marker, no failure."""
    outs, err = one(limited, "import os\nfor i in range(2000):\n    print('x' * 99)\n"
                             "os.system('yes | head -c 100000')\ndisplay('late')")
    assert err is None
    total = sum(len(o.get("text", "")) for o in outs)
    assert 50_000 <= total < 51_000
    assert "output truncated" in outs[-1]["text"]
    assert all(o["output_type"] == "stream" for o in outs)


def test_mime_entry_limit_cuts_with_marker(limited):
    """An entry longer than display.max_mime_chars is cut (text) or replaced by a note (image)."""
    outs, err = one(limited, "from IPython.display import HTML, Image\n"
                             "display(HTML('<p>' + 'y' * 5000))\n"
                             "'z' * 5000")
    assert err is None
    html = outs[0]["data"]["text/html"]
    assert len(html) < 1200 and "truncated" in html
    assert "truncated" in outs[1]["data"]["text/plain"] and len(outs[1]["data"]["text/plain"]) < 1200
    outs, _ = one(limited, "import matplotlib.pyplot as plt\nplt.plot([1, 2]);")
    (fig,) = outs
    assert "image/png" not in fig["data"] and "truncated" in fig["data"]["text/plain"]


def test_clear_output(server):
    """IPython.display.clear_output drops what the cell showed so far."""
    outs, err = one(server, "from IPython.display import clear_output\nprint('old')\n"
                            "clear_output()\nprint('new')\nclear_output(wait=True)\nprint('newest')")
    assert err is None
    assert texts(outs) == [("stdout", "newest\n")]


def test_logging_handler_from_an_earlier_cell_keeps_writing_to_the_cell(server):
    """A StreamHandler bound to sys.stderr in one cell writes into later cells' outputs."""
    r = run(server, "import logging\nlog = logging.getLogger('t')\n"
                    "log.addHandler(logging.StreamHandler())\nlog.propagate = False",
            "log.warning('careful')")
    assert texts(r[1]["output"]) == [("stderr", "careful\n")]


def test_config_inline_backend_figure_format(server):
    """%config InlineBackend.figure_format = 'svg' switches figures to SVG, as in Jupyter."""
    r = run(server, "%config InlineBackend.figure_format = 'svg'",
            "import matplotlib.pyplot as plt\nplt.plot([1, 2]);")
    assert r[0]["error"] is None, r[0]["error"]
    (fig,) = r[1]["output"]
    assert "image/svg+xml" in fig["data"] and "image/png" not in fig["data"]


def test_child_reopening_dev_stdout_is_captured(server):
    """`cmd > /dev/stdout` (a truncating reopen of fd 1) is still captured, without NULs."""
    outs, err = one(server, "import os\nprint('a')\nos.system('echo hi > /dev/stdout; echo after')\n"
                            "print('b')")
    assert err is None
    assert texts(outs) == [("stdout", "a\nhi\nafter\nb\n")]


@pytest.mark.parametrize("pad", [0, 3000])
def test_prints_from_threads_of_the_cell_are_all_captured_once(server, pad):
    """Threads printing (Python and fd level) during the cell: every line once, whole.

    With long lines most fd-level writes span two pages of the capture file,
    which another thread's drain may find half written (it did, under load).
    """
    outs, err = one(server, "import os, sys, threading\n"
                            "def work(k):\n"
                            "    for i in range(200):\n"
                            "        sys.stdout.write(f'p{k}-{i}\\n')\n"
                            f"        os.write(1, f'f{{k}}-{{i}}{'x' * pad}\\n'.encode())\n"
                            "ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]\n"
                            "for t in ts: t.start()\n"
                            "for t in ts: t.join()")
    assert err is None
    lines = "".join(o["text"] for o in outs).split()
    assert sorted(lines) == sorted([f"p{k}-{i}" for k in range(4) for i in range(200)]
                                   + [f"f{k}-{i}" + "x" * pad for k in range(4) for i in range(200)])


# -- streaming (run_cell's sink) ---------------------------------------------

_STREAMING = r"""
import json, os, signal, sys
from snapkernel.kernel.config import load
from snapkernel.kernel.worker import execution

items = []


def sink(item):
    if item["type"] == "output" and item["output"].get("text") == "interrupt me\n":
        os.kill(os.getpid(), signal.SIGINT)  # arrives while the sink is at work
    items.append(item)


namespace = {"__name__": "__main__", "__builtins__": __builtins__, "items": items}
outputs, error = execution.run_cell(execution.compile_cell(sys.stdin.read(), 1), namespace, 1,
                                 load(), sink=sink)
json.dump({"items": items, "outputs": outputs, "error": error,
           "seen": namespace.get("seen")}, sys.stdout)
"""


def stream_cell(source):
    """Run one cell through execution.run_cell with a sink, in a fresh process."""
    done = subprocess.run([sys.executable, "-c", _STREAMING], input=source, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def replay(items):
    """The cell's final outputs as a front end rebuilds them from the streamed items."""
    outputs, clear_pending = [], False
    for item in items:
        if item["type"] == "clear_output":
            if item["wait"]:
                clear_pending = True
            else:
                outputs = []
            continue
        out = dict(item["output"])
        if out["output_type"] == "update_display_data":
            for shown in outputs:
                if shown.get("transient") == out["transient"]:
                    shown.update(data=out["data"], metadata=out["metadata"])
            continue
        if clear_pending:
            outputs, clear_pending = [], False
        last = outputs[-1] if outputs else None
        if out["output_type"] == "stream" and last and last["output_type"] == "stream" \
                and last["name"] == out["name"]:
            last["text"] += out["text"]
        else:
            outputs.append(out)
    return [{k: v for k, v in o.items() if k != "transient"} for o in outputs]


def test_streamed_items_come_in_order_and_rebuild_the_outputs():
    """Each output reaches the sink as it is produced, chunk by chunk, in order; replayed,
    the items give exactly the outputs run_cell returns."""
    result = stream_cell(
        "import os, sys\nfrom IPython.display import HTML, clear_output\n"
        "sys.stdout.write('a\\n'); sys.stderr.write('b\\n'); sys.stdout.write('c\\n')\n"
        "display(HTML('<b>h</b>'))\n"
        "h = display('v1', display_id='d1')\nh.update('v2')\n"
        "os.system('echo fd')\n"
        "clear_output(wait=True)\n"
        "sys.stdout.write('after clear\\n')\nh.update('v3')\n"
        "42")
    assert result["error"] is None, result["error"]
    view = [(i["type"], i["output"]["output_type"], i["output"].get("text") or
             i["output"].get("data", {}).get("text/plain"), i["output"].get("transient"))
            if i["type"] == "output" else (i["type"], i["wait"]) for i in result["items"]]
    assert view == [
        ("output", "stream", "a\n", None),
        ("output", "stream", "b\n", None),
        ("output", "stream", "c\n", None),
        ("output", "display_data", "<IPython.core.display.HTML object>", None),
        ("output", "display_data", "'v1'", {"display_id": "d1"}),
        ("output", "update_display_data", "'v2'", {"display_id": "d1"}),
        ("output", "stream", "fd\n", None),
        ("clear_output", True),
        ("output", "stream", "after clear\n", None),
        ("output", "update_display_data", "'v3'", {"display_id": "d1"}),
        ("output", "execute_result", "42", None),
    ]
    assert replay(result["items"]) == result["outputs"]
    assert texts(result["outputs"]) == [("stdout", "after clear\n"),
                                        ("execute_result", ("text/plain",))]


def test_first_output_is_streamed_before_the_cell_goes_on():
    """A print reaches the sink before the cell's next statement runs (print, wait, print)."""
    result = stream_cell("print('first')\nseen = ''.join(i['output']['text'] for i in items)\n"
                         "print('second')")
    assert result["seen"] == "first\n"
    assert "".join(i["output"]["text"] for i in result["items"]) == "first\nsecond\n"


def test_streamed_answer_of_the_server_rebuilds_its_outputs(server):
    """Through the real worker ("stream": true): the NDJSON items, replayed, are the answer's
    outputs, for a cell mixing threads, fd-level output, displays, updates and clears."""
    code = ("import os, sys, threading\nfrom IPython.display import clear_output\n"
            "print('gone'); clear_output()\n"
            "h = display('v1', display_id=True)\n"
            "def work(k):\n"
            "    for i in range(50):\n"
            "        print(f'p{k}-{i}', end='' if i % 7 else '\\n'); os.write(1, f'f{k}-{i}\\n'.encode())\n"
            "ts = [threading.Thread(target=work, args=(k,)) for k in range(3)]\n"
            "for t in ts: t.start()\n"
            "for t in ts: t.join()\n"
            "h.update('v2'); sys.stderr.write('err\\n'); os.system('echo last')\n"
            "clear_output(wait=True); print('kept', end='')\n"
            "'result'")
    body = {"code": code, "exec_id": "stream-replay", "state_name": "initial", "stream": True}
    with requests.post(server.url + "/execute", params={"token": server.token}, json=body,
                       stream=True, timeout=120) as r:
        *items, last = [json.loads(raw) for raw in r.iter_lines() if raw]
    answer = last["answer"]
    assert answer["error"] is None, answer["error"]
    assert len(items) > 10 and replay(items) == answer["output"]
    assert texts(answer["output"]) == [("stdout", "kept"), ("execute_result", ("text/plain",))]


def test_stream_text_is_streamed_a_line_at_a_time_or_when_flushed():
    """As a terminal shows it: a print is one item; a partial line goes when the stream is
    flushed (progress bars), when another item comes, or at the end of the cell."""
    result = stream_cell("import sys\nprint('x', end=''); print('y')\n"
                         "print('.', end='', flush=True)\nseen = len(items)\n"
                         "print('partial', end='')\nsys.stderr.write('e\\n')\nprint('end', end='')")
    assert result["seen"] == 2
    assert [(i["output"]["name"], i["output"]["text"]) for i in result["items"]] == [
        ("stdout", "xy\n"), ("stdout", "."), ("stdout", "partial"), ("stderr", "e\n"),
        ("stdout", "end")]
    assert replay(result["items"]) == result["outputs"]


def test_interrupt_waits_for_the_sink_to_finish():
    """A SIGINT while the sink works is delivered after it: the item is whole, then the
    cell stops with KeyboardInterrupt."""
    result = stream_cell("import sys\nsys.stdout.write('interrupt me\\n')\nprint('never')")
    assert result["error"]["ename"] == "KeyboardInterrupt"
    assert [i["output"]["text"] for i in result["items"]] == ["interrupt me\n"]
    assert texts(result["outputs"]) == [("stdout", "interrupt me\n")]
