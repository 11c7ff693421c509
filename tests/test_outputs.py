"""Output capture (kernel/outputs.py): order, fd-level streams, display protocol, figures, limits.

Every test runs real cells through kernel.cell in a forked process (see
cellrun.py) and validates every output against nbformat's v4 schema.
"""

import base64
import os

os.environ.setdefault("MPLBACKEND", "Agg")

# Imported here so the forked children start warm (the worker's zygote does the same).
import IPython.core.interactiveshell  # noqa: E402,F401
import matplotlib.pyplot  # noqa: E402,F401
import pandas  # noqa: E402,F401
import nbformat  # noqa: E402
import pytest  # noqa: E402

import kernel.worker.outputs  # noqa: E402,F401
from cellrun import outputs_of, run_cells, texts  # noqa: E402


def no_ipython(kout):
    """Harness setup: run as if IPython were not installed."""
    kout.DISABLE_IPYTHON = True


def _diff(pair):
    """What changed in the process state across a cell."""
    before, after = pair
    return {k: sorted(set(before[k]) ^ set(after[k])) if k == "fds" else (before[k], after[k])
            for k in before if before[k] != after[k]}


def one(source, settings=None, setup=None):
    """Run one cell; return (outputs, error), outputs validated."""
    (result,) = run_cells([source], settings, setup)
    assert result["restored"], _diff(result["restore_diff"])
    return outputs_of(result), result["error"]


