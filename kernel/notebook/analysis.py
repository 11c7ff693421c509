"""What a notebook cell defines, deletes, reads and imports, from its parse alone.

Nothing is executed or imported. IPython syntax is first turned into Python
with IPython's TransformerManager, as the executor does (kernel/worker/execution.py).
The magics that come out of it as `get_ipython().run_line_magic(...)` are
read by name: a few whose effect on the namespace is known (`%matplotlib`,
`%time CODE`, `%%capture NAME`, `!cmd`, ...); any other counts as reading
every name and possibly binding any.

Scopes are resolved as Python resolves them: names bound in a function
body, lambda or comprehension are local to it; `global` and `nonlocal` are
honoured. A global read inside a function body (or a lambda, or a
generator expression) happens when it is called, in the namespace of the
caller, possibly a later cell: such names are the cell's `deferred_reads`
(and count among its `reads` too). Likewise `global x; x = ...` in a
function body is a `deferred_write`. A top-level read of a name the cell
has already bound by an earlier unconditional statement (`df = load()`
then `df = df.dropna()`) is not a free read. A name bound only on some
paths (in an `if`, `for`, `try`, `with`, `match` or a walrus) keeps its
earlier value on the others, so the cell reads it too.

Over-approximation is allowed, a miss is not: where reads cannot be known
(`eval`, `exec`, `globals()`, `vars()`, `from m import *`, frame
inspection, `df.query` strings, unknown magics) the cell is `dynamic`: it
reads every name defined before it. Where it may also bind names the parse
does not show (`exec`, `globals()[...] =`, a star import, an unknown
magic), it has `unknown_writes`.
"""

import ast
import builtins
import dataclasses
import keyword
import re

from snapkernel.kernel.worker.reads import DYNAMIC_ATTRS, DYNAMIC_NAMES

# Names found in builtins: a read of one is a read of a notebook name only when a
# cell defines it (graph.py decides). `display` is ours, installed in builtins.
BUILTINS = frozenset(dir(builtins)) | {"display"}
# Of the dynamic names and attributes, those through which code can also bind names.
_WRITING_NAMES = frozenset({"exec", "eval", "globals", "vars", "locals", "get_ipython",
                            "__import__"})
_WRITING_ATTRS = DYNAMIC_ATTRS - {"query", "eval"}
_IMPORTING_NAMES = frozenset({"__import__", "get_ipython"})
_IMPORTING_ATTRS = frozenset({"import_module", "run_path", "run_module"})

# Magics that neither read nor bind notebook names (their argument line has no
# `$name` or `{expr}` to expand).
_PURE_LINE_MAGICS = frozenset({
    "matplotlib", "config", "load_ext", "reload_ext", "autoreload", "pip", "conda",
    "mamba", "precision", "xmode", "colors", "pprint"})
_PURE_CELL_MAGICS = frozenset({
    "writefile", "html", "HTML", "javascript", "js", "latex", "markdown", "svg", "bash",
    "sh", "script", "python", "python2", "python3", "pypy", "perl", "ruby"})
# What IPython's transformer makes of magics and shell escapes.
_MAGIC_METHODS = frozenset({"run_line_magic", "run_cell_magic", "system", "getoutput"})

# Statements after which a name they bind is certainly bound (no other path).
_SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Import, ast.ImportFrom,
           ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Delete, ast.Expr,
           ast.Pass, ast.Global, ast.Nonlocal, ast.Assert, ast.Raise)
# Scopes whose code runs later than the statement that makes them.
_LAZY = frozenset({"function", "lambda", "genexp"})
_IDENTIFIER = re.compile(r"[^\W\d]\w*")
# Where a name is bound, read from the text of a cell that does not parse.
_BINDING_SITES = [
    re.compile(r"^[ \t]*([^=\n#'\"]*?)(?:[-+*/%&|^@]|//|\*\*|>>|<<)?=(?!=)", re.MULTILINE),
    re.compile(r"\b(?:def|class)[ \t]+(\w+)"),
    re.compile(r"^[ \t]*(?:from[ \t]+\S+[ \t]+)?import[ \t]+([^#\n]*)", re.MULTILINE),
    re.compile(r"\bas[ \t]+(\w+)"),
    re.compile(r"\bfor[ \t]+([^#\n]*?)[ \t]+in\b"),
    re.compile(r"(\w+)[ \t]*:="),
    re.compile(r"\bglobal[ \t]+([\w \t,]+)"),
]


