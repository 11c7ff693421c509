"""Widgets and progress bars through the Jupyter kernel (kernel/worker/capture/comms.py,
kernel/worker/widgets.py): comm messages both ways, live progress, widgets kept across
a server restart. Real kernels of the test kernelspec (tests/test_jupyter.py's set-up),
a real server, and JupyterLab in headless Chromium."""

import json
import re

import jsonschema
import pytest
import requests

from snapkernel.api.openapi import document
from support.jupyter import Kernel, data_dir, kernel, lab, server_info, stop_server  # noqa: F401 (fixtures)
from support.server import error_of, stream, wait_for

pytest.importorskip("ipywidgets")

SLIDER = "import ipywidgets\nslider = ipywidgets.IntSlider(value=3, max=10)\nslider\n"


def run(k, code, timeout=120):
    """Execute `code`: (the execute_reply content, every iopub message of the cell but
    its status)."""
    seen = []
    reply = k.client.execute_interactive(
        code, timeout=timeout,
        output_hook=lambda msg: seen.append(msg) if msg["msg_type"] != "status" else None)
    return reply["content"], seen


def send_comm(k, msg_type, content):
    """Send a comm message as a front end does; its iopub messages once the kernel is
    idle again."""
    msg = k.client.session.msg(msg_type, content)
    k.client.shell_channel.send(msg)
    return iopub_of(k, msg["header"]["msg_id"])


def iopub_of(k, msg_id):
    """The iopub messages whose parent is `msg_id` but its status, up to the kernel's
    idle again."""
    seen = []
    while True:
        got = k.client.get_iopub_msg(timeout=120)
        if got["parent_header"].get("msg_id") != msg_id:
            continue
        if got["msg_type"] == "status":
            if got["content"]["execution_state"] == "idle":
                return seen
        else:
            seen.append(got)


def reply_to(k, msg_id, wait):
    """The shell reply to `msg_id` (None if it has not come, when not `wait`); other
    replies are passed over (wait_for_ready may leave a kernel_info_reply behind)."""
    while wait or k.client.shell_channel.msg_ready():
        msg = k.client.get_shell_msg(timeout=120)
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg
    return None


def portable(messages, parent_id):
    """`messages` (not the status and execute_input) as comparable between two kernels:
    (type, parent, content), comm ids named by order of appearance, `parent_id` (the
    request's msg_id, wherever it appears: a parent header, an Output's msg_id) as
    "<parent>"."""
    kept = [(m["msg_type"], m["parent_header"].get("msg_id"), m["content"])
            for m in messages if m["msg_type"] not in ("status", "execute_input")]
    text = json.dumps(kept).replace(parent_id, "<parent>")
    names = {}
    text = re.sub(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])",
                  lambda m: names.setdefault(m.group(), f"comm{len(names)}"), text)
    return json.loads(text)


@pytest.fixture
def ipykernel():
    """A kernel of ipykernel (kernelspec python3), the reference."""
    k = Kernel(spec="python3")
    yield k
    k.stop()


def make_slider(k):
    """Run SLIDER; the slider's comm id, checked against what the front end got."""
    reply, seen = run(k, SLIDER)
    assert reply["status"] == "ok", reply
    opens = [m["content"] for m in seen if m["msg_type"] == "comm_open"
             and m["content"]["data"]["state"].get("_model_name") == "IntSliderModel"]
    assert len(opens) == 1, seen
    assert opens[0]["target_name"] == "jupyter.widget"
    assert opens[0]["data"]["state"]["value"] == 3
    assert opens[0]["data"]["state"]["max"] == 10
    comm_id = opens[0]["comm_id"]
    views = [m["content"]["data"] for m in seen if m["msg_type"] == "execute_result"]
    assert views[0]["application/vnd.jupyter.widget-view+json"]["model_id"] == comm_id
    # The front end learns of the comm before it shows its view.
    kinds = [m["msg_type"] for m in seen]
    assert kinds.index("comm_open") < kinds.index("execute_result")
    return comm_id


def move_slider(k, comm_id, value):
    """A front end's update of the slider's value; the kernel's echo of it."""
    seen = send_comm(k, "comm_msg", {"comm_id": comm_id, "data": {
        "method": "update", "state": {"value": value}, "buffer_paths": []}})
    echoes = [m["content"]["data"] for m in seen if m["msg_type"] == "comm_msg"]
    assert {"method": "echo_update", "state": {"value": value}, "buffer_paths": []} in echoes
    return seen


