"""Plain regression tests of the defects the differential tester (tests/test_differential.py)
found, each its minimal sequence: a notebook run with `main.py run --server`, a user's
action, the run again, compared with a clean Run All (nbclient with ipykernel).
"""

import os

import pytest

from support.fidelity import run_in_jupyter
from support.notebook import png_sizes, run_command, write_notebook
from support.server import TOKEN


def run_server(srv, folder, cells, n):
    """Write the notebook of `cells` [(id, source)] in `folder` and run it through server
    `srv`; [outputs of each code cell]."""
    path = os.path.join(folder, "notebook.ipynb")
    write_notebook(path, cells)
    _, outputs = run_command(path, os.path.join(os.path.dirname(folder), f"out{n}.ipynb"),
                             "--server", srv.url, "--token", TOKEN)
    return outputs


def text(outputs):
    """The stdout and text/plain of a cell's outputs, joined."""
    return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                   for o in outputs)


@pytest.fixture
def folder(tmp_path):
    """The notebook's folder."""
    path = tmp_path / "nb"
    path.mkdir()
    return str(path)


def test_a_file_written_with_open_w_is_kept(make_server, folder):
    """[with open('out.txt', 'w') as f: f.write(...)], [print(open('out.txt').read())]."""
    srv = make_server()
    cells = [("w", "with open('out.txt', 'w') as f:\n    f.write('line 1\\n' * 3)"),
             ("r", "print(open('out.txt').read())")]
    outputs = run_server(srv, folder, cells, 1)
    with open(os.path.join(folder, "out.txt")) as f:
        assert f.read() == "line 1\n" * 3
    assert "line 1\nline 1\nline 1" in text(outputs[1])


def test_a_seeded_draw_after_a_comment_is_the_first_draw(make_server, folder):
    """[import numpy as np; np.random.seed(1)], [np.random.rand(3)]; a comment added to the
    draw; run again: the first draw after the seed, as a Run All gives."""
    srv = make_server()
    cells = [("s", "import numpy as np\nnp.random.seed(1)"), ("d", "np.random.rand(3)")]
    first = text(run_server(srv, folder, cells, 1)[1])
    assert "4.17022005e-01" in first
    cells[1] = ("d", "np.random.rand(3)\n# edited")
    assert text(run_server(srv, folder, cells, 2)[1]) == first


def test_a_figure_after_classic_style_is_drawn_at_jupyters_size(make_server, folder):
    """[plt.style.use('classic')], [%matplotlib inline; plt.plot(...)]; the server
    restarted and the plot cell edited: the figure has Jupyter's size."""
    cells = [("s", "import matplotlib.pyplot as plt\nplt.style.use('classic')"),
             ("p", "%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 2]);")]
    path = os.path.join(folder, "notebook.ipynb")
    write_notebook(path, cells)
    jupyter = png_sizes(run_in_jupyter([path], slots=1, in_own_folder=True)[path][1][1])
    srv = make_server()
    run_server(srv, folder, cells, 1)
    srv.stop()
    srv = make_server(srv.data_dir)
    cells[1] = ("p", cells[1][1] + "\n# edited")
    assert png_sizes(run_server(srv, folder, cells, 2)[1]) == jupyter


def test_an_edited_data_file_is_read_again(make_server, folder):
    """[print(open('data.txt').read())]; data.txt edited; run again: the new text."""
    srv = make_server()
    data = os.path.join(folder, "data.txt")
    with open(data, "w") as f:
        f.write("value 1\n")
    cells = [("r", "print(open('data.txt').read())")]
    assert "value 1" in text(run_server(srv, folder, cells, 1)[0])
    with open(data, "w") as f:
        f.write("value 2\n")
    assert "value 2" in text(run_server(srv, folder, cells, 2)[0])