@dataclasses.dataclass(frozen=True)
class CellAnalysis:
    """What one cell does to the notebook's names, as far as the parse shows."""

    defines: frozenset = frozenset()     # names it may bind at top level, or via `global`
    assigns: frozenset = frozenset()     # of those, bound by a plain binding (not only +=)
    augments: frozenset = frozenset()    # names it rebinds with an augmented assignment
    deletes: frozenset = frozenset()     # names it deletes at top level
    reads: frozenset = frozenset()       # free names it reads (builtin names included)
    deferred_reads: frozenset = frozenset()   # read when its functions run (in `reads` too)
    deferred_writes: frozenset = frozenset()  # bound when its functions run (`global`)
    imports: frozenset = frozenset()     # modules it imports, as written
    dynamic: bool = False                # reads cannot be known: it reads every name
    unknown_writes: bool = False         # it may bind names the parse does not show
    unknown_imports: bool = False        # it may import modules the parse does not show
    error: dict = None                   # {"message", "line", "column"} if it does not parse
    # Of a cell that does not parse: the names it seems to bind (before `=`, after `def`,
    # `class`, `import`, `as`, `for`, ...), for the cells that need it to wait for a fix.
    probable_defines: frozenset = frozenset()
    # What its result depends on that its code does not show: the clock calls it makes
    # ("datetime.now()", "%timeit"), the global generators it draws from as
    # (generator, call) with generator "random", "numpy" (seeded by their `seed`) or
    # "os" (never seeded: uuid4, os.urandom, a generator made without a seed), and the
    # generators it seeds ("random", "numpy").
    clock: frozenset = frozenset()
    draws: frozenset = frozenset()
    seeds: frozenset = frozenset()
    runs: frozenset = frozenset()        # the files it runs with `%run FILE`, as written

    @property
    def free_reads(self):
        """The names read, builtins excluded."""
        return self.reads - BUILTINS


class _Scope:
    """A Python scope: which names are local to it."""

    def __init__(self, kind, parent, local=(), declared_global=(), declared_nonlocal=(),
                 lazy=None):
        """`kind`: module, function, lambda, class, comprehension or genexp."""
        self.kind = kind
        self.parent = parent
        self.locals = set(local)
        self.globals = set(declared_global)
        self.nonlocals = set(declared_nonlocal)
        # True when code in this scope runs later than the cell's statement.
        self.lazy = lazy if lazy is not None else (
            kind in _LAZY or (parent is not None and parent.lazy))


class _Binder(ast.NodeVisitor):
    """The names a block of statements binds in its own scope (nested scopes skipped)."""

    def __init__(self):
        """Nothing found yet."""
        self.bound, self.globals, self.nonlocals = set(), set(), set()

    def visit_Name(self, node):
        """A stored or deleted name."""
        if not isinstance(node.ctx, ast.Load):
            self.bound.add(node.id)

    def visit_FunctionDef(self, node):
        """The function's name; its defaults and decorators run here, its body not."""
        self.bound.add(node.name)
        for expr in [*node.decorator_list, *node.args.defaults,
                     *(d for d in node.args.kw_defaults if d is not None)]:
            self.visit(expr)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        """The class's name; its bases and decorators run here."""
        self.bound.add(node.name)
        for expr in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expr)

    def visit_Lambda(self, node):
        """Only the defaults run here."""
        for expr in [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]:
            self.visit(expr)

    def _comprehension(self, node):
        """A walrus inside a comprehension binds in the enclosing scope."""
        for sub in ast.walk(node):
            if isinstance(sub, ast.NamedExpr):
                self.bound.add(sub.target.id)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def visit_Import(self, node):
        """`import a.b` binds a; `import a.b as c` binds c."""
        for alias in node.names:
            if alias.name != "*":
                self.bound.add(alias.asname or alias.name.split(".")[0])

    visit_ImportFrom = visit_Import

    def visit_Global(self, node):
        """Declared global: not local."""
        self.globals.update(node.names)

    def visit_Nonlocal(self, node):
        """Declared nonlocal: not local."""
        self.nonlocals.update(node.names)

    def visit_ExceptHandler(self, node):
        """`except E as e` binds e."""
        if node.name:
            self.bound.add(node.name)
        self.generic_visit(node)

    def visit_MatchAs(self, node):
        """A capture pattern."""
        if node.name:
            self.bound.add(node.name)
        self.generic_visit(node)

    visit_MatchStar = visit_MatchAs

    def visit_MatchMapping(self, node):
        """`**rest` in a mapping pattern."""
        if node.rest:
            self.bound.add(node.rest)
        self.generic_visit(node)