def test_widgets_through_the_api(make_server, tmp_path):
    """A streamed /execute carries a widget's comm messages as lines of the documented
    schema; a handled front-end message (protocol.comm_cell) makes a state whose widget
    has the value, kept over a restart; a widget of a cell's class is volatile, by name."""
    from snapkernel.kernel.protocol import comm_cell
    srv = make_server(tmp_path / "data")
    answers = document()["paths"]["/execute"]["post"]["responses"]["200"]["content"]
    line_schema = answers["application/x-ndjson"]["schema"]
    lines = list(stream(srv, "/execute", {
        "code": SLIDER + "class Mine(ipywidgets.IntSlider):\n    pass\nmine = Mine(value=4)\n",
        "exec_id": "w1", "state_name": "initial", "new_state_name": "w1"}))
    comms = [x for x in lines if x["type"] == "comm"]
    for line in comms:
        jsonschema.validate(line, line_schema)
    opens = [x for x in comms if x["msg_type"] == "comm_open"]
    sliders = [x["content"] for x in opens
               if x["content"]["data"]["state"].get("_model_name") == "IntSliderModel"]
    assert [s["data"]["state"]["value"] for s in sliders] == [3, 4]
    answer = lines[-1]["answer"]
    assert answer["state_name"] == "w1" and answer["volatile_symbols"] == ["Mine", "mine"]
    assert not any(o["output_type"] == "comm" for o in answer["output"])
    moved = srv.execute(comm_cell("comm_msg", {"comm_id": sliders[0]["comm_id"], "data": {
        "method": "update", "state": {"value": 8}, "buffer_paths": []}}), "w1", "w2")
    assert moved["volatile_symbols"] == ["Mine", "mine"]
    srv.execute("slider.max = 20", "w2", "w2b")  # a cell's change, from a later state
    srv.stop()
    srv = make_server(tmp_path / "data")
    assert srv.value("w2", "slider.value, slider.max, mine.value") == "(8, 10, 4)"
    assert srv.value("w2b", "slider.value, slider.max") == "(8, 20)"
    assert srv.value("w1", "slider.value") == "3"
    bad = srv.execute(comm_cell("comm_msg", {"data": {}}), "w2", "w3", ok=False)
    assert bad["error"]["ename"] == "KeyError" and bad["state_name"] is None
    # What no comm or target here takes makes no state; an unknown target is closed.
    unknown = srv.execute(comm_cell("comm_msg", {"comm_id": "nope", "data": {}}), "w2", "w3",
                          ok=False)
    assert unknown["error"]["ename"] == "CommNotHandled" and unknown["state_name"] is None
    lines = list(stream(srv, "/execute", {
        "code": comm_cell("comm_open", {"comm_id": "c1", "target_name": "nobody", "data": {}}),
        "exec_id": "w4", "state_name": "w2", "new_state_name": "w4"}))
    assert [x["msg_type"] for x in lines if x["type"] == "comm"] == ["comm_close"]
    assert lines[-1]["answer"]["error"]["ename"] == "CommNotHandled"
    assert srv.get("/states/w4").status_code == 404


def test_a_moved_widget_is_described_as_it_is(server):
    """A slider moved from the page, or by a cell, pickles as before (its value is in the
    state's context), yet the state describes it with its new value."""
    from snapkernel.kernel.protocol import comm_cell
    server.execute(SLIDER, new="d1")
    comm_id = server.value("d1", "slider.model_id").strip("'")
    server.execute(comm_cell("comm_msg", {"comm_id": comm_id, "data": {
        "method": "update", "state": {"value": 8}, "buffer_paths": []}}), "d1", "d2")
    server.execute("slider.value = 5", "d2", "d3")
    described = {name: server.get(f"/states/{name}").json()["variables"]["slider"]["repr"]
                 for name in ("d1", "d2", "d3")}
    assert described == {"d1": "IntSlider(value=3, max=10)",
                         "d2": "IntSlider(value=8, max=10)",
                         "d3": "IntSlider(value=5, max=10)"}