def test_streams_and_displays_in_order_with_fd_level_output():
    """Python prints, os.system, child processes, raw fd writes and displays keep their order."""
    outs, err = one(
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


def test_consecutive_chunks_are_merged_into_one_string():
    """A loop of prints gives one stream output whose text is one string."""
    outs, _ = one("for i in range(500):\n    print(i, end=' ')\n")
    assert len(outs) == 1 and isinstance(outs[0]["text"], str)
    assert outs[0]["text"].split() == [str(i) for i in range(500)]


def test_worker_state_restored_and_no_threads_left():
    """After every cell: fds 1/2, sys.stdout/err and open fds are as before; one thread."""
    results = run_cells(["print('x')", "import os; os.system('echo y')", "1/0",
                         "import matplotlib.pyplot as plt; plt.plot([1]); plt.show()"])
    for r in results:
        outputs_of(r)
        assert r["restored"], _diff(r["restore_diff"])
        assert r["threads"] == 1
        # Only IPython's marker, set once per process as in Jupyter.
        assert set(r["builtins_added"]) <= {"__IPYTHON__"}


def test_display_protocol_repr_methods_and_metadata():
    """_repr_*_ methods (with (data, metadata) returns) give their MIME types."""
    cell = """
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
"""
    for setup in (None, no_ipython):
        outs, err = one(cell, setup=setup)
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


def test_mimebundle_ipython_display_raw_and_display_id():
    """_repr_mimebundle_, _ipython_display_, display(*objs), raw=True, display_id updates."""
    cell = """
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
"""
    for setup in (None, no_ipython):
        outs, err = one(cell, setup=setup)
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


def test_ipython_display_objects_and_display_function():
    """IPython.display objects render with Jupyter's MIME types."""
    outs, err = one("""
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


def test_display_is_a_builtin_the_user_can_shadow():
    """display is not in globals(); a user-defined display wins."""
    results = run_cells(["x = 1\nsorted(k for k in globals() if not k.startswith('__'))",
                         "def display(x):\n    print('mine', x)\ndisplay(1)"])
    assert results[0]["outputs"][0]["data"]["text/plain"] == "['x']"
    assert texts(outputs_of(results[1])) == [("stdout", "mine 1\n")]


def test_matplotlib_show_and_cell_end_then_closed():
    """Figures appear at plt.show() and at cell end, as PNG with size metadata, never twice."""
    results = run_cells([
        "import matplotlib.pyplot as plt\n"
        "for i in range(2):\n    print('fig', i)\n    plt.plot([0, i])\n    plt.show()\n"
        "plt.figure(figsize=(2, 1)); plt.plot([1, 2])\nprint('end')",
        "print(len(plt.get_fignums()))",
        "fig, ax = plt.subplots(); ax.plot([1, 3]); plt.close(fig)",
    ])
    outs = outputs_of(results[0])
    assert [t[0] for t in texts(outs)] == ["stdout", "display_data", "stdout", "display_data",
                                           "stdout", "display_data"]
    for out in outs[1::2]:
        png = base64.b64decode(out["data"]["image/png"])
        assert png.startswith(b"\x89PNG")
        meta = out["metadata"]["image/png"]
        assert meta["width"] == int.from_bytes(png[16:20], "big")
        assert meta["height"] == int.from_bytes(png[20:24], "big")
    assert outs[-1]["metadata"]["image/png"]["width"] < outs[1]["metadata"]["image/png"]["width"]
    assert texts(outputs_of(results[1])) == [("stdout", "0\n")]
    assert outputs_of(results[2]) == []


@pytest.mark.parametrize("fmt", ["svg", "retina"])
def test_figure_format_and_dpi_settings(fmt):
    """display.figure_format and display.figure_dpi change the figure output."""
    settings = {"display.figure_format": fmt, "display.figure_dpi": 50}
    outs, err = one("import matplotlib.pyplot as plt\nplt.figure(figsize=(4, 2)); plt.plot([1, 2])",
                    settings)
    assert err is None
    (out,) = [o for o in outs if o["output_type"] == "display_data"]
    if fmt == "svg":
        assert out["data"]["image/svg+xml"].lstrip().startswith("<?xml")
    else:
        png = base64.b64decode(out["data"]["image/png"])
        width = int.from_bytes(png[16:20], "big")
        assert out["metadata"]["image/png"]["width"] == width // 2
        assert 300 < width <= 400  # 4 inches at 2 x 50 dpi, cropped tight


def test_pandas_jupyter_display_and_limits():
    """DataFrame/Series/Styler show HTML and text; Jupyter's limits apply, settings override."""
    cell = ("import pandas as pd\n"
            "df = pd.DataFrame({'a': range(100), 'b': ['x'] * 100})\n"
            "display(df)\ndisplay(df['a'])\ndisplay(df.head(3).style.highlight_max())\n"
            "pd.DataFrame({f'c{i}': [i] for i in range(30)})")
    outs, err = one(cell)
    assert err is None
    frame, series, styler, wide = outs
    assert set(frame["data"]) == {"text/plain", "text/html"}
    assert "[100 rows x 2 columns]" in frame["data"]["text/plain"]
    assert len(frame["data"]["text/plain"].splitlines()) < 15  # truncated to min_rows
    assert frame["data"]["text/html"].count("<tr>") < 70  # 60 rows max, as in Jupyter
    assert "Name: a, Length: 100" in series["data"]["text/plain"]
    assert "<style" in styler["data"]["text/html"]
    assert "..." in wide["data"]["text/plain"]  # 20 columns max
    outs, _ = one(cell, {"display.max_rows": 200, "display.max_columns": 50})
    assert len(outs[0]["data"]["text/plain"].splitlines()) == 101
    assert "..." not in outs[3]["data"]["text/plain"]


def test_output_byte_limit_cuts_with_marker():
    """Past display.max_output_bytes the output is cut with a visible marker, no failure."""
    outs, err = one("import os\nfor i in range(2000):\n    print('x' * 99)\n"
                    "os.system('yes | head -c 100000')\ndisplay('late')",
                    {"display.max_output_bytes": 50_000})
    assert err is None
    total = sum(len(o.get("text", "")) for o in outs)
    assert 50_000 <= total < 51_000
    assert "output truncated" in outs[-1]["text"]
    assert all(o["output_type"] == "stream" for o in outs)


def test_mime_entry_limit_cuts_with_marker():
    """An entry longer than display.max_mime_chars is cut (text) or replaced by a note (image)."""
    outs, err = one("from IPython.display import HTML, Image\n"
                    "display(HTML('<p>' + 'y' * 5000))\n"
                    "'z' * 5000", {"display.max_mime_chars": 1000})
    assert err is None
    html = outs[0]["data"]["text/html"]
    assert len(html) < 1200 and "truncated" in html
    assert "truncated" in outs[1]["data"]["text/plain"] and len(outs[1]["data"]["text/plain"]) < 1200
    outs, _ = one("import matplotlib.pyplot as plt\nplt.plot([1, 2]);", {"display.max_mime_chars": 100})
    (fig,) = outs
    assert "image/png" not in fig["data"] and "truncated" in fig["data"]["text/plain"]


def test_clear_output():
    """IPython.display.clear_output drops what the cell showed so far."""
    outs, err = one("from IPython.display import clear_output\nprint('old')\n"
                    "clear_output()\nprint('new')\nclear_output(wait=True)\nprint('newest')")
    assert err is None
    assert texts(outs) == [("stdout", "newest\n")]


def test_logging_handler_from_an_earlier_cell_keeps_writing_to_the_cell():
    """A StreamHandler bound to sys.stderr in one cell writes into later cells' outputs."""
    results = run_cells(["import logging\nlog = logging.getLogger('t')\n"
                         "log.addHandler(logging.StreamHandler())\nlog.propagate = False",
                         "log.warning('careful')"])
    assert texts(outputs_of(results[1])) == [("stderr", "careful\n")]


def test_config_inline_backend_figure_format():
    """%config InlineBackend.figure_format = 'svg' switches figures to SVG, as in Jupyter."""
    r = run_cells(["%config InlineBackend.figure_format = 'svg'",
                   "import matplotlib.pyplot as plt\nplt.plot([1, 2]);"])
    assert r[0]["error"] is None, r[0]["error"]
    (fig,) = outputs_of(r[1])
    assert "image/svg+xml" in fig["data"] and "image/png" not in fig["data"]


def test_child_reopening_dev_stdout_is_captured():
    """`cmd > /dev/stdout` (a truncating reopen of fd 1) is still captured, without NULs."""
    outs, err = one("import os\nprint('a')\nos.system('echo hi > /dev/stdout; echo after')\nprint('b')")
    assert err is None
    assert texts(outs) == [("stdout", "a\nhi\nafter\nb\n")]


def test_figure_dpi_setting_is_the_default_and_a_figure_dpi_wins():
    """display.figure_dpi sets new figures' dpi; plt.figure(dpi=...) overrides it, as in Jupyter."""
    outs, err = one("import matplotlib.pyplot as plt\n"
                    "plt.figure(figsize=(4, 2)); plt.plot([1, 2])\n"
                    "plt.figure(figsize=(4, 2), dpi=100); plt.plot([1, 2]);",
                    {"display.figure_dpi": 50})
    assert err is None
    small, large = (o["metadata"]["image/png"]["width"] for o in outs)
    assert small < 210 < 300 < large <= 400
    assert outs[0]["data"]["text/plain"] == "<Figure size 200x100 with 1 Axes>"


def test_prints_from_threads_of_the_cell_are_all_captured_once():
    """Threads printing (Python and fd level) during the cell: every line once."""
    outs, err = one("import os, sys, threading\n"
                    "def work(k):\n"
                    "    for i in range(200):\n"
                    "        sys.stdout.write(f'p{k}-{i}\\n')\n"
                    "        os.write(1, f'f{k}-{i}\\n'.encode())\n"
                    "ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]\n"
                    "for t in ts: t.start()\n"
                    "for t in ts: t.join()")
    assert err is None
    lines = "".join(o["text"] for o in outs).split()
    assert sorted(lines) == sorted(f"{c}{k}-{i}" for c in "pf" for k in range(4) for i in range(200))


def test_display_max_flags_reach_pandas_through_the_server(make_server):
    """--display-max-rows/--display-max-columns override Jupyter's limits, end to end."""
    srv = make_server(extra_args=["--display-max-rows", "6", "--display-max-columns", "3"])
    answer = srv.execute("import pandas as pd\npd.DataFrame({f'c{i}': range(20) for i in range(8)})")
    (out,) = answer["output"]
    nbformat.validate(out, ref="output", version=4)
    text = out["data"]["text/plain"]
    assert "[20 rows x 8 columns]" in text
    assert len(text.splitlines()) < 12 and "..." in text.splitlines()[0]