def _block_scope(kind, parent, body, params=()):
    """The scope of a function or class body: its own bindings found first."""
    binder = _Binder()
    for stmt in body:
        binder.visit(stmt)
    local = (binder.bound | set(params)) - binder.globals - binder.nonlocals
    return _Scope(kind, parent, local, binder.globals, binder.nonlocals)


def _params(args):
    """Every parameter name of an ast.arguments."""
    names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return names


def _is_dunder(name):
    """Dunders (__name__, __builtins__) are the interpreter's, not the notebook's."""
    return name.startswith("__") and name.endswith("__")


class _Analyser(ast.NodeVisitor):
    """Walks a cell's module, statement by statement, collecting its names."""

    def __init__(self):
        """An empty module scope."""
        self.scope = _Scope("module", None)
        self.conditional = False
        self.bound_before = set()
        self.stmt_bound, self.stmt_unbound = set(), set()
        self.found = {f.name: set() for f in dataclasses.fields(CellAnalysis)
                      if f.type is frozenset}
        self.dynamic = self.unknown_writes = self.unknown_imports = False

    def run(self, tree):
        """Analyse a parsed cell; returns a CellAnalysis."""
        self.statements(tree.body)
        return CellAnalysis(dynamic=self.dynamic, unknown_writes=self.unknown_writes,
                            unknown_imports=self.unknown_imports,
                            **{k: frozenset(v) for k, v in self.found.items()})

    def statements(self, body, conditional=False):
        """Top-level statements in order: what each binds for sure counts for the next."""
        for stmt in body:
            saved = self.conditional
            self.conditional = conditional or not isinstance(stmt, _SIMPLE)
            self.stmt_bound, self.stmt_unbound = set(), set()
            self.visit(stmt)
            self.conditional = saved
            self.bound_before -= self.stmt_unbound
            self.bound_before |= self.stmt_bound

    # Names ---------------------------------------------------------------------

    def _is_global(self, name, scope=None):
        """True when a load of `name` in `scope` reaches the notebook's namespace.

        Class bodies read names as LOAD_NAME does (their own, else the
        globals), so a class-local name is also counted as a global read.
        """
        s = scope or self.scope
        while s.kind != "module":
            if name in s.globals:
                return True
            if s.kind != "class" and (name in s.locals or name in s.nonlocals):
                return False
            s = s.parent
        return True

    def load(self, name):
        """A read of `name` in the current scope."""
        if _is_dunder(name) or not self._is_global(name):
            return
        if name in DYNAMIC_NAMES:
            self.dynamic = True
            self.unknown_writes |= name in _WRITING_NAMES
            self.unknown_imports |= name in _IMPORTING_NAMES
        if self.scope.lazy:
            self.found["deferred_reads"].add(name)
            self.found["reads"].add(name)
        elif name not in self.bound_before:
            self.found["reads"].add(name)

    def bind(self, name, kind="assign", walrus=False):
        """`name` bound (kind assign or augment) or deleted (kind delete) in the current scope."""
        scope = self.scope
        if walrus:
            while scope.kind in ("comprehension", "genexp"):
                scope = scope.parent
        if _is_dunder(name):
            return
        if scope.kind == "module":
            self._module_bind(name, kind, self.conditional or walrus)
        elif name in scope.globals:
            if scope.lazy:
                self.found["deferred_writes"].add(name)
                self.found["defines"].add(name)
                self.found["assigns"].add(name)
            else:  # `global x` in a class body: bound while the class statement runs
                self._module_bind(name, kind, True)

    def _module_bind(self, name, kind, maybe):
        """A binding or deletion of a notebook name by the cell's own statements."""
        found = self.found
        if kind == "delete":
            found["deletes"].add(name)
            if name not in self.bound_before:
                found["reads"].add(name)  # `del x` needs x
            self.stmt_unbound.add(name)
            return
        found["defines"].add(name)
        found["assigns" if kind == "assign" else "augments"].add(name)
        if maybe:
            self.stmt_unbound.add(name)
            if name not in self.bound_before:
                found["reads"].add(name)  # kept as it was on the paths that do not bind it
        else:
            self.stmt_bound.add(name)

    # Scopes ------------------------------------------------------------------

    def _in_scope(self, scope, nodes):
        """Visit `nodes` inside `scope`."""
        saved, self.scope = self.scope, scope
        try:
            for node in nodes:
                self.visit(node)
        finally:
            self.scope = saved

    def visit_FunctionDef(self, node):
        """Decorators, defaults and annotations now; the body when called."""
        args = node.args
        now = [*node.decorator_list, *args.defaults,
               *(d for d in args.kw_defaults if d is not None)]
        now += [a.annotation for a in [*args.posonlyargs, *args.args, *args.kwonlyargs,
                                       args.vararg, args.kwarg]
                if a is not None and a.annotation is not None]
        if node.returns is not None:
            now.append(node.returns)
        for expr in now:
            self.visit(expr)
        self.bind(node.name)
        self._in_scope(_block_scope("function", self.scope, node.body, _params(args)),
                       node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        """Defaults now; the body when called."""
        args = node.args
        for expr in [*args.defaults, *(d for d in args.kw_defaults if d is not None)]:
            self.visit(expr)
        self._in_scope(_Scope("lambda", self.scope, _params(args)), [node.body])

    def visit_ClassDef(self, node):
        """Decorators, bases and the body run now."""
        for expr in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expr)
        self._in_scope(_block_scope("class", self.scope, node.body), node.body)
        self.bind(node.name)

    def _comprehension(self, node, parts):
        """The first iterable runs in the enclosing scope, the rest in the comprehension's."""
        first, *rest = node.generators
        self.visit(first.iter)
        targets = set()
        for gen in node.generators:
            targets |= {n.id for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
        kind = "genexp" if isinstance(node, ast.GeneratorExp) else "comprehension"
        inner = [first.target, *first.ifs]
        for gen in rest:
            inner += [gen.iter, gen.target, *gen.ifs]
        self._in_scope(_Scope(kind, self.scope, targets), inner + parts)

    def visit_ListComp(self, node):
        """[elt for ...]"""
        self._comprehension(node, [node.elt])

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node):
        """{key: value for ...}"""
        self._comprehension(node, [node.key, node.value])

    # Statements and expressions ------------------------------------------------

    def visit_Name(self, node):
        """A read, binding or deletion."""
        if isinstance(node.ctx, ast.Load):
            self.load(node.id)
        else:
            self.bind(node.id, "delete" if isinstance(node.ctx, ast.Del) else "assign")

    def visit_AugAssign(self, node):
        """`x += v` reads x, then rebinds it."""
        self.visit(node.value)
        if isinstance(node.target, ast.Name):
            self.load(node.target.id)
            self.bind(node.target.id, "augment")
        else:
            self.visit(node.target)

    def visit_AnnAssign(self, node):
        """`x: T = v` binds x; `x: T` alone binds nothing."""
        self.visit(node.annotation)
        if node.value is not None:
            self.visit(node.value)
            self.visit(node.target)
        elif not isinstance(node.target, ast.Name):
            self.visit(node.target)

    def visit_NamedExpr(self, node):
        """A walrus binds in the nearest enclosing scope that is not a comprehension."""
        self.visit(node.value)
        self.bind(node.target.id, walrus=True)

    def visit_Import(self, node):
        """`import a.b [as c]`."""
        for alias in node.names:
            self._imported(alias.name)
            self.bind(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node):
        """`from m import a [as b]`; `from m import *` binds what it finds."""
        self._imported("." * node.level + (node.module or ""))
        for alias in node.names:
            if alias.name == "*":
                self.dynamic = self.unknown_writes = True
            else:
                self.bind(alias.asname or alias.name)

    def _imported(self, module):
        """Record an imported module; `__main__` is the namespace itself."""
        self.found["imports"].add(module)
        if module == "__main__":
            self.dynamic = self.unknown_writes = True

    def visit_ExceptHandler(self, node):
        """`except E as e` binds e (and deletes it after the handler)."""
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.bind(node.name)
        for stmt in node.body:
            self.visit(stmt)

    def visit_MatchAs(self, node):
        """A capture pattern binds its name."""
        if node.pattern is not None:
            self.visit(node.pattern)
        if node.name:
            self.bind(node.name)

    def visit_MatchStar(self, node):
        """`*rest` in a sequence pattern."""
        if node.name:
            self.bind(node.name)

    def visit_MatchMapping(self, node):
        """`**rest` in a mapping pattern."""
        self.generic_visit(node)
        if node.rest:
            self.bind(node.rest)

    def visit_Attribute(self, node):
        """Attributes through which code reaches any global by name make the cell dynamic."""
        self.visit(node.value)
        if node.attr in DYNAMIC_ATTRS:
            self.dynamic = True
            self.unknown_writes |= node.attr in _WRITING_ATTRS
        self.unknown_imports |= node.attr in _IMPORTING_ATTRS

    def visit_Call(self, node):
        """A magic or shell escape (as IPython's transformer writes them), or any call."""
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in _MAGIC_METHODS
                and isinstance(func.value, ast.Call) and not func.value.args
                and isinstance(func.value.func, ast.Name)
                and func.value.func.id == "get_ipython" and not node.keywords
                and all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                        for a in node.args)):
            args = [a.value for a in node.args]
            if func.attr in ("run_line_magic", "run_cell_magic") and args[:1] in (
                    ["time"], ["timeit"]):
                self.found["clock"].add(f"%{args[0]}")
            if func.attr == "run_line_magic" and len(args) == 2 and args[0] == "run":
                self.found["runs"].update([w for w in args[1].split() if
                                           not w.startswith("-")][:1])
            self._magic(func.attr, args)
            return
        self._outside(node)
        self.generic_visit(node)

    def _outside(self, node):
        """Note a call that reads the clock, draws from or seeds a global generator."""
        parts = _dotted(node.func)
        if not parts:
            return
        text = ".".join(parts) + "()"
        owner, attr = (parts[-2] if len(parts) > 1 else None), parts[-1]
        first = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) \
            else None
        if ((owner, attr) in _CLOCK_CALLS or (owner, attr) in _CLOCK_WITHOUT_ARGUMENT and
                not node.args or attr in _CLOCK_CONSTRUCTORS and first in ("now", "today")):
            self.found["clock"].add(text if first is None else f"{text[:-1]}{first!r})")
        elif owner == "random" and len(parts) == 2:  # the standard library's
            if attr == "seed":
                self.found["seeds"].add("random")
            elif attr == "Random" and not node.args:
                self.found["draws"].add(("os", text))
            elif attr in _STDLIB_DRAWS:
                self.found["draws"].add(("random", text))
        elif owner == "random":  # np.random, numpy.random
            if attr == "seed":
                self.found["seeds"].add("numpy")
            elif attr in _UNSEEDED_WITHOUT_ARGUMENT:
                if not node.args and not node.keywords:
                    self.found["draws"].add(("os", text))
            elif attr not in _NUMPY_NOT_DRAWS and not attr.startswith("_"):
                self.found["draws"].add(("numpy", text))
        elif attr == "sample" and len(parts) > 1 and not any(
                k.arg == "random_state" for k in node.keywords):  # pandas' df.sample()
            self.found["draws"].add(("numpy", f".{attr}()"))
        elif (owner, attr) in _OS_DRAWS or owner == "secrets":
            self.found["draws"].add(("os", text))

    # Magics ------------------------------------------------------------------

    def _unknown_magic(self):
        """A magic whose reads and writes are unknown."""
        self.dynamic = self.unknown_writes = self.unknown_imports = True

    def _magic(self, method, args):
        """The effect of one magic or shell escape on the namespace."""
        expands = lambda text: "$" in text or "{" in text  # IPython's var_expand  # noqa: E731
        if method in ("system", "getoutput"):
            if len(args) != 1 or expands(args[0]):
                self.dynamic = True
            return
        if method == "run_line_magic" and len(args) == 2:
            name, line = args
            if expands(line):
                self._unknown_magic()
            elif name == "time":
                self._inline_code(line)
            elif name == "timeit" and not line.lstrip().startswith("-"):
                self._inline_code(line, local=True)
            elif name not in _PURE_LINE_MAGICS:
                self._unknown_magic()
            return
        if method == "run_cell_magic" and len(args) == 3:
            name, line, body = args
            if expands(line):
                self._unknown_magic()
            elif name == "time" and not line.strip():
                self._inline_code(body)
            elif name == "timeit" and not line.strip():
                self._inline_code(body, local=True)
            elif name == "capture":
                names = [w for w in line.split() if not w.startswith("-")]
                if len(names) > 1 or (names and not names[0].isidentifier()):
                    self._unknown_magic()
                    return
                self._inline_code(body)
                for n in names:
                    self.bind(n)
            elif name not in _PURE_CELL_MAGICS:
                self._unknown_magic()
            return
        self._unknown_magic()

    def _inline_code(self, code, local=False):
        """Code a magic runs in the namespace (local=True: in a scope of its own, as %timeit)."""
        try:
            tree = ast.parse(_python_source(code))
        except (SyntaxError, ValueError):
            self.dynamic = True  # the magic fails when it runs; read everything meanwhile
            return
        if local:
            scope = _block_scope("function", self.scope, tree.body)
            scope.lazy = self.scope.lazy
            self._in_scope(scope, tree.body)
        else:
            saved = self.conditional
            self.conditional = True
            try:
                for stmt in tree.body:
                    self.visit(stmt)
            finally:
                self.conditional = saved