def test_message_id_through_the_api(make_server, tmp_path):
    """/execute's message_id is the running cell's parent message id, by which an Output
    widget captures (and none without it); a bad one is a JSON 400 naming the field."""
    srv = make_server(tmp_path / "data")
    srv.execute("import ipywidgets\nout = ipywidgets.Output()", new="o1")
    capture = "with out:\n    print(repr(out.msg_id))\nprint(repr(out.msg_id))\n"
    answer = srv.execute(capture, "o1", extra={"message_id": "request-7"})
    assert [o["text"] for o in answer["output"]] == ["'request-7'\n''\n"]
    answer = srv.execute(capture, "o1")
    assert [o["text"] for o in answer["output"]] == ["''\n''\n"]
    body = {"code": "1", "exec_id": "bad", "state_name": "o1"}
    for value, message in [
            (5, "field 'message_id' must be string or null"),
            ("", "field 'message_id' must be longer than or equal to 1 characters"),
            ("a\nb", "field 'message_id' must not contain control characters"),
            ("m" * 257, "field 'message_id' must be shorter than or equal to 256 characters")]:
        assert error_of(srv.post("/execute", dict(body, message_id=value)), 400) == {
            "type": "BadRequest", "message": message}, value


def test_slider_both_ways(kernel):
    """A slider made in a cell reaches the front end; a value set there reaches the
    kernel, and the next cell reads it; comm_info_request lists the comm."""
    comm_id = make_slider(kernel)
    move_slider(kernel, comm_id, 7)
    assert kernel.text("print(slider.value)") == "7\n"
    kernel.client.comm_info(target_name="jupyter.widget")
    info = kernel.client.get_shell_msg(timeout=60)
    assert info["msg_type"] == "comm_info_reply"
    assert info["content"]["comms"][comm_id] == {"target_name": "jupyter.widget"}
    # An observer of the widget runs where the widget lives, and prints to the front end.
    kernel.text("seen = []\nslider.observe(lambda change: print('moved to', change['new']),"
                " 'value')")
    seen = move_slider(kernel, comm_id, 2)
    assert [m["content"]["text"] for m in seen if m["msg_type"] == "stream"] == ["moved to 2\n"]
    assert kernel.text("print(slider.value)") == "2\n"


def test_progress_bar_updates_while_its_cell_runs(kernel, gate):
    """tqdm.auto draws a widget bar whose updates reach the front end while the cell is
    still running (it waits at a gate the test opens only once it saw them)."""
    door = gate()
    code = ("from tqdm.auto import tqdm\nbar = tqdm(total=3, mininterval=0)\nbar.update(1)\n"
            + door.code + "bar.update(2)\nbar.close()\ndel bar\n")
    msg_id = kernel.client.execute(code)
    values = []

    def progress():
        """The bar's values seen so far (comm_msg updates of its FloatProgress)."""
        while kernel.client.iopub_channel.msg_ready():
            msg = kernel.client.get_iopub_msg(timeout=1)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "comm_msg":
                state = msg["content"]["data"].get("state", {})
                if "value" in state:
                    values.append(state["value"])
            if msg["msg_type"] == "comm_open":
                assert msg["content"]["target_name"] == "jupyter.widget"
        return values

    wait_for(lambda: 1 in progress(), what="the bar at 1 of 3 while its cell runs")
    assert reply_to(kernel, msg_id, wait=False) is None  # the cell has not ended
    door.open()
    reply = reply_to(kernel, msg_id, wait=True)
    assert reply["content"]["status"] == "ok", reply["content"]
    wait_for(lambda: 3 in progress(), what="the bar at 3 of 3")


def test_widget_survives_a_server_restart(kernel, data_dir):  # noqa: F811
    """A widget comes back after a server restart with the value the front end set, and
    still answers the front end under the same id; a widget of a class a cell defined
    is volatile, reported by name."""
    comm_id = make_slider(kernel)
    move_slider(kernel, comm_id, 7)
    reply, _ = run(kernel, "class Mine(ipywidgets.IntSlider):\n    pass\n"
                           "mine = Mine(value=4)\nmine.value = 5\n")
    assert reply["status"] == "ok", reply
    stop_server(data_dir)
    assert kernel.text("print(slider.value, slider.max, type(slider).__name__, "
                       "slider.layout.__class__.__name__)") == "7 10 IntSlider Layout\n"
    move_slider(kernel, comm_id, 9)
    assert kernel.text("print(slider.value)") == "9\n"
    # Not rebuilt from its model: remade by its cell (replayed), with that cell's value.
    assert kernel.text("print(mine.value)") == "5\n"


