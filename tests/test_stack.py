"""The PyData stack beyond numpy, pandas and matplotlib (issue 26): values made with
each library survive a restart and are not stored again when unchanged, and their
outputs are those of ipykernel.

Each value is made in a cell, the server is restarted, and the value is used
from the store; the same cell's outputs are compared, by output type and MIME
type, with what a real ipykernel shows.
"""

import re

import jupyter_client
import pytest

from support.jupyter import jupyter_env
from support.server import restarted_before_every_cell, store_bytes

# library: (the cell that makes the value, a probe of it, what the probe shows)
VALUES = {
    "scikit-learn": (
        "from sklearn.datasets import load_iris\n"
        "from sklearn.linear_model import LogisticRegression\n"
        "from sklearn.pipeline import make_pipeline\n"
        "from sklearn.preprocessing import StandardScaler\n"
        "X, y = load_iris(return_X_y=True)\n"
        "value = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500)).fit(X, y)",
        "round(value.score(X, y), 4), value.predict(X[:3]).tolist()", "(0.9733, [0, 0, 0])"),
    "scipy": (
        "import scipy.sparse as sp\n"
        "value = sp.random(2000, 2000, density=0.01, random_state=0, format='csr')",
        "value.nnz, round(float(value.sum()), 4), value.format", None),
    "polars": (
        "import polars as pl\n"
        "value = pl.DataFrame({'a': list(range(200_000)), 'b': ['x', 'yz'] * 100_000})",
        "value.shape, value['a'].sum(), value['b'].str.len_chars().sum()",
        "((200000, 2), 19999900000, 300000)"),
    "pyarrow": (
        "import pyarrow as pa\n"
        "value = pa.table({'a': list(range(200_000)), 'b': ['x', 'yz'] * 100_000})",
        "value.num_rows, value.column('a').to_pylist()[-1], str(value.schema.field('b').type)",
        "(200000, 199999, 'string')"),
    "statsmodels": (
        "import numpy as np\n"
        "import statsmodels.api as smapi\n"
        "_r = np.random.default_rng(0)\n"
        "xs = _r.random(200)\n"
        "value = smapi.OLS(2 * xs + _r.normal(0, 0.1, 200), smapi.add_constant(xs)).fit()",
        "[round(float(p), 3) for p in value.params], round(float(value.rsquared), 3)", None),
    "xarray": (
        "import numpy as np\n"
        "import xarray as xr\n"
        "value = xr.DataArray(np.arange(60_000.0).reshape(200, 300), dims=('x', 'y'),\n"
        "                     coords={'x': np.arange(200) * 10}, attrs={'units': 'm'})",
        "float(value.sum()), value.attrs['units'], int(value.x[-1])",
        "(1799970000.0, 'm', 1990)"),
    "sympy": (
        "import sympy\n"
        "t = sympy.symbols('t')\n"
        "value = sympy.integrate(sympy.sin(t) ** 2, t)",
        "str(value), str(sympy.diff(value, t).simplify())",
        "('t/2 - sin(t)*cos(t)/2', 'sin(t)**2')"),
}

# library: a cell whose outputs must be those of ipykernel
DISPLAYS = {
    "plotly": "import plotly.express as px\npx.scatter(x=[1, 2, 3], y=[4, 5, 6]).show()",
    "altair": ("import altair as alt\nimport pandas as pd\n"
               "alt.Chart(pd.DataFrame({'a': [1, 2], 'b': [3, 4]})).mark_point()"
               ".encode(x='a', y='b')"),
    "bokeh": ("from bokeh.io import output_notebook\nfrom bokeh.plotting import figure, show\n"
              "output_notebook()\nfig = figure()\nfig.line([1, 2], [3, 4])\nshow(fig)"),
    "sympy": "import sympy\nsympy.integrate(sympy.sin(sympy.Symbol('t')) ** 2)",
    "scikit-learn": ("from sklearn.linear_model import LogisticRegression\n"
                     "LogisticRegression()"),
    "polars": "import polars as pl\npl.DataFrame({'a': [1, 2], 'b': ['x', 'y']})",
}