_transformer = []


def _dotted(node):
    """["np", "random", "rand"] of `np.random.rand`; [] when it does not start at a name
    (a method of a call's result: `df.head().sample`)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1] if isinstance(node, ast.Name) else []


# The common ways to read the clock: (owner, attribute) as written, `datetime.now()`,
# `dt.datetime.now()`, `pd.Timestamp.today()`, `time.time()`.
_CLOCK_CALLS = frozenset({
    ("datetime", "now"), ("datetime", "today"), ("datetime", "utcnow"), ("date", "today"),
    ("Timestamp", "now"), ("Timestamp", "today"), ("Timestamp", "utcnow"),
    ("time", "time"), ("time", "time_ns"), ("time", "perf_counter"),
    ("time", "perf_counter_ns"), ("time", "monotonic"), ("time", "process_time")})
# The clock when called with no argument (`time.localtime(t)` converts t).
_CLOCK_WITHOUT_ARGUMENT = frozenset({("time", "localtime"), ("time", "gmtime"),
                                     ("time", "ctime"), ("time", "asctime")})
# Constructors that read the clock given "now" or "today": np.datetime64('today').
_CLOCK_CONSTRUCTORS = frozenset({"datetime64", "Timestamp", "to_datetime", "Period"})
# The standard library random module's draws from its global generator.
_STDLIB_DRAWS = frozenset({
    "random", "randint", "randrange", "choice", "choices", "shuffle", "sample", "uniform",
    "triangular", "gauss", "normalvariate", "lognormvariate", "expovariate",
    "vonmisesvariate", "gammavariate", "betavariate", "paretovariate",
    "weibullvariate", "getrandbits", "randbytes", "binomialvariate"})
# numpy.random names that draw nothing from its global generator.
_NUMPY_NOT_DRAWS = frozenset({
    "seed", "get_state", "set_state", "default_rng", "RandomState", "Generator",
    "SeedSequence", "BitGenerator", "PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"})
# Generators that are seeded from the operating system when made without a seed.
_UNSEEDED_WITHOUT_ARGUMENT = frozenset({"default_rng", "RandomState", "Generator"})
_OS_DRAWS = frozenset({("uuid", "uuid1"), ("uuid", "uuid4"), ("os", "urandom")})


def _python_source(source):
    """The cell as Python: IPython's transformer applied when IPython is installed."""
    if not _transformer:
        try:
            from IPython.core.inputtransformer2 import TransformerManager
            _transformer.append(TransformerManager)
        except ImportError:
            _transformer.append(None)
    if _transformer[0] is None:
        return source
    try:
        return _transformer[0]().transform_cell(source)
    except SyntaxError:
        return source  # Python's parser reports it, with line and column


def _broken(source, message, line, column):
    """The analysis of a cell that does not parse: it runs nothing, and seems to bind
    the names found at binding sites of its text."""
    seems = set()
    for pattern in _BINDING_SITES:
        for match in pattern.finditer(source):
            seems.update(w for w in _IDENTIFIER.findall(match.group(1))
                         if not keyword.iskeyword(w))
    return CellAnalysis(error={"message": message, "line": line, "column": column},
                        probable_defines=frozenset(seems - {"import"}))


def analyse(source):
    """The CellAnalysis of one cell's source."""
    python = _python_source(source)
    try:
        tree = ast.parse(python)
        # The compiler's own checks (`return` outside a function, ...), on the parsed tree.
        compile(tree, "<cell>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError as exc:
        return _broken(source, f"{type(exc).__name__}: {exc.msg}", exc.lineno, exc.offset)
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, absurd nesting
        return _broken(source, f"{type(exc).__name__}: {exc}", None, None)
    return _Analyser().run(tree)
