"""Completion and inspection from the head state's namespace, in a worker.

The kernel process holds no namespace: it sends the source of one of the
functions below through /multistate_execute on the head state (nothing is
stored), and the function answers with one `application/json` display.
They run in the worker's namespace, so they import what they need inside,
remove their own name first (it must not show among the completions),
and reach `display` and `get_ipython` through builtins (a notebook may
define its own `display`). IPython's completer runs without jedi there:
jedi's import would cost every completion about a second in a fresh child.
"""

import inspect
import uuid

from snapkernel.api.client import ServerError

TYPES_KEY = "_jupyter_types_experimental"  # the key ipykernel and JupyterLab use


def _snapk_complete(code, cursor_pos):
    """IPython's completions at `cursor_pos`, as ipykernel's complete_reply has them."""
    import builtins
    from IPython.core.completer import IPCompleter, provisionalcompleter, rectify_completions
    namespace = globals()
    del namespace["_snapk_complete"]
    shell = builtins.get_ipython()
    completer = IPCompleter(shell=shell, namespace=namespace, global_namespace=namespace,
                            parent=shell, use_jedi=False)
    with provisionalcompleter():
        found = list(rectify_completions(code, completer.completions(code, cursor_pos)))
    reply = {"matches": [c.text for c in found],
             "cursor_start": found[0].start if found else cursor_pos,
             "cursor_end": found[0].end if found else cursor_pos,
             "types": [{"start": c.start, "end": c.end, "text": c.text, "type": c.type,
                        "signature": c.signature} for c in found]}
    builtins.display({"application/json": reply}, raw=True)


def _snapk_inspect(code, cursor_pos, detail_level, omit_sections):
    """IPython's inspector on the name at `cursor_pos`, as ipykernel's inspect_reply has it."""
    import builtins
    from IPython.utils.tokenutil import token_at_cursor
    del globals()["_snapk_inspect"]
    shell = builtins.get_ipython()
    name = token_at_cursor(code, cursor_pos)
    try:
        data = shell.object_inspect_mime(name, detail_level=detail_level,
                                         omit_sections=omit_sections)
        found = True
    except KeyError:
        data, found = {}, False
    if not shell.enable_html_pager:
        data.pop("text/html", None)
    builtins.display({"application/json": {"data": data, "found": found}}, raw=True)


def _call(client, state, function, timeout, *args):
    """Run `function(*args)` in a worker on `state`; its JSON answer, or None if it failed
    (or if there is no client: the server could not be reached)."""
    if client is None:
        return None
    code = inspect.getsource(function) + f"{function.__name__}(*{args!r})\n"
    try:
        answer = client.evaluate(code, state, f"introspect-{uuid.uuid4().hex}", timeout)
    except ServerError:
        return None
    for out in answer["output"]:
        if out["output_type"] == "display_data" and "application/json" in out["data"]:
            return out["data"]["application/json"]
    return None


def complete(client, state, code, cursor_pos, timeout):
    """The content of a complete_reply."""
    found = _call(client, state, _snapk_complete, timeout, code, cursor_pos)
    if found is None:
        return {"status": "ok", "matches": [], "cursor_start": cursor_pos,
                "cursor_end": cursor_pos, "metadata": {}}
    return {"status": "ok", "matches": found["matches"], "cursor_start": found["cursor_start"],
            "cursor_end": found["cursor_end"], "metadata": {TYPES_KEY: found["types"]}}


def inspect_object(client, state, code, cursor_pos, detail_level, omit_sections, timeout):
    """The content of an inspect_reply."""
    found = _call(client, state, _snapk_inspect, timeout, code, cursor_pos, detail_level,
                  sorted(omit_sections))
    if found is None:
        return {"status": "ok", "data": {}, "metadata": {}, "found": False}
    return {"status": "ok", "data": found["data"], "metadata": {}, "found": found["found"]}
