"""Which names a cell binds, deletes and reads: the candidates of its namespace delta.

Contract
--------
    names = scan(code)              # CellNames(bound, deleted, reads), or None if `code` is not
                                    # Python; `code` is IPython's transformed source
    code_global_names(code_object)  # global names a code object (and those nested in it)
                                    # loads, stores or deletes; cached per code object

`bound`: names the cell binds at module level (assignment incl. augmented/annotated/starred/
walrus, for/with/except-as/match targets, def/class, import/import-from, `global` declarations
in functions). `deleted`: module-level `del` targets. `reads`: every ast.Name load anywhere in
the cell, so `model.train()`, `df['x'] = 1` and `lst.append(3)` count as reads of the base name.
Code passed as a string constant to exec/eval and to get_ipython().run_line_magic /
run_cell_magic (what `%time ...` and `%%timeit` become) is scanned the same way, three levels
deep. Pure: no namespace is touched.
"""

import ast
import dis
import itertools
import sys
import types
import weakref
from collections import namedtuple

__all__ = ["CellNames", "UNKNOWN_NAMES", "scan", "code_global_names"]


CellNames = namedtuple("CellNames", "bound deleted reads")
# What to assume of code that could not be scanned: it may have read anything ("?" is no name a
# namespace holds).
UNKNOWN_NAMES = CellNames(frozenset(), frozenset(), frozenset({"?"}))
_MAGIC_ARGS = {"run_line_magic": (1, 2), "run_cell_magic": (1, 3), "run_cell": (0, 1)}


class _Scanner(ast.NodeVisitor):
    """Collects module-level bindings/deletions and all loaded names of a cell."""

    def __init__(self, depth=0):
        self.bound, self.deleted, self.reads = set(), set(), set()
        self._scopes = ["module"]  # "module" | "function" | "class" | "comprehension"
        self._depth = depth

    def _module_level(self):
        return self._scopes[-1] == "module"

    def _bind(self, name):
        if self._module_level():
            self.bound.add(name)

    def _in_scope(self, kind, nodes):
        self._scopes.append(kind)
        try:
            for node in nodes:
                self.visit(node)
        finally:
            self._scopes.pop()

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self.reads.add(node.id)
        elif isinstance(node.ctx, ast.Del):
            if self._module_level():
                self.deleted.add(node.id)
        else:
            self._bind(node.id)

    def visit_AugAssign(self, node):
        if isinstance(node.target, ast.Name):
            self.reads.add(node.target.id)
        self.generic_visit(node)

    def visit_NamedExpr(self, node):
        # := binds in the nearest enclosing non-comprehension scope.
        outer = next(s for s in reversed(self._scopes) if s != "comprehension")
        if outer == "module":
            self.bound.add(node.target.id)
        self.visit(node.value)

    def _visit_function(self, node, name=None):
        for d in getattr(node, "decorator_list", ()):
            self.visit(d)
        args = node.args
        for default in itertools.chain(args.defaults, [d for d in args.kw_defaults if d]):
            self.visit(default)
        for a in itertools.chain(args.posonlyargs, args.args, args.kwonlyargs,
                                 [x for x in (args.vararg, args.kwarg) if x]):
            if a.annotation is not None:
                self.visit(a.annotation)
        if getattr(node, "returns", None) is not None:
            self.visit(node.returns)
        if name is not None:
            self._bind(name)
        body = node.body if isinstance(node.body, list) else [node.body]
        self._in_scope("function", body)

    def visit_FunctionDef(self, node):
        self._visit_function(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self._visit_function(node)

    def visit_ClassDef(self, node):
        for n in itertools.chain(node.decorator_list, node.bases, node.keywords):
            self.visit(n)
        self._bind(node.name)
        self._in_scope("class", node.body)

    def _visit_comprehension(self, node, elts):
        gens = node.generators
        self.visit(gens[0].iter)  # evaluated in the enclosing scope
        self._scopes.append("comprehension")
        try:
            for i, g in enumerate(gens):
                self.visit(g.target)
                if i:
                    self.visit(g.iter)
                for cond in g.ifs:
                    self.visit(cond)
            for e in elts:
                self.visit(e)
        finally:
            self._scopes.pop()

    def visit_ListComp(self, node):
        self._visit_comprehension(node, [node.elt])

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node):
        self._visit_comprehension(node, [node.key, node.value])

    def visit_Global(self, node):
        if not self._module_level():
            self.bound.update(node.names)

    def visit_Import(self, node):
        for alias in node.names:
            self._bind(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node):
        for alias in node.names:
            if alias.name != "*":  # star imports are caught by the binding (id) comparison
                self._bind(alias.asname or alias.name)

    def visit_ExceptHandler(self, node):
        if node.name:
            self._bind(node.name)
        self.generic_visit(node)

    def visit_MatchAs(self, node):
        if node.name:
            self._bind(node.name)
        self.generic_visit(node)

    def visit_MatchStar(self, node):
        if node.name:
            self._bind(node.name)

    def visit_MatchMapping(self, node):
        if node.rest:
            self._bind(node.rest)
        self.generic_visit(node)

    def visit_Call(self, node):
        self.generic_visit(node)
        if self._depth >= 3:
            return
        f = node.func
        span = None
        if isinstance(f, ast.Name) and f.id in ("exec", "eval"):
            span = (0, 1)
        elif isinstance(f, ast.Attribute) and f.attr in _MAGIC_ARGS:
            span = _MAGIC_ARGS[f.attr]
        if span is None:
            return
        for arg in node.args[span[0]:span[1]]:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                sub = scan(arg.value, self._depth + 1, transform=True)
                if sub is not None:
                    self.bound |= sub.bound if self._module_level() else set()
                    self.deleted |= sub.deleted if self._module_level() else set()
                    self.reads |= sub.reads | sub.bound


def scan(code, depth=0, transform=False):
    """CellNames of `code`, or None if it is not Python."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        tree = None
        if transform and "IPython" in sys.modules:  # magic arguments may use IPython syntax
            try:
                from IPython.core.inputtransformer2 import TransformerManager

                tree = ast.parse(TransformerManager().transform_cell(code))
            except Exception:
                tree = None
        if tree is None:
            return None
    s = _Scanner(depth)
    try:
        s.visit(tree)
    except RecursionError:
        return None
    return CellNames(frozenset(s.bound), frozenset(s.deleted), frozenset(s.reads))


_code_names_cache = weakref.WeakKeyDictionary()
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL",
                         "STORE_NAME", "DELETE_NAME"})


def code_global_names(code):
    """Global names a code object (and the code objects nested in it) loads/stores."""
    try:
        return _code_names_cache[code]
    except (KeyError, TypeError):
        pass
    names = set()
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_OPS and isinstance(ins.argval, str):
            names.add(ins.argval)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= code_global_names(c)
    result = frozenset(names)
    try:
        _code_names_cache[code] = result
    except TypeError:
        pass
    return result