def test_output_widget_captures_as_in_ipykernel(kernel, ipykernel):
    """`with out:` sets the Output widget's msg_id to the running cell's, whose parent
    header the print inside carries (JupyterLab moves such outputs into the widget), and
    back to "" after: the same messages as from ipykernel, and the same state after."""
    seen = {}
    for name, k in (("ours", kernel), ("ipykernel", ipykernel)):
        reply, _ = run(k, "import ipywidgets as widgets\nout = widgets.Output()\n"
                          "display(out)")
        assert reply["status"] == "ok", reply
        reply, messages = run(k, "with out:\n    print('hi')\nprint('after')")
        assert reply["status"] == "ok", reply
        seen[name] = portable(messages, messages[0]["parent_header"]["msg_id"])
        assert k.text("print(repr(out.msg_id), out.outputs)") == "'' ()\n"
    update = {"method": "update", "buffer_paths": []}
    assert seen["ours"] == [
        ["comm_msg", "<parent>", {"comm_id": "comm0", "data": dict(update, state={
            "msg_id": "<parent>"})}],
        ["stream", "<parent>", {"name": "stdout", "text": "hi\n"}],
        ["comm_msg", "<parent>", {"comm_id": "comm0", "data": dict(update, state={
            "msg_id": ""})}],
        ["stream", "<parent>", {"name": "stdout", "text": "after\n"}]]
    assert seen["ours"] == seen["ipykernel"]


def test_interact_output_after_a_slider_move_as_in_ipykernel(kernel, ipykernel):
    """An interact function's print, when the front end moves its slider, goes into the
    Output widget: the widget's msg_id is the front end's comm_msg's, and the print
    carries that parent header; the same messages as from ipykernel."""
    seen = {}
    code = ("from ipywidgets import interact\n@interact(x=(0, 10))\ndef f(x):\n"
            "    print('x is', x)\n")
    for name, k in (("ours", kernel), ("ipykernel", ipykernel)):
        reply, messages = run(k, code)
        assert reply["status"] == "ok", reply
        cell = portable(messages, messages[0]["parent_header"]["msg_id"])
        slider = [m["content"]["comm_id"] for m in messages if m["msg_type"] == "comm_open"
                  and m["content"]["data"]["state"]["_model_name"] == "IntSliderModel"]
        msg = k.client.session.msg("comm_msg", {"comm_id": slider[0], "data": {
            "method": "update", "state": {"value": 7}, "buffer_paths": []}})
        k.client.shell_channel.send(msg)
        moved = portable(iopub_of(k, msg["header"]["msg_id"]), msg["header"]["msg_id"])
        seen[name] = ([m for m in cell if m[0] != "comm_open"], moved)
    cell, moved = seen["ours"]
    assert ["stream", "<parent>", {"name": "stdout", "text": "x is 5\n"}] in cell
    update = {"method": "update", "buffer_paths": []}
    assert moved == [  # comm0: the slider, comm1: interact's Output widget
        ["comm_msg", "<parent>", {"comm_id": "comm0", "data": dict(
            update, method="echo_update", state={"value": 7})}],
        ["comm_msg", "<parent>", {"comm_id": "comm1", "data": dict(update, state={
            "msg_id": "<parent>"})}],
        ["clear_output", "<parent>", {"wait": True}],
        ["stream", "<parent>", {"name": "stdout", "text": "x is 7\n"}],
        ["comm_msg", "<parent>", {"comm_id": "comm1", "data": dict(update, state={
            "msg_id": ""})}]]
    assert seen["ours"] == seen["ipykernel"]


def slider_values_made(data_dir, notebook):
    """The values of `slider` in the states the front end's comm messages made in the
    session of `notebook` (a path), as the kernelspec's server describes them."""
    info = server_info(data_dir)
    params = {"token": info["token"]}
    names = requests.get(f"{info['url']}/states", params=params, timeout=60).json()["states"]
    values = []
    for name in names:
        if name.startswith(f"jupyter/{notebook}/") and ".comm_msg-" in name:
            described = requests.get(f"{info['url']}/states/{name}", params=params, timeout=60)
            values += re.findall(r"value=(\d+)", described.json()["variables"]["slider"]["repr"])
    return sorted(int(v) for v in values)