# Values that pickle to other bytes once restored: pickle memoizes equal strings by
# identity, and which of an estimator's equal strings are one object differs after a
# load. Their bytes are still shared (the store grows by little), but the first cell
# that saves them again gives them a new symbol hash. Listed so that a fix shows.
REHASHED = {"scikit-learn", "statsmodels"}


@pytest.mark.parametrize("library", VALUES)
def test_a_value_survives_a_restart_and_is_not_stored_again(make_server, tmp_path, library):
    make, probe, expected = VALUES[library]
    data = tmp_path / "store"
    srv = make_server(data)
    made = srv.execute(make, new="made")
    assert made["volatile_symbols"] == [], made
    live = srv.value("made", probe)
    if expected is not None:
        assert live == expected
    hashes = srv.post("/symbol_hashes", {"state_name": "made", "symbols": ["value"]}).json()
    srv.stop()
    srv = make_server(data)
    assert srv.value("made", probe) == live
    # A cell that only reads the value stores none of it again, after a restart too.
    before = store_bytes(data)
    srv.execute("seen = type(value).__name__", state="made", new="read")
    assert store_bytes(data) - before < 2 ** 17
    again = srv.post("/symbol_hashes", {"state_name": "read", "symbols": ["value"]}).json()
    assert (again == hashes) == (library not in REHASHED)


@pytest.fixture(scope="module")
def ipykernel():
    """A real ipykernel, as a notebook front end drives it."""
    manager, client = jupyter_client.manager.start_new_kernel(kernel_name="python3",
                                                              env=jupyter_env())
    yield client
    client.stop_channels()
    manager.shutdown_kernel(now=True)


def shapes(outputs):
    """What a cell showed, by output type and MIME types."""
    return [(o["output_type"], sorted(o.get("data", {}))) for o in outputs
            if o["output_type"] != "stream"]


def in_ipykernel(client, code):
    """The outputs of `code` in ipykernel, as nbformat outputs."""
    outputs = []

    def keep(msg):
        """Keep the displays and results."""
        if msg["msg_type"] in ("display_data", "execute_result"):
            outputs.append(dict(msg["content"], output_type=msg["msg_type"]))

    reply = client.execute_interactive(code, output_hook=keep, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    return outputs


@pytest.mark.parametrize("library", DISPLAYS)
def test_outputs_are_those_of_ipykernel(server, ipykernel, library):
    ours = server.execute(DISPLAYS[library])["output"]
    assert shapes(ours) == shapes(in_ipykernel(ipykernel, DISPLAYS[library]))


def test_polars_thread_pool_in_a_state_run_from_twice(make_server, tmp_path):
    """A cell that starts polars' thread pool makes a state that a fork of its process
    cannot use (the pool's threads are gone, and polars waits for them forever): every
    run from that state answers, the second one too, before and after a restart."""
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import polars as pl\n"
                "df = pl.DataFrame({'a': list(range(100_000)), 'b': [i % 7 for i in range(100_000)]})",
                new="frame")
    agg = "df.group_by('b').agg(pl.col('a').sum()).sort('b')['a'].to_list()[:2]"
    expected = str([sum(range(0, 100_000, 7)), sum(range(1, 100_000, 7))])
    pooled = srv.execute(f"first = {agg}\nfirst", state="frame", new="pooled")
    assert pooled["output"][0]["data"]["text/plain"] == expected
    for restarted in (False, True):
        if restarted:
            srv.stop()
            srv = make_server(data)
        for _ in range(2):  # the second from the same state: no spare of its own left
            again = srv.execute(agg, state="pooled")
            assert again["output"][0]["data"]["text/plain"] == expected


def test_a_formula_reads_the_names_it_writes_after_a_restart(make_server, tmp_path):
    """patsy evaluates a statsmodels formula in the caller's namespace: `np` written only
    in the formula is a name the cell reads (accessed_symbols), loaded before the cell
    runs in a restored state."""
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import numpy as np\nfrom statsmodels.formula.api import ols\n"
                "data = {'x': np.arange(1.0, 11.0), 'y': 2 * np.log(np.arange(1.0, 11.0))}",
                new="made")
    srv.stop()
    srv = make_server(data)
    fitted = srv.execute("round(float(ols('y ~ np.log(x)', data=data).fit().params.iloc[1]), 6)",
                         state="made")
    assert "np" in fitted["accessed_symbols"], fitted["accessed_symbols"]
    assert fitted["output"][0]["data"]["text/plain"] == "2.0"


