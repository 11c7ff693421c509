"""Notebook parameters as papermill has them: values, the injected cell, where it goes.

The rules are papermill's (2.x), written here again so that a papermill
user's command line and notebook behave as they know them:

- `-p NAME VALUE` reads VALUE as papermill does: `True`, `False` and
  `None` are those, then an int if `int()` takes it, then a float if
  `float()` does (so `nan`, `inf`, `1e3` and `1_000` too), else the string;
  `-r NAME VALUE` keeps the string. `-f FILE` and `-y TEXT` are YAML read
  safely, dates left as strings. Later ones win, in papermill's order:
  files, then YAML texts, then -p, then -r.
- The values become one code cell, `# Parameters` then `name = literal`
  per parameter, tagged `injected-parameters`. It replaces a cell already
  tagged so (a papermill output run again), else follows the first cell
  tagged `parameters`, else opens the notebook.

Where this differs: the cell is never reformatted by black (papermill
formats it when black is installed), so its source, and so its key,
depends on the values alone; its id is `injected-parameters`, not a
random one, so that runs of the same notebook name it alike; and a name
that is not a Python identifier, or a value that is not what JSON and
YAML give (str, int, float, bool, None, lists, mappings), is refused
before anything runs, where papermill would write a cell that fails.
"""

import dataclasses
import keyword
import math

from snapkernel.kernel.notebook.model import NotebookCell

PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
INJECTED_ID = "injected-parameters"
COMMENT = "# Parameters"


class ParameterError(ValueError):
    """A parameter that cannot be passed (its name or value), or an unreadable file."""


def from_text(value):
    """A `-p` value as papermill reads it."""
    if value in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[value]
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _yaml(text, where):
    """The mapping a YAML text holds ({} for an empty one); ParameterError otherwise."""
    try:
        import yaml
    except ImportError:
        raise ParameterError(f"{where}: reading YAML needs PyYAML (pip install pyyaml)") \
            from None

    class NoDates(yaml.SafeLoader):
        """YAML's safe loader, dates left as strings (as papermill reads them)."""
    NoDates.yaml_implicit_resolvers = {
        k: [r for r in v if r[0] != "tag:yaml.org,2002:timestamp"]
        for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    try:
        data = yaml.load(text, Loader=NoDates)
    except yaml.YAMLError as exc:
        raise ParameterError(f"{where} is not YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ParameterError(f"{where} must be a mapping of names to values, not a "
                             f"{type(data).__name__}")
    return data


def from_command_line(files=(), texts=(), pairs=(), raw=()):
    """The parameters of `-f` files, `-y` texts, `-p` and `-r` pairs, checked; later ones
    win. ParameterError naming the problem."""
    found = {}
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ParameterError(f"cannot read the parameters file {path}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
        found.update(_yaml(text, f"the parameters file {path}"))
    for text in texts:
        found.update(_yaml(text, f"-y {text!r}"))
    found.update((name, from_text(value)) for name, value in pairs)
    found.update(raw)
    check(found)
    return found


def check(parameters):
    """ParameterError unless every name is an identifier and every value can be written
    as a Python literal."""
    if not isinstance(parameters, dict):
        raise ParameterError("the parameters must be a mapping of names to values")
    for name, value in parameters.items():
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ParameterError(f"parameter name {name!r} is not a Python identifier")
        try:
            literal(value)
        except TypeError as exc:
            raise ParameterError(f"parameter {name!r}: {exc}") from None


def _string(value):
    """A string literal as papermill writes it: double quotes, unicode_escape."""
    return '"' + value.encode("unicode_escape").decode("utf-8").replace('"', '\\"') + '"'


def literal(value):
    """The Python source of a parameter value; TypeError for a value of another kind."""
    if value is None or isinstance(value, (bool, int)):
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "float('-inf')"
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        # papermill quotes a key that is not a string as it prints (1 -> "1").
        return "{" + ", ".join(f"{_string(k if isinstance(k, str) else str(k))}: {literal(v)}"
                               for k, v in value.items()) + "}"
    raise TypeError(f"a {type(value).__name__} cannot be a parameter (use strings, numbers, "
                    f"booleans, null, lists and mappings)")


def source(parameters):
    """The source of the injected cell."""
    return "".join([COMMENT + "\n"] + [f"{name} = {literal(value)}\n"
                                       for name, value in parameters.items()])


def placement(tag_lists):
    """Where the injected cell goes among cells with these tags: ("replace", i) for the
    cell tagged injected-parameters, ("insert", i) after the first tagged parameters (or
    at the top)."""
    tag_lists = [tuple(tags) for tags in tag_lists]
    for i, tags in enumerate(tag_lists):
        if INJECTED_TAG in tags:
            return "replace", i
    for i, tags in enumerate(tag_lists):
        if PARAMETERS_TAG in tags:
            return "insert", i + 1
    return "insert", 0


def unique_id(taken):
    """The injected cell's id: `injected-parameters`, unless a cell has it already."""
    cell_id = INJECTED_ID
    while cell_id in taken:
        cell_id += "-"
    return cell_id


def inject(cells, parameters):
    """`cells` (model.NotebookCell) with `parameters` injected: the cell tagged
    injected-parameters given their source, else a cell added after the first tagged
    parameters, else at the top; `cells` itself when there are no parameters."""
    if not parameters:
        return cells
    cells = [dataclasses.replace(c) for c in cells]
    how, at = placement(c.tags for c in cells)
    if how == "replace":
        cells[at].source = source(parameters)
        return cells
    index = cells[at - 1].index + 1 if at else 0
    for c in cells[at:]:
        c.index += 1
    cells.insert(at, NotebookCell(id=unique_id({c.id for c in cells}),
                                  source=source(parameters), index=index,
                                  tags=(INJECTED_TAG,)))
    return cells