def test_widgets_in_jupyterlab(lab, data_dir):
    """In JupyterLab in headless Chromium: a slider renders, moving it with the keyboard
    changes the value the next cell reads, and a tqdm.auto bar shows."""
    By, Keys = lab.By, lab.Keys
    lab.open("widgets.ipynb")
    lab.run_in_last_cell(SLIDER.strip())

    def readouts():
        """The texts of the sliders' readouts on the page."""
        return [e.text for e in lab.browser.find_elements(By.CSS_SELECTOR,
                                                          ".widget-slider .widget-readout")]

    wait_for(lambda: readouts() == ["3"], timeout=120, what="the slider to render at 3")
    handle = lab.browser.find_element(By.CSS_SELECTOR, ".widget-slider .noUi-handle")
    handle.click()
    handle.send_keys(Keys.ARROW_RIGHT, Keys.ARROW_RIGHT, Keys.ARROW_RIGHT)
    wait_for(lambda: readouts() == ["6"], what="the slider moved to 6 on the page")
    # The page sends one move and holds the next until the kernel is idle after it
    # (ipywidgets' throttle): the kernel has them all once a state holds the last.
    wait_for(lambda: 6 in slider_values_made(data_dir, lab.root / "widgets.ipynb"),
             timeout=120,
             what="the kernel to take the slider's last move")
    lab.run_in_last_cell("print('the kernel reads', slider.value)")
    wait_for(lambda: "the kernel reads 6" in lab.outputs(), timeout=120,
             what="the next cell to read the value set on the page")
    lab.run_in_last_cell("from tqdm.auto import tqdm\nfor i in tqdm(range(4), desc='steps'):\n"
                         "    pass")

    def bars():
        """The progress bars' texts (description and count; tqdm pads with figure
        spaces, made plain here) on the page."""
        return [" ".join(e.text.split()) for e in lab.browser.find_elements(By.CSS_SELECTOR,
                                                          ".jp-OutputArea-output")
                if e.find_elements(By.CSS_SELECTOR, ".widget-hprogress .progress-bar")]

    wait_for(lambda: any("steps: 100%" in b and "4/4" in b for b in bars()), timeout=120,
             what="tqdm's bar to show 4/4")


def test_output_widget_in_jupyterlab(lab):
    """In JupyterLab in headless Chromium: what `with out:` prints shows inside the Output
    widget, not in its cell's own output; an interact function's output changes in its
    widget when the slider moves."""
    By, Keys = lab.By, lab.Keys
    lab.open("output.ipynb")

    def shown(text, in_widget):
        """True when an output on the page is `text`, inside an Output widget's area (or
        a cell's own output, which is not one that shows a widget)."""
        return lab.browser.execute_script(
            "return Array.from(document.querySelectorAll('.jp-OutputArea-output')).some("
            "e => e.textContent.trim() === arguments[0] && (arguments[1] ? "
            "e.closest('.widget-output') !== null : e.querySelector('.jupyter-widgets') "
            "=== null && e.closest('.jupyter-widgets') === null))", text, in_widget)

    lab.run_in_last_cell("import ipywidgets as widgets\nout = widgets.Output()\ndisplay(out)")
    wait_for(lambda: lab.browser.find_elements(By.CSS_SELECTOR, ".widget-output"),
             timeout=120, what="the Output widget to render")
    lab.run_in_last_cell("with out: print('inside the widget')\nprint('beside it')")
    wait_for(lambda: shown("beside it", False), timeout=120, what="the cell's own print")
    wait_for(lambda: shown("inside the widget", True), what="the print inside the widget")
    assert not shown("inside the widget", False)
    lab.run_in_last_cell("from ipywidgets import interact\n@interact(x=(0, 10))\n"
                         "def f(x): print('x is', x)")
    wait_for(lambda: shown("x is 5", True), timeout=120, what="interact's first output")
    handles = lab.browser.find_elements(By.CSS_SELECTOR, ".widget-slider .noUi-handle")
    handles[-1].click()
    handles[-1].send_keys(Keys.ARROW_RIGHT, Keys.ARROW_RIGHT)
    wait_for(lambda: shown("x is 7", True), timeout=120,
             what="interact's output after the slider moved to 7")
    assert not shown("x is 5", True) and not shown("x is 7", False)