def test_bokeh_numbers_models_as_ipykernel_after_a_figure_is_shown(server, ipykernel):
    """Bokeh numbers its models from a counter (p1001, p1002, ...) that the ids in its
    output show: a shown figure is stored through dill and loaded once to check it,
    and that trial load does not advance the counter of the state."""
    cells = ["from bokeh.io import output_notebook, show\nfrom bokeh.plotting import figure\n"
             "output_notebook()",
             "p = figure(width=300, height=300)\np.line([1, 2, 3], [4, 6, 5])\nshow(p)",
             "int(figure().id[1:]) - int(p.id[1:])"]
    state = "initial"
    for code in cells:
        answer = server.execute(code, state)
        state = answer["state_name"]
    expected = in_ipykernel(ipykernel, "\n".join(cells[:2]) + "\n" + cells[2])
    assert answer["output"][-1]["data"]["text/plain"] == expected[-1]["data"]["text/plain"]


def test_bokeh_after_a_restart_is_as_in_ipykernel(make_server, tmp_path):
    """bokeh keeps in its modules whether output_notebook() was called, the counter that
    numbers its models, and the current document that `show` adds figures to: with the
    server restarted before every cell, each figure still shows, with the model ids of
    a new ipykernel, and a figure restored from the store shows again (in a new
    document it would raise that a model belongs to one document only). The second
    cell imports bokeh's plotting in a restored process, where its import numbers
    models of its own."""
    cells = ["from bokeh.io import output_notebook, show\noutput_notebook(hide_banner=True)",
             "from bokeh.plotting import figure\nbase = figure()",
             "p = figure(width=300, height=300)\np.line([1, 2, 3], [4, 6, 5])\nshow(p)",
             "q = figure(width=200, height=200)\nq.line([1, 2], [3, 4])\nshow(q)",
             "show(p)\nbase.id"]

    def ids(outputs):
        """The ids of the figures shown, and `base`'s."""
        html = [o["data"]["text/html"] for o in outputs
                if o["output_type"] == "display_data" and "text/html" in o["data"]]
        return ([i for h in html for i in re.findall(r'data-root-id="(p\d+)"', h)]
                + [outputs[-1]["data"]["text/plain"]])

    answers = restarted_before_every_cell(make_server, tmp_path / "store", cells)
    assert [a["error"] for a in answers] == [None] * len(cells), answers
    ours = ids([o for a in answers[2:] for o in a["output"]])
    manager, client = jupyter_client.manager.start_new_kernel(kernel_name="python3",
                                                              env=jupyter_env())
    try:
        expected = ids([o for code in cells for o in in_ipykernel(client, code)])
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert len(expected) == 4 and expected[0] == expected[2]
    assert ours == expected


def test_sympy_printing_is_as_in_ipykernel_after_a_restart(make_server, tmp_path, ipykernel):
    """`init_printing()` registers sympy's printers on IPython's display formatters and
    sets the rich reprs of sympy's base class: a restored state shows an expression as
    the live one and ipykernel do (Lecture-5-Sympy of the corpus)."""
    data = tmp_path / "store"
    srv = make_server(data)
    setup = "from sympy import *\ninit_printing()\nx = Symbol('x')"
    srv.execute(setup, new="printing")
    probe = "[x**2 / 3, x]"
    live = srv.execute(probe, state="printing")["output"]
    srv.stop()
    srv = make_server(data)
    restored = srv.execute(probe, state="printing")["output"]
    assert restored == live
    expected = in_ipykernel(ipykernel, setup + "\n" + probe)
    assert shapes(restored) == shapes(expected) == [
        ("execute_result", ["image/png", "text/latex", "text/plain"])]
    assert restored[0]["data"]["text/plain"] == expected[0]["data"]["text/plain"]
