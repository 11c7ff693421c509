"""Test helper: run cells through the real server, as a notebook client does."""

import nbformat


def validated(answer):
    """The answer of /execute, its outputs and error checked against nbformat's v4 schema."""
    for out in answer["output"]:
        nbformat.validate(out, ref="output", version=4)
    error = answer["error"]
    if error is not None:
        assert set(error) == {"ename", "evalue", "traceback"}, error
        nbformat.validate(dict(error, output_type="error"), ref="output", version=4)
    return answer


def run(server, *cells, state="initial"):
    """Run `cells` one after the other, each from the state the previous successful one
    made (a failed cell makes none); return their validated answers."""
    answers = []
    for code in cells:
        answer = validated(server.execute(code, state, ok=False))
        answers.append(answer)
        state = answer["state_name"] or state
    return answers


def texts(outputs):
    """Compact view of outputs: (stream name, text) / (output type, MIME keys) pairs."""
    view = []
    for out in outputs:
        if out["output_type"] == "stream":
            view.append((out["name"], out["text"]))
        else:
            view.append((out["output_type"], tuple(sorted(out["data"]))))
    return view
