"""The notebook-run request on its own (no server): the one model that the `run
--server` command builds POST /notebooks/run's body with and the route parses it with."""

import pytest

from snapkernel.api.validation import check_body
from snapkernel.kernel.errors import InvalidRequest
from snapkernel.kernel.notebook.model import FreshOptions, NotebookCell, NotebookRequest

CELLS = [NotebookCell(id="load", source="import math\nx = math.pi", index=0),
         NotebookCell(id="show", source="print(x)", index=1, tags=("raises-exception",))]

INCREMENTAL = NotebookRequest("/home/me/nb.ipynb", CELLS, order="dataflow", rerun=["load"],
                              exec_id="run-1", cwd="/home/me", allow_errors=True,
                              parameters={"alpha": 0.5, "name": "x"}, timeout=60.0,
                              cell_timeout=0.0)
FRESH = NotebookRequest("nb", CELLS, cwd="/srv/nb", parameters={"alpha": 0.5},
                        fresh=FreshOptions(timeout=30.0, cell_timeout=0.0, env=["LANG"],
                                           cwd="/srv/nb", expected_environment="0" * 64))


@pytest.mark.parametrize("request_", [INCREMENTAL, FRESH], ids=["incremental", "fresh"])
def test_the_body_a_client_builds_is_the_request_the_route_reads(request_):
    body = request_.to_json()
    check_body("/notebooks/run", "POST", body)  # what the route checks before parsing
    assert NotebookRequest.from_json(body) == request_


def test_cells_must_be_one_notebooks():
    body = INCREMENTAL.to_json()
    twice = dict(body, cells=body["cells"] + body["cells"][:1])
    with pytest.raises(InvalidRequest, match=r"cell id 'load' appears more than once"):
        NotebookRequest.from_json(twice)
    with pytest.raises(InvalidRequest, match=r"rerun names cell\(s\) not in the notebook: 'x'"):
        NotebookRequest.from_json(dict(body, rerun=["x"]))
