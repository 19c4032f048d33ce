"""Namespace state replication for nbos replicas: compute, serialize and apply cell deltas.

Every kernel runs as three replicas whose IPython user namespaces must stay identical. The
replica that executes a cell computes the *delta* of its namespace (what the cell bound, changed
or deleted), serializes it into one byte string for the Raft log, and the standbys apply it.
Large array/tensor buffers do not travel through the log: they go to a content-addressed blob
store and the delta carries only their keys.

API
---
    sync = StateSync(namespace, hidden, store, oob_threshold=64 * 1024, replica_id=None)

    cell = sync.begin(code)         # before the cell runs; `code` is the *transformed* Python
                                    # source (IPython's transform_cell output)
    delta, problems = sync.end(cell)  # after the cell ran (also after it raised); b"" when the
                                      # cell bound, changed and deleted no name
        # problems: list of Unreplicable(name, reason) 2-tuples with .type_name and .message(),
        #   e.g. "nbos: cannot replicate 'f' (TextIOWrapper): open file objects cannot be
        #   replicated". A problem is reported once per (name, object); the delta still carries
        #   every other name, and standbys bind the name to a NotReplicated placeholder.
    sync.apply(delta)               # on a standby: fetches the blobs it lacks, then applies;
                                    # returns [Unreplicable] for names whose value could not be
                                    # rebuilt on this replica (normally []), bound to placeholders
    sync.blob_keys(delta)           # blob keys a delta/snapshot refers to (for prefetching)
    data = sync.snapshot()          # full state: every non-hidden name + object tokens
    sync.restore(data)              # rebuild the namespace (and object table) from scratch;
                                    # returns like apply()
    describe(data)                  # the parsed header of a delta/snapshot (names, keys, ...)

`store` is any object with put(bytes|memoryview) -> str key (idempotent, content-addressed),
get(key) -> a buffer (bytes, or a fresh writable buffer per call that arrays and tensors rebuilt
from it may keep as their memory) and contains(key) -> bool. `hidden` is IPython's
`user_ns_hidden` (anything supporting `in`); names matching IPython's own conventions (_, __,
___, _i, _ii, _iN, _N, _oh, _ih, _dh, In, Out, exit, quit, get_ipython, dunder names) are always
skipped.

This module must be importable under the same name ("nbos_state") on every replica: pickles
refer to a few of its helpers and to NotReplicated by module name.

Which names a cell changed
--------------------------
Candidates are found without scanning the namespace contents:
  * names the cell binds at module level (assignment incl. augmented/annotated/starred/walrus,
    for/with/except-as/match targets, def/class, import/import-from, `global` declarations in
    functions); they are always sent unless they were read and their fingerprint and binding
    are unchanged;
  * names whose binding changed: the id() of every non-hidden value is recorded before and
    after the cell (a key/id pass, no hashing). This catches new names, deleted names
    (%reset -f, del globals()['x']) and rebinding through exec/globals()/%run/star imports;
  * names the cell *reads* (ast.Name loads anywhere in the cell, so `model.train()`,
    `df['x'] = 1`, `lst.append(3)` count as reads of the base name), plus the global names read
    by notebook functions, methods of notebook classes and bound methods the cell touches
    (transitively, from their bytecode). These are fingerprinted before and after the cell and
    sent when the fingerprint changed. Code passed as a string constant to exec/eval and to
    get_ipython().run_line_magic/run_cell_magic (what `%time ...`, `%%timeit` become) is
    scanned the same way.
Fingerprints: tensors use (_version, data_ptr, shape, stride, offset, dtype, device,
requires_grad) plus a hash of the bytes (tensors <= 1 MiB) or of ~1024 sampled elements
(larger; catches writes through `.data`, which do not bump `_version`), plus the grad's
fingerprint; numpy arrays hash their bytes (sha256); everything else hashes its pickle with
tensors/arrays replaced by their fingerprints and out-of-band buffers hashed, not copied.
An object that cannot be fingerprinted counts as changed.

Identity
--------
One pickler (protocol 5, cloudpickle's) writes all changed values of a delta, so objects shared
between changed names stay shared: it writes one pickle stream per name, in sequence, sharing its
memo. A standby loads them in order with one unpickler; if one name's value cannot be rebuilt
there (say a module the standby lacks), only that name and the names that share its objects
become placeholders, instead of the whole delta failing. Across cells identity is kept by:
  * an object table of tokens (both sides: token <-> weak reference) for every torch.Tensor
    (strided), numpy ndarray (non-object dtype), torch.nn.Module, torch.optim.Optimizer and LR
    scheduler that is replicated. Such objects are pickled by token. On apply a known token
    reuses the existing object and updates it in place (tensor: copy_ under no_grad, or
    `.data =` when shape/dtype changed; ndarray: arr[...] = new; module/optimizer: its state is
    re-applied to the same object), so `opt.param_groups[0]['params'][0] is model.weight`
    holds on the standby across cells; unknown tokens create and register a new object. Tensors
    and arrays larger than `oob_threshold` go to the blob store (only when their content
    changed since they were last stored: the table remembers fingerprint -> key); smaller ones
    are inlined. Parameters' .grad is replicated (as its own tracked tensor).
  * top-level names: an object bound to a name whose binding did not change in the cell is
    sent as "the object at name Y, with this content" and updated in place on the standby
    (lists, dicts, sets, bytearrays and objects with the default reduce protocol), so
    `b = a` and objects held inside other objects (trainer.cfg is cfg) keep their identity.
    If the cell read Y and Y's fingerprint did not change, only a reference is sent.
  * functions defined in the notebook are rebuilt with __globals__ = the standby's namespace
    (so `global` statements and global lookups behave as on the executor); classes defined in
    the notebook are pickled by value (cloudpickle keeps one class object per definition).
  * modules are pickled by name (with the submodules that were imported on the executor).
  * any other PickleBuffer larger than `oob_threshold` is stored out-of-band in the blob store.

Supported / not supported
-------------------------
  * Views: a tensor/array that is a view of another (x = t[0], df column views, t.numpy()) is
    replicated as an independent copy; later in-place writes through the base do not propagate
    to it on standbys unless the view itself is re-sent.
  * Non-leaf tensors (with a grad_fn) are replicated detached, with requires_grad=False, so a
    later `loss.backward()` after failover fails loudly instead of silently doing nothing.
    Autograd graphs, hooks on tensors and attributes set on tensor objects are not replicated.
  * CUDA tensors are copied to host (`t.detach().cpu()`) for storage and rebuilt on the same
    device when the standby has it, else on CPU (untested here: no GPU).
  * Sparse/quantized/nested tensors use torch's own pickling (by value, no token).
  * Nested mutable objects that are neither tracked types nor bound to a top-level name lose
    identity across cells (e.g. `e = d['k']` in one cell and `d['k'].append(1)` in a later
    cell that does not read `e`). Closures sharing a cell between functions get separate cells.
  * Mutations that the cell cannot be seen to touch (exec of a non-constant string, %run of a
    script that mutates existing objects, threads running in the background) are missed; so is
    a rebinding whose new object happens to reuse the old id (requires the old one to die first).
  * Unpicklable values (open files, sockets, generators, locks, threads, ...) are reported and
    replaced by NotReplicated placeholders that raise NotReplicatedError on any use except repr.
    A name whose binding did not change keeps the standby's existing placeholder (no new report).
  * functools.lru_cache wrappers are rebuilt around the replicated function with an empty cache.
  * A pickled IPython shell (`ip = get_ipython()`) becomes the standby's own shell.
  * Side effects outside the namespace (cwd, os.environ, sys.path, RNG states) are not handled.

Delta / snapshot format (little endian)
---------------------------------------
    offset 0   4 bytes  magic b"NBSD"
    offset 4   1 byte   format version (FORMAT_VERSION = 1); other versions are rejected
    offset 5   1 byte   kind: b"D" delta, b"S" snapshot
    offset 6   u32      header length H
    offset 10  H bytes  UTF-8 JSON header:
                 {"set": [names carried in the payload, in payload order],
                  "types": [type name of each of them],
                  "offsets": [byte offset in the payload of each name's pickle],
                  "oob_index": [index in "oob" of each name's first out-of-band buffer],
                  "del": [names to delete],
                  "bad": [[name, type name, reason], ...]   (bind a NotReplicated placeholder),
                  "blobs": [[token or null, key], ...]      (tracked buffers in the store),
                  "oob": [key, ...]                         (pickle-5 out-of-band buffers,
                                                             in buffer order),
                  "origin": replica id or null,
                  "payload": key                            (only when the payload is in the
                                                             store: over payload_threshold)}
    offset 10+H        payload: the protocol-5 pickles of the values of "set", concatenated,
                       written by one pickler (later ones refer to objects of earlier ones
                       through the shared memo: load them in order with one unpickler); empty
                       when "payload" names its blob

A store that fails while end() or snapshot() writes: what it would have held goes inline (the
payload, arrays, tensors, bytes, buffers), up to fallback_limit_bytes; StateSync.store_fallback
then says how much. Past the limit end() reports every changed name and snapshot() raises.
"""

import ast
import copyreg
import dis
import enum
import functools
import hashlib
import importlib
import io
import itertools
import json
import os
import pickle
import pickletools
import re
import sys
import threading
import types
import warnings
import weakref
from collections import namedtuple

import cloudpickle

try:  # cloudpickle internals used to pickle notebook classes through the object table
    from cloudpickle import cloudpickle as _cp
    from cloudpickle import cloudpickle_fast as _cpf

    _class_getnewargs = _cpf._class_getnewargs
    _class_getstate = _cpf._class_getstate
    _class_setstate = _cpf._class_setstate
    _should_pickle_by_reference = _cp._should_pickle_by_reference
    _BUILTIN_TYPES = frozenset(_cp._BUILTIN_TYPE_NAMES) | {
        type(None), type(Ellipsis), type(NotImplemented)}
except (ImportError, AttributeError):  # pragma: no cover - other cloudpickle versions
    _class_getnewargs = None

__all__ = [
    "FORMAT_VERSION",
    "StateSync",
    "NotReplicated",
    "NotReplicatedError",
    "DeltaFormatError",
    "DeltaApplyError",
    "Unreplicable",
    "describe",
    "is_hidden_name",
]

FORMAT_VERSION = 1
MAGIC = b"NBSD"
KIND_DELTA = ord("D")
KIND_SNAPSHOT = ord("S")
_PROTOCOL = 5
_EXACT_TENSOR_FP_BYTES = 1 << 20  # tensors up to this size are fingerprinted by all their bytes
_SAMPLE_ELEMENTS = 1024


class NotReplicatedError(RuntimeError):
    """Raised when a standby uses a value that could not be replicated to it."""


class DeltaFormatError(ValueError):
    """The bytes are not a delta/snapshot this version of nbos_state can read."""


class DeltaApplyError(RuntimeError):
    """A delta does not fit this replica's namespace (it needs a snapshot restore)."""


# ------------------------------------------------------------------------------------------
# Hidden names


_HIDDEN_RE = re.compile(r"_+|_i+|_i\d+|_\d+|_[oid]h|__\w*__")
_DEFAULT_HIDDEN = frozenset({"In", "Out", "exit", "quit", "get_ipython"})


# Name -> whether IPython's conventions hide it: a function of the name alone, asked for every
# name of the namespace twice per cell, where the regular expression was most of the cost.
_HIDDEN_BY_CONVENTION = {}


def is_hidden_name(name, hidden=()):
    """True for names that are IPython's (or the caller's hidden set), never replicated."""
    if not isinstance(name, str) or name in hidden:
        return True
    by_convention = _HIDDEN_BY_CONVENTION.get(name)
    if by_convention is None:
        by_convention = name in _DEFAULT_HIDDEN or (
            name[:1] == "_" and _HIDDEN_RE.fullmatch(name) is not None)
        if len(_HIDDEN_BY_CONVENTION) < 100_000:
            _HIDDEN_BY_CONVENTION[name] = by_convention
    return by_convention


# ------------------------------------------------------------------------------------------
# Placeholders for values that could not be replicated


_PLACEHOLDER_OK = frozenset({
    "__class__", "__reduce__", "__reduce_ex__", "__repr__", "__str__", "__format__",
    "__eq__", "__ne__", "__hash__", "__sizeof__", "__getstate__", "__slots__", "__doc__",
    "__module__", "_nbos_name", "_nbos_type", "_nbos_reason", "_nbos_origin", "_nbos_message",
    "_nbos_raise",
})


class NotReplicated:
    """Stands in, on a standby, for a value that could not be replicated.

    repr() works; any other use (attribute access, call, iteration, truth value, indexing, with)
    raises NotReplicatedError naming the variable, where it came from and why.
    """

    __slots__ = ("_nbos_name", "_nbos_type", "_nbos_reason", "_nbos_origin")

    def __init__(self, name, type_name, reason, origin=None):
        object.__setattr__(self, "_nbos_name", name)
        object.__setattr__(self, "_nbos_type", type_name)
        object.__setattr__(self, "_nbos_reason", reason)
        object.__setattr__(self, "_nbos_origin", origin)

    def _nbos_message(self):
        origin = object.__getattribute__(self, "_nbos_origin")
        where = "another replica" if origin is None else f"replica {origin}"
        name = object.__getattribute__(self, "_nbos_name")
        reason = object.__getattribute__(self, "_nbos_reason")
        return f"{name!r} was created on {where} and cannot be used here: {reason}"

    def _nbos_raise(self, *args, **kwargs):
        raise NotReplicatedError(object.__getattribute__(self, "_nbos_message")())

    def __getattribute__(self, attr):
        if attr in _PLACEHOLDER_OK:
            return object.__getattribute__(self, attr)
        object.__getattribute__(self, "_nbos_raise")()

    def __setattr__(self, attr, value):
        self._nbos_raise()

    def __delattr__(self, attr):
        self._nbos_raise()

    def __repr__(self):
        g = functools.partial(object.__getattribute__, self)
        return (f"<nbos: {g('_nbos_name')!r} ({g('_nbos_type')}) not replicated here: "
                f"{g('_nbos_reason')}>")

    def __reduce__(self):
        g = functools.partial(object.__getattribute__, self)
        return (NotReplicated, (g("_nbos_name"), g("_nbos_type"), g("_nbos_reason"),
                                g("_nbos_origin")))

    __call__ = __iter__ = __next__ = __len__ = __bool__ = __contains__ = _nbos_raise
    __getitem__ = __setitem__ = __delitem__ = __enter__ = __exit__ = _nbos_raise
    __aiter__ = __anext__ = __aenter__ = __aexit__ = __await__ = _nbos_raise
    __int__ = __float__ = __index__ = __complex__ = __bytes__ = __fspath__ = _nbos_raise
    __add__ = __sub__ = __mul__ = __truediv__ = __floordiv__ = __mod__ = __pow__ = _nbos_raise
    __lt__ = __le__ = __gt__ = __ge__ = __matmul__ = __neg__ = __pos__ = _nbos_raise
    __radd__ = __rsub__ = __rmul__ = __rtruediv__ = __iadd__ = __isub__ = _nbos_raise
    __and__ = __or__ = __xor__ = __invert__ = __abs__ = __round__ = _nbos_raise


class Unreplicable(namedtuple("_Unreplicable", "name reason")):
    """(name, reason) of a value that could not be replicated; .type_name, .message()."""

    def __new__(cls, name, reason, type_name):
        self = super().__new__(cls, name, reason)
        self.type_name = type_name
        return self

    def message(self):
        return f"nbos: cannot replicate {self.name!r} ({self.type_name}): {self.reason}"


class StoreFallback:
    """The blob store failed during one end() or snapshot(): what would have gone there went into
    the delta itself (through the replication log), up to `limit_bytes`. .message() says so."""

    def __init__(self, limit_bytes):
        self.limit_bytes = limit_bytes
        self.error = None        # the store's first failure in this call (no put is tried after)
        self.inline_bytes = 0    # bytes inlined instead, in the payload being written
        self.exceeded = False    # some data was left out: it was over the limit

    def put(self, store, data):
        """store.put(data), or None once the store has failed in this call: the caller inlines
        the bytes, which count against the limit (_OverFallbackLimit past it)."""
        if self.error is None:
            try:
                return store.put(data)
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
        self.take(memoryview(data).nbytes)
        return None

    def take(self, nbytes):
        """Counts nbytes more inlined, or raises _OverFallbackLimit once over the limit."""
        if self.inline_bytes + nbytes > self.limit_bytes:
            self.exceeded = True
            raise _OverFallbackLimit(
                f"the blob store failed ({self.error}) and this cell's data is over the"
                f" {_amount(self.limit_bytes)} the replication log takes instead")
        self.inline_bytes += nbytes

    def message(self):
        return (f"nbos: the blob store failed ({self.error}); {_amount(self.inline_bytes)} of"
                " this cell's data went through the replication log instead")


class _OverFallbackLimit(RuntimeError):
    pass


_EMPTY_DUMP = (b"", [], [], [], [])


def _amount(nbytes):
    return f"{nbytes / 2**20:.1f} MB" if nbytes >= 2**20 else f"{nbytes / 1024:.0f} KB"


class _Unpicklable(pickle.PicklingError):
    def __init__(self, reason, type_name):
        super().__init__(reason)
        self.reason = reason
        self.type_name = type_name


_reason_cache = {}


def _unpicklable_reason(t):
    """Why objects of type t are never replicated, or None."""
    try:
        return _reason_cache[t]
    except KeyError:
        pass
    reason = None
    if issubclass(t, io.IOBase) and not issubclass(t, (io.BytesIO, io.StringIO)):
        reason = "open file objects cannot be replicated"
    elif issubclass(t, types.GeneratorType):
        reason = "generators cannot be replicated"
    elif issubclass(t, (types.CoroutineType, types.AsyncGeneratorType)):
        reason = "coroutines cannot be replicated"
    elif t in _LOCK_TYPES:
        reason = "locks cannot be replicated"
    elif issubclass(t, threading.Thread):
        reason = "threads cannot be replicated"
    elif issubclass(t, (types.FrameType, types.TracebackType)):
        reason = "frames and tracebacks cannot be replicated"
    else:
        sock = sys.modules.get("socket")
        if sock is not None and issubclass(t, sock.socket):
            reason = "sockets cannot be replicated"
        else:
            sp = sys.modules.get("subprocess")
            if sp is not None and issubclass(t, sp.Popen):
                reason = "subprocesses cannot be replicated"
    _reason_cache[t] = reason
    return reason


_LOCK_TYPES = frozenset({type(threading.Lock()), type(threading.RLock()),
                         threading.Condition, threading.Semaphore, threading.Event})


# ------------------------------------------------------------------------------------------
# Which names a cell binds and reads


_CellNames = namedtuple("_CellNames", "bound deleted reads")
_EMPTY_NAMES = _CellNames(frozenset(), frozenset(), frozenset())
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
                sub = _scan(arg.value, self._depth + 1, transform=True)
                if sub is not None:
                    self.bound |= sub.bound if self._module_level() else set()
                    self.deleted |= sub.deleted if self._module_level() else set()
                    self.reads |= sub.reads | sub.bound


def _scan(code, depth=0, transform=False):
    """_CellNames of `code`, or None if it is not Python."""
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
    return _CellNames(frozenset(s.bound), frozenset(s.deleted), frozenset(s.reads))


_code_names_cache = weakref.WeakKeyDictionary()
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL",
                         "STORE_NAME", "DELETE_NAME"})


def _code_global_names(code):
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
            names |= _code_global_names(c)
    result = frozenset(names)
    try:
        _code_names_cache[code] = result
    except TypeError:
        pass
    return result


# ------------------------------------------------------------------------------------------
# Arrays and tensors


def _np():
    return sys.modules.get("numpy")


def _torch():
    t = sys.modules.get("torch")
    return t if t is not None and hasattr(t, "Tensor") else None


def _array_layout(a):
    """(C-contiguous source, fortran flag): F-ordered arrays are stored transposed, no copy."""
    if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous:
        return a.T, True
    return a, False


def _array_bytes(a):
    """A flat uint8 view (or copy, when not contiguous) of an array's data."""
    np = _np()
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _array_digest(a):
    src, fortran = _array_layout(a)
    h = hashlib.sha256(memoryview(_array_bytes(src)))
    return (h.digest(), fortran, a.shape, a.dtype.str)


def _array_from_bytes(data, dtype, shape, fortran, writable=True, owned=False):
    """An array over `data`: a copy of it if `writable`, unless `owned` (a writable buffer no
    one else uses, so the array may keep it)."""
    np = _np()
    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return np.empty(shape, dtype)
    buf = bytearray(data) if writable and not owned else data
    a = np.frombuffer(buf, dtype=dtype, count=n)
    return a.reshape(tuple(reversed(shape))).T if fortran else a.reshape(shape)


def _writable(data):
    """Whether `data` is a writable buffer (the C++ store hands out a fresh one per get)."""
    try:
        return not memoryview(data).readonly
    except TypeError:
        return False


def _is_plain_tensor(torch, t):
    try:
        return (t.layout is torch.strided and not t.is_quantized
                and not getattr(t, "is_nested", False) and t.device.type != "meta")
    except Exception:
        return False


def _tensor_bytes(t):
    """A flat uint8 numpy view of a (host copy of a) tensor's data."""
    torch = _torch()
    c = t.detach()
    if c.device.type != "cpu":
        c = c.cpu()
    if c.is_conj():
        c = c.resolve_conj()
    if c.is_neg():
        c = c.resolve_neg()
    c = c.contiguous().reshape(-1)
    if c.numel() == 0:
        return _np().empty(0, dtype=_np().uint8)
    return c.view(torch.uint8).numpy()


def _tensor_from_bytes(data, dtype, shape, writable=True, owned=False):
    """As _array_from_bytes, for a torch tensor."""
    torch = _torch()
    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if writable:
        buf = data if owned else bytearray(data)
        return torch.frombuffer(buf, dtype=dtype, count=n).reshape(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only source used only as a copy_ source
        return torch.frombuffer(data, dtype=dtype, count=n).reshape(shape)


def _tensor_sample(t):
    """Hash of all bytes (small tensors) or of ~1024 evenly spaced elements (large ones)."""
    n = t.numel()
    nbytes = n * t.element_size()
    if nbytes <= _EXACT_TENSOR_FP_BYTES:
        return hashlib.sha256(memoryview(_tensor_bytes(t))).digest()
    if not t.is_contiguous():
        return None
    flat = t.detach().reshape(-1)
    step = max(1, n // _SAMPLE_ELEMENTS)
    sample = flat[::step][:_SAMPLE_ELEMENTS]
    tail = flat[-1:]
    return (hashlib.sha256(memoryview(_tensor_bytes(sample))).digest()
            + hashlib.sha256(memoryview(_tensor_bytes(tail))).digest())


def _tensor_fp(t, with_grad=True):
    try:
        version = t._version
    except Exception:  # inference tensors have no version counter
        version = None
    fp = (version, t.data_ptr(), tuple(t.shape), t.stride(), t.storage_offset(), str(t.dtype),
          str(t.device), t.requires_grad, _tensor_sample(t))
    if with_grad and t.is_leaf:
        g = t.grad
        fp += (None if g is None else _tensor_fp(g, False),)
    return fp


def _tensor_device(torch, name):
    try:
        dev = torch.device(name)
        if dev.type == "cuda" and not torch.cuda.is_available():
            return torch.device("cpu")
        return dev
    except Exception:
        return torch.device("cpu")


# ------------------------------------------------------------------------------------------
# Helpers referenced from pickles (by module name)


def _identity(obj):
    return obj


class _ClassRef:
    """Stands for a notebook class in reduce arguments; pickled as a persistent id."""

    __slots__ = ("token", "newargs")

    def __init__(self, token, newargs):
        self.token, self.newargs = token, newargs


def _is_notebook_class(cls):
    """Classes cloudpickle would pickle by value (defined in the notebook), except enums."""
    if _class_getnewargs is None:
        return False
    try:
        if isinstance(cls, enum.EnumMeta) or cls in _BUILTIN_TYPES:
            return False
        return not _should_pickle_by_reference(cls)
    except Exception:
        return False


def _make_lru_cache(func, maxsize, typed):
    return functools.lru_cache(maxsize=maxsize, typed=typed)(func)


def _make_function(code, globals_, name, closure):
    return types.FunctionType(code, globals_, name, None, closure)


def _set_function_state(func, state):
    fdict, slots, cells = state
    func.__dict__.update(fdict)
    for k, v in slots.items():
        setattr(func, k, v)
    if cells is not None:
        for cell, (full, value) in zip(func.__closure__, cells):
            if full:
                cell.cell_contents = value
    return func


def _import_module(name, submodules=()):
    mod = importlib.import_module(name)
    for sub in submodules:
        if sub not in sys.modules:
            try:
                importlib.import_module(sub)
            except Exception:
                pass
    return mod


def _reduce_ns_function(func, ns):
    """Reduce a notebook function so that it is rebuilt with the standby's namespace as
    __globals__ (cloudpickle would give it a private copy of the globals it references)."""
    code = func.__code__
    if func.__closure__ is None:
        closure = cells = None
    else:
        closure = tuple(types.CellType() for _ in code.co_freevars)
        cells = []
        for c in func.__closure__:
            try:
                cells.append((True, c.cell_contents))
            except ValueError:
                cells.append((False, None))
    slots = {
        "__qualname__": func.__qualname__,
        "__defaults__": func.__defaults__,
        "__kwdefaults__": func.__kwdefaults__,
        "__annotations__": func.__annotations__,
        "__doc__": func.__doc__,
        "__module__": func.__module__,
    }
    return (_make_function, (code, ns, func.__name__, closure), (func.__dict__, slots, cells),
            None, None, _set_function_state)


def _reduce_module(mod):
    name = getattr(mod, "__name__", None)
    if not isinstance(name, str) or sys.modules.get(name) is not mod:
        return None
    prefix = name + "."
    # Submodules imported on this replica (so that `import a.b.c` works as `a.b.c` there);
    # private ones come with their public parents.
    subs = tuple(sorted(
        k for k, m in list(sys.modules.items())
        if k.startswith(prefix) and isinstance(m, types.ModuleType)
        and not any(part[:1] == "_" for part in k[len(prefix):].split("."))))
    return (_import_module, (name, subs))


def _reconcilable_reduce(obj):
    """(cls, state, listitems, dictitems) when obj uses the default reduce protocol (so it can be
    rebuilt *into an existing object*), else None. Raises what obj.__reduce_ex__ raises."""
    rv = obj.__reduce_ex__(_PROTOCOL)
    if not isinstance(rv, tuple) or len(rv) < 2:
        return None
    if rv[0] is not copyreg.__newobj__ or len(rv[1]) != 1 or rv[1][0] is not type(obj):
        return None
    if len(rv) > 5 and rv[5] is not None:
        return None
    state = rv[2] if len(rv) > 2 else None
    litems = list(rv[3]) if len(rv) > 3 and rv[3] is not None else None
    ditems = list(rv[4]) if len(rv) > 4 and rv[4] is not None else None
    return type(obj), state, litems, ditems


def _reconcile(obj, state, litems, ditems):
    """Make obj what unpickling (cls, state, listitems, dictitems) would produce, in place."""
    if litems is not None:
        del obj[:]
        obj.extend(litems)
    if ditems is not None:
        obj.clear()
        for k, v in ditems:
            obj[k] = v
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        d.clear()  # as on a freshly created object
    if state is None:
        return obj
    setstate = getattr(obj, "__setstate__", None)
    if setstate is not None:
        setstate(state)
        return obj
    slotstate = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slotstate = state
    if state:
        obj.__dict__.update(state)
    if slotstate:
        for k, v in slotstate.items():
            setattr(obj, k, v)
    return obj


# ------------------------------------------------------------------------------------------
# Object table: tokens <-> objects (weak), plus what was last stored for them


class _Entry:
    __slots__ = ("token", "ref", "key", "fp")

    def __init__(self, token, ref):
        self.token, self.ref, self.key, self.fp = token, ref, None, None


class _Table:
    def __init__(self):
        self.by_id = {}
        self.by_token = {}
        self._prefix = os.urandom(6).hex()
        self._counter = itertools.count(1)

    def __len__(self):
        return len(self.by_token)

    def entry_for(self, obj):
        """The entry of obj, registering it under a new token if needed (None: no weakrefs)."""
        e = self.by_id.get(id(obj))
        if e is not None and e.ref() is obj:
            return e
        return self.register(obj, f"{self._prefix}.{next(self._counter)}")

    def lookup(self, token):
        e = self.by_token.get(token)
        if e is None:
            return None, None
        obj = e.ref()
        return (e, obj) if obj is not None else (None, None)

    def register(self, obj, token):
        oid = id(obj)
        by_id, by_token = self.by_id, self.by_token

        def gone(ref, token=token, oid=oid):
            e = by_token.get(token)
            if e is not None and e.ref is ref:
                del by_token[token]
            e = by_id.get(oid)
            if e is not None and e.ref is ref:
                del by_id[oid]

        try:
            ref = weakref.ref(obj, gone)
        except TypeError:
            return None
        old = by_token.get(token)
        if old is not None:
            prev = old.ref()
            if prev is not None and by_id.get(id(prev)) is old:
                del by_id[id(prev)]
        e = _Entry(token, ref)
        by_token[token] = e
        by_id[oid] = e
        return e


# ------------------------------------------------------------------------------------------
# Picklers


_ATOMIC = frozenset({int, float, complex, bool, type(None), str, tuple, frozenset, range,
                     slice, type(Ellipsis), type(NotImplemented)})
_NO_ANCHOR = _ATOMIC | {bytes}
_BY_NAME_TYPES = (types.FunctionType, types.ModuleType, type, types.BuiltinFunctionType,
                  types.MethodType)


def _shell():
    ip = sys.modules.get("IPython")
    if ip is None:
        return None
    try:
        return ip.get_ipython()
    except Exception:
        return None


def _resolve_shell():
    shell = _shell()
    if shell is None:
        return NotReplicated("get_ipython()", "InteractiveShell",
                             "this replica has no IPython shell")
    return shell


class _BasePickler(cloudpickle.CloudPickler):
    def __init__(self, file, ns, buffer_callback):
        super().__init__(file, protocol=_PROTOCOL, buffer_callback=buffer_callback)
        self._ns = ns
        self._shell = _shell()

    def reducer_override(self, obj):
        t = type(obj)
        if t is types.FunctionType and obj.__globals__ is self._ns:
            return _reduce_ns_function(obj, self._ns)
        if t is _LRU_WRAPPER and hasattr(obj, "__wrapped__"):
            # By default it pickles by reference to __main__.<name>; rebuild it (empty cache).
            params = obj.cache_parameters()
            return (_make_lru_cache, (obj.__wrapped__, params["maxsize"], params["typed"]))
        if t is types.ModuleType:
            rv = _reduce_module(obj)
            if rv is not None:
                return rv
        if t is not type:
            reason = _unpicklable_reason(t)
            if reason is not None and not (issubclass(t, io.IOBase) and _is_std_stream(obj)):
                raise _Unpicklable(reason, t.__name__)
        return super().reducer_override(obj)


_LRU_WRAPPER = type(functools.lru_cache(maxsize=None)(lambda: None))


def _is_std_stream(obj):
    return any(obj is getattr(sys, n, None) for n in
               ("stdout", "stderr", "stdin", "__stdout__", "__stderr__", "__stdin__"))


class _HashWriter:
    __slots__ = ("h",)

    def __init__(self, h):
        self.h = h

    def write(self, b):
        self.h.update(b)
        return len(b)


class _NullWriter:
    def write(self, b):
        return len(b)


class _FingerprintPickler(_BasePickler):
    """Pickles into a hash; tensors/arrays/classes/functions appear as cheap fingerprints."""

    def __init__(self, sync, h, top):
        super().__init__(_HashWriter(h), sync.ns, self._buffer)
        self._h = h
        self._sync = sync
        self._top = top
        np = _np()
        self._ndarray = np.ndarray if np is not None else ()
        torch = _torch()
        self._torch = torch
        self._tensor = torch.Tensor if torch is not None else ()

    def _buffer(self, buf):
        try:
            self._h.update(buf.raw())
        except BufferError:
            return True
        return False

    def persistent_id(self, obj):
        t = type(obj)
        if t in _ATOMIC or t is bytes:
            return None
        if obj is self._ns:
            return ("ns",)
        if t is self._ndarray:
            if obj.dtype.hasobject:
                return None
            return ("a", self._sync._digest(obj))
        if isinstance(obj, self._tensor):
            if not _is_plain_tensor(self._torch, obj):
                return None
            return ("t", _tensor_fp(obj))
        if obj is not self._top and (t is types.FunctionType or isinstance(obj, type)):
            return ("f", id(obj))
        if t is types.ModuleType:
            return ("m", getattr(obj, "__name__", id(obj)))
        if t is NotReplicated:
            return ("p", id(obj))
        if obj is self._shell and obj is not None:
            return ("shell",)
        return None


class _DeltaPickler(_BasePickler):
    """The pickler of deltas and snapshots (see the module docstring for the pid kinds)."""

    def __init__(self, sync, file, anchors, quiet, delta_names, dry):
        super().__init__(file, sync.ns, self._buffer)
        self._sync = sync
        self._table = sync._table
        self._store = sync.store
        self._threshold = sync.oob_threshold
        self._anchors = anchors        # id(obj) -> name whose binding the cell did not change
        self._quiet = quiet            # names known unchanged: a plain reference is enough
        self._delta_names = delta_names
        self._dry = dry                # only find out whether it pickles: no store writes
        self._emitted_names = set()
        self._emitted_tokens = set()
        self._fresh = set()            # ids of anchored objects pickled as new objects
        self._bytes_keys = {}          # id(bytes) -> (bytes, key): stored once per pickler
        self._inlined = set()          # ids of bytes that hold what the store did not take
        self.blobs = []                # [token or None, key]
        self.oob = []
        np = _np()
        self._ndarray = np.ndarray if np is not None else ()
        torch = _torch()
        self._torch = torch
        self._tensor = torch.Tensor if torch is not None else ()
        self._tracked = sync._tracked_types()

    def reducer_override(self, obj):
        if isinstance(obj, type) and _is_notebook_class(obj):
            e = self._table.entry_for(obj)
            if e is not None:
                meta, name, bases, type_kwargs = _class_getnewargs(obj)[:4]
                return (_identity, (_ClassRef(e.token, (meta, name, bases, type_kwargs)),),
                        _class_getstate(obj), None, None, _class_setstate)
        return super().reducer_override(obj)

    # -- out-of-band buffers and big bytes --

    def _put(self, data):
        """The blob's key, or None (StoreFallback.put): the caller pickles the bytes inline."""
        return self._sync._fallback.put(self._store, data)

    def _inline(self, array):
        # The pid that carries these bytes is pickled next (the memo keeps it, so the id stays
        # valid); persistent_id must not send them to the store again.
        data = array.tobytes()
        self._inlined.add(id(data))
        return data

    def _buffer(self, buf):
        try:
            raw = buf.raw()
        except BufferError:
            return True
        if raw.nbytes <= self._threshold:
            return True
        if self._dry:
            self.oob.append(None)
            return False
        key = self._put(raw)
        if key is None:
            return True
        self.oob.append(key)
        return False

    # -- persistent ids --

    def persistent_id(self, obj):
        t = type(obj)
        if t in _ATOMIC:
            return None
        if t is bytes:
            if len(obj) > self._threshold and id(obj) not in self._inlined:
                return self._bytes_pid(obj, "bytes")
            return None
        if obj is self._ns:
            return ("ns",)
        oid = id(obj)
        if oid in self._fresh:
            return None
        if t is self._ndarray:
            if obj.dtype.hasobject:
                return self._anchor_pid(obj, self._anchors.get(oid))
            return self._array_pid(obj)
        if isinstance(obj, self._tensor):
            if _is_plain_tensor(self._torch, obj):
                return self._tensor_pid(obj)
            return None
        if self._tracked and isinstance(obj, self._tracked):
            pid = self._tracked_pid(obj)
            if pid is not None:
                return pid
        name = self._anchors.get(oid)
        if name is not None:
            return self._anchor_pid(obj, name)
        if obj is self._shell and obj is not None:
            return ("shell",)
        if t is bytearray and len(obj) > self._threshold:
            return self._bytes_pid(obj, "bytearray")
        if t is _ClassRef:
            return ("c", obj.token) + obj.newargs
        return None

    def _bytes_pid(self, obj, kind):
        hit = self._bytes_keys.get(id(obj))
        if hit is not None and hit[0] is obj and kind == "bytes":
            return ("x", hit[1], kind)
        key = None if self._dry else self._put(memoryview(obj))
        if key is None and not self._dry:
            return None  # inline
        self.blobs.append([None, key])
        if kind == "bytes":
            self._bytes_keys[id(obj)] = (obj, key)
        return ("x", key, kind)

    def _anchor_pid(self, obj, name):
        if name is None:
            return None
        t = type(obj)
        if name in self._emitted_names or name in self._quiet:
            return ("n", name)
        if t is NotReplicated:
            return ("n", name)
        if isinstance(obj, _BY_NAME_TYPES):
            return None if name in self._delta_names else ("n", name)
        self._emitted_names.add(name)
        if t is list:
            return ("L", name, list(obj))
        if t is dict:
            return ("D", name, list(obj.items()))
        if t is set:
            return ("S", name, list(obj))
        if t is bytearray:
            return ("B", name, bytes(obj))
        if _unpicklable_reason(t) is not None:
            # The binding did not change, so the standby already has its stand-in for it.
            return ("n", name)
        try:
            r = _reconcilable_reduce(obj)
        except Exception:
            return ("n", name)
        if r is None:
            self._fresh.add(id(obj))
            return ("A", name, obj)
        cls, state, litems, ditems = r
        return ("O", name, cls, state, litems, ditems)

    def _tracked_pid(self, obj):
        e = self._table.entry_for(obj)
        if e is None:
            return None
        if e.token in self._emitted_tokens:
            return ("r", e.token, type(obj))
        try:
            r = _reconcilable_reduce(obj)
        except Exception:
            return None
        if r is None:
            return None
        self._emitted_tokens.add(e.token)
        cls, state, litems, ditems = r
        return ("o", e.token, cls, state, litems, ditems)

    def _array_pid(self, a):
        e = self._table.entry_for(a)
        if e is None:
            return None
        tok = e.token
        if tok in self._emitted_tokens:
            return ("r", tok, None)
        self._emitted_tokens.add(tok)
        src, fortran = _array_layout(a)
        if a.nbytes <= self._threshold:
            return ("a", tok, None, _array_bytes(src).tobytes(), a.dtype, a.shape, fortran)
        if self._dry:
            key = None
        else:
            digest = self._sync._digest(a)
            if e.key is not None and e.fp == digest:
                key = e.key
            else:
                key = self._put(memoryview(_array_bytes(src)))
                e.key, e.fp = key, (digest if key is not None else None)
                if key is None:
                    return ("a", tok, None, self._inline(_array_bytes(src)), a.dtype, a.shape,
                            fortran)
        self.blobs.append([tok, key])
        return ("a", tok, key, None, a.dtype, a.shape, fortran)

    def _tensor_pid(self, t):
        e = self._table.entry_for(t)
        if e is None:
            return None
        tok = e.token
        if tok in self._emitted_tokens:
            return ("r", tok, None)
        self._emitted_tokens.add(tok)
        leaf = t.is_leaf
        grad = t.grad if leaf else None
        meta = (type(t), t.dtype, tuple(t.shape), bool(t.requires_grad and leaf), str(t.device))
        if t.numel() * t.element_size() <= self._threshold:
            return ("t", tok, None, _tensor_bytes(t).tobytes(), meta, grad)
        if self._dry:
            key = None
        else:
            fp = _tensor_fp(t, with_grad=False)
            if e.key is not None and e.fp == fp:
                key = e.key
            else:
                key = self._put(memoryview(_tensor_bytes(t)))
                e.key, e.fp = key, (fp if key is not None else None)
                if key is None:
                    return ("t", tok, None, self._inline(_tensor_bytes(t)), meta, grad)
        self.blobs.append([tok, key])
        return ("t", tok, key, None, meta, grad)


class _DeltaUnpickler(pickle.Unpickler):
    def __init__(self, sync, file, buffers, fetched, rebinds):
        super().__init__(file, buffers=buffers)
        self._sync = sync
        self._ns = sync.ns
        self._table = sync._table
        self._fetched = fetched
        self._taken = set()  # keys whose fetched buffer a loaded object now owns
        self.rebinds = rebinds
        self.restore_memo = None  # {index: object} while _memo_restorer's pickle is loaded

    def find_class(self, module, name):
        # Globals pickled by reference to the notebook's module are this replica's own.
        if module == "__main__" or module == self._ns.get("__name__"):
            if name in self.rebinds:
                return self.rebinds[name]
            if name in self._ns:
                return self._ns[name]
        return super().find_class(module, name)

    def _blob(self, key):
        data = self._fetched.get(key)
        if data is None:
            data = self._sync._get(key)
            self._fetched[key] = data
        return data

    def _blob_to_keep(self, key):
        """(data, owned): the blob, and whether the caller may keep its buffer instead of
        copying it. The first user of a writable fetched buffer owns it; later users of the same
        content (equal objects in one delta) copy, so they never share memory."""
        data = self._blob(key)
        if key in self._taken or not _writable(data):
            return data, False
        self._taken.add(key)
        return data, True

    def _name(self, name):
        if name in self.rebinds:
            return self.rebinds[name]
        try:
            return self._ns[name]
        except KeyError:
            raise DeltaApplyError(
                f"the delta refers to {name!r}, which this replica does not have; "
                "restore it from a snapshot") from None

    def _existing(self, name, typ):
        obj = self.rebinds.get(name, self._ns.get(name))
        return obj if type(obj) is typ else None

    def persistent_load(self, pid):
        if type(pid) is int:
            return self.restore_memo[pid]
        kind = pid[0]
        if kind == "ns":
            return self._ns
        if kind == "n":
            return self._name(pid[1])
        if kind == "t":
            return self._load_tensor(*pid[1:])
        if kind == "a":
            return self._load_array(*pid[1:])
        if kind == "r":
            return self._load_ref(pid[1], pid[2])
        if kind == "o":
            return self._load_tracked(*pid[1:])
        if kind in ("L", "D", "S", "B"):
            return self._load_container(kind, pid[1], pid[2])
        if kind == "O":
            return self._load_named_object(*pid[1:])
        if kind == "A":
            self.rebinds[pid[1]] = pid[2]
            return pid[2]
        if kind == "x":
            data = self._blob(pid[1])
            return bytes(data) if pid[2] == "bytes" else bytearray(data)
        if kind == "c":
            return self._load_class(*pid[1:])
        if kind == "shell":
            return _resolve_shell()
        raise pickle.UnpicklingError(f"unknown nbos persistent id {kind!r}")

    def _load_container(self, kind, name, content):
        typ = {"L": list, "D": dict, "S": set, "B": bytearray}[kind]
        obj = self._existing(name, typ)
        if obj is None:
            obj = typ(content)
            self.rebinds[name] = obj
        elif kind == "L" or kind == "B":
            obj[:] = content
        else:
            obj.clear()
            obj.update(content)
        return obj

    def _load_named_object(self, name, cls, state, litems, ditems):
        obj = self._existing(name, cls)
        if obj is not None:
            try:
                return _reconcile(obj, state, litems, ditems)
            except Exception:
                pass
        obj = _reconcile(cls.__new__(cls), state, litems, ditems)
        self.rebinds[name] = obj
        return obj

    def _load_class(self, token, meta, name, bases, type_kwargs):
        e, cls = self._table.lookup(token)
        if cls is not None and type(cls) is meta and cls.__name__ == name:
            return cls  # the same class object; its attributes are set from the state next
        cls = types.new_class(name, bases, {"metaclass": meta},
                              lambda body: body.update(type_kwargs))
        self._table.register(cls, token)
        return cls

    def _load_ref(self, token, cls):
        e, obj = self._table.lookup(token)
        if obj is not None:
            return obj
        if cls is None:
            raise DeltaApplyError(f"the delta refers to object {token}, which this replica "
                                  "does not have; restore it from a snapshot")
        obj = cls.__new__(cls)  # filled in by its content, which follows in the stream
        self._table.register(obj, token)
        return obj

    def _load_tracked(self, token, cls, state, litems, ditems):
        e, obj = self._table.lookup(token)
        if obj is not None and type(obj) is cls:
            try:
                return _reconcile(obj, state, litems, ditems)
            except Exception:
                pass
        obj = _reconcile(cls.__new__(cls), state, litems, ditems)
        self._table.register(obj, token)
        return obj

    def _load_array(self, token, key, inline, dtype, shape, fortran):
        e, obj = self._table.lookup(token)
        if obj is not None and obj.dtype == dtype and obj.shape != shape:
            try:
                obj.shape = shape  # `a.shape = ...` / a.resize() on the executor
            except (ValueError, AttributeError):
                pass
        compatible = obj is not None and obj.shape == shape and obj.dtype == dtype
        if compatible and key is not None and e.key == key:
            return obj  # unchanged since this replica last saw it
        data = inline if inline is not None else self._blob(key)
        if compatible:
            try:
                if not obj.flags.writeable:
                    obj.setflags(write=True)
                obj[...] = _array_from_bytes(data, dtype, shape, fortran, writable=False)
                e.key, e.fp = key, None
                return obj
            except Exception:
                pass
        owned = False
        if inline is None:
            data, owned = self._blob_to_keep(key)
        new = _array_from_bytes(data, dtype, shape, fortran, owned=owned)
        e = self._table.register(new, token)
        if e is not None:
            e.key = key
        return new

    def _load_tensor(self, token, key, inline, meta, grad):
        torch = _torch()
        cls, dtype, shape, requires_grad, device = meta
        e, obj = self._table.lookup(token)
        if obj is not None and not isinstance(obj, torch.Tensor):
            obj = None
        unchanged = (obj is not None and key is not None and e.key == key
                     and obj.dtype == dtype and tuple(obj.shape) == shape)
        if not unchanged:
            copy_into = (obj is not None and obj.dtype == dtype and tuple(obj.shape) == shape)
            owned = False
            if inline is not None:
                data = inline
            elif copy_into:
                data = self._blob(key)
            else:
                data, owned = self._blob_to_keep(key)
            if obj is not None:
                with torch.no_grad():
                    if copy_into:
                        obj.copy_(_tensor_from_bytes(data, dtype, shape, writable=False))
                    else:
                        obj.data = _tensor_from_bytes(data, dtype, shape,
                                                      owned=owned).to(obj.device)
            else:
                src = _tensor_from_bytes(data, dtype, shape,
                                         owned=owned).to(_tensor_device(torch, device))
                if issubclass(cls, torch.nn.Parameter):
                    obj = cls(src, requires_grad=requires_grad)
                elif cls is torch.Tensor:
                    obj = src
                else:
                    obj = src.as_subclass(cls)
                e = self._table.register(obj, token)
        if obj.is_leaf:
            if obj.requires_grad != requires_grad:
                obj.requires_grad_(requires_grad)
            if obj.grad is not grad:
                try:
                    obj.grad = grad
                except Exception:
                    pass
        if e is not None:
            e.key = key
            e.fp = _tensor_fp(obj, with_grad=False) if key is not None else None
        return obj


# ------------------------------------------------------------------------------------------
# Wire format


_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, types.FunctionType,
          types.BuiltinFunctionType, types.ModuleType)


def _complete(obj, depth=0):
    """Whether an object found in the memo of a failed load is surely complete (immutable)."""
    if isinstance(obj, _ATOMS):
        return True
    return type(obj) is tuple and depth < 3 and all(_complete(x, depth + 1) for x in obj)


def _memo_restorer(n):
    """A pickle that makes an unpickler memoize persistent ids 0..n-1, in order."""
    return b"".join([b"\x80\x05"] + [b"J" + i.to_bytes(4, "little", signed=True) + b"Q\x94" + b"0"
                                      for i in range(n)] + [b"N."])


def _count_memoize(data):
    """Memo entries a (sequence of) protocol-4+ pickle(s) creates."""
    n = 0
    f = io.BytesIO(data)
    while f.tell() < len(data):
        for op, _, _ in pickletools.genops(f):
            if op.name == "MEMOIZE":
                n += 1
    return n


def _pack(kind, header, payload):
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return b"".join([MAGIC, bytes([FORMAT_VERSION, kind]), len(h).to_bytes(4, "little"), h,
                     payload])


def _unpack(data):
    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    if len(mv) < 10 or bytes(mv[:4]) != MAGIC:
        raise DeltaFormatError("not an nbos state delta/snapshot (bad magic)")
    version = mv[4]
    if version != FORMAT_VERSION:
        raise DeltaFormatError(
            f"unsupported nbos state format version {version}: this replica reads version "
            f"{FORMAT_VERSION} (replicas must run the same nbos build)")
    kind = mv[5]
    if kind not in (KIND_DELTA, KIND_SNAPSHOT):
        raise DeltaFormatError(f"unknown nbos state blob kind {kind!r}")
    hlen = int.from_bytes(mv[6:10], "little")
    if 10 + hlen > len(mv):
        raise DeltaFormatError("truncated nbos state header")
    try:
        header = json.loads(bytes(mv[10:10 + hlen]).decode("utf-8"))
    except ValueError as e:
        raise DeltaFormatError(f"corrupt nbos state header: {e}") from None
    header["kind"] = "delta" if kind == KIND_DELTA else "snapshot"
    return header, mv[10 + hlen:]


def describe(data):
    """The header of a delta or snapshot: {"kind", "set", "del", "bad", "blobs", "oob",
    "origin"}, plus "payload_bytes"."""
    header, payload = _unpack(data)
    header["payload_bytes"] = len(payload)
    return header


# ------------------------------------------------------------------------------------------


class _Cell:
    __slots__ = ("ids", "fps", "names")

    def __init__(self, ids, fps, names):
        self.ids, self.fps, self.names = ids, fps, names


class _Changed:
    """A fingerprint that equals nothing: the object could not be fingerprinted."""

    __slots__ = ()

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    __hash__ = None


class StateSync:
    """Computes, serializes and applies namespace deltas for one replica (see module doc)."""

    def __init__(self, namespace, hidden, store, oob_threshold=64 * 1024, replica_id=None,
                 payload_threshold=4 << 20, fallback_limit_bytes=12 << 20):
        self.ns = namespace
        self.hidden = hidden if hidden is not None else frozenset()
        self.store = store
        self.oob_threshold = int(oob_threshold)
        self.replica_id = replica_id
        # A pickle payload over payload_threshold goes to the store, the delta keeps its key.
        self.payload_threshold = int(payload_threshold)
        # With the store failing, at most this much goes through the replication log instead.
        self.fallback_limit_bytes = int(fallback_limit_bytes)
        # A StoreFallback when the last end() or snapshot() inlined data the store did not take.
        self.store_fallback = None
        self._fallback = None
        self._table = _Table()
        self._digests = None      # id(array) -> (array, digest) while end() runs
        self._reported = {}       # name -> id of the value last reported as unreplicable
        self._tracked = None

    # -- helpers --

    def _hidden(self, name):
        return is_hidden_name(name, self.hidden)

    def _tracked_types(self):
        if self._tracked is None or not self._tracked:
            torch = _torch()
            found = ()
            if torch is not None:
                try:
                    found = [torch.nn.Module, torch.optim.Optimizer]
                    sched = torch.optim.lr_scheduler
                    for n in ("LRScheduler", "_LRScheduler", "ReduceLROnPlateau"):
                        if hasattr(sched, n):
                            found.append(getattr(sched, n))
                    found = tuple(found)
                except Exception:
                    found = ()
            self._tracked = found
        return self._tracked

    def _get(self, key):
        data = self.store.get(key)
        if data is None:
            raise DeltaApplyError(f"blob {key} is missing from the blob store")
        return data

    def _digest(self, a):
        cache = self._digests
        if cache is not None:
            hit = cache.get(id(a))
            if hit is not None and hit[0] is a:
                return hit[1]
        d = _array_digest(a)
        if cache is not None:
            cache[id(a)] = (a, d)  # holds the array so that its id is not reused meanwhile
        return d

    def _fingerprint(self, value):
        t = type(value)
        if t in (int, float, complex, bool, type(None), str, bytes, range):
            return ("imm",)  # immutable: only a rebinding changes it (caught by id)
        try:
            np = _np()
            if np is not None and t is np.ndarray and not value.dtype.hasobject:
                return ("a", self._digest(value))
            torch = _torch()
            if torch is not None and isinstance(value, torch.Tensor) and \
                    _is_plain_tensor(torch, value):
                return ("t", _tensor_fp(value))
            if t is types.ModuleType:
                return ("m", value.__name__)
            h = hashlib.sha256()
            _FingerprintPickler(self, h, value).dump(value)
            return ("p", h.digest())
        except Exception:
            return _Changed()

    def _refs(self, value):
        """Global names that code reachable from value (notebook functions/classes) uses."""
        ns = self.ns
        mod = ns.get("__name__", "__main__")
        t = type(value)
        if t is types.MethodType:
            return self._refs(value.__func__) | self._refs(value.__self__)
        if t is functools.partial:
            return self._refs(value.func)
        if t is types.FunctionType:
            return _code_global_names(value.__code__) if value.__globals__ is ns else frozenset()
        cls = value if isinstance(value, type) else t
        names = set()
        try:
            mro = cls.__mro__
        except Exception:
            return frozenset()
        for klass in mro:
            if getattr(klass, "__module__", None) != mod:
                continue
            for attr in list(vars(klass).values()):
                if isinstance(attr, (staticmethod, classmethod)):
                    attr = attr.__func__
                funcs = (attr.fget, attr.fset, attr.fdel) if isinstance(attr, property) \
                    else (attr,)
                for f in funcs:
                    if type(f) is types.FunctionType and f.__globals__ is ns:
                        names |= _code_global_names(f.__code__)
        return names

    def _expand_reads(self, names):
        ns = self.ns
        seen, stack = set(), list(names)
        while stack:
            n = stack.pop()
            if n in seen or n not in ns or self._hidden(n):
                continue
            seen.add(n)
            try:
                stack.extend(m for m in self._refs(ns[n]) if m not in seen)
            except Exception:
                pass
        return seen

    def _order_key(self, name):
        """Payload order: definitions first, so that unpickling code can find them."""
        v = self.ns.get(name)
        if isinstance(v, types.ModuleType):
            return 0, name
        if isinstance(v, type):
            return 1, name
        if isinstance(v, (types.FunctionType, _LRU_WRAPPER)):
            return 2, name
        return 3, name

    def _visible(self):
        """The names a delta covers, in the namespace's order. IPython adds the names it binds
        with every cell (_iN, _N) to the hidden set and never drops them: those are skipped at
        C speed, where a call per name had cost 2.4 ms per cell after 10,000 cells
        (bench/state_sync_bench.py)."""
        hidden = self._hidden
        return [n for n in itertools.filterfalse(self.hidden.__contains__, self.ns)
                if not hidden(n)]

    def _ids(self):
        ns = self.ns
        return {n: id(ns[n]) for n in self._visible()}

    # -- serialization --

    def _dump(self, values, anchors, quiet, dry):
        """One pickle stream per name, all from one pickler (one memo: shared objects stay
        shared). Returns (payload, blobs, oob, offsets, oob_index)."""
        out = _NullWriter() if dry else io.BytesIO()
        if not dry:
            self._fallback.inline_bytes = 0  # counts this payload's
        p = _DeltaPickler(self, out, anchors, quiet, set(values), dry)
        offsets, oob_index = [], []
        for value in values.values():
            offsets.append(0 if dry else out.tell())
            oob_index.append(len(p.oob))
            p.dump(value)
        return (None if dry else out.getvalue()), p.blobs, p.oob, offsets, oob_index

    def _serialize(self, values, anchors, quiet):
        """((payload, blobs, oob, offsets, oob_index), bad), bad = {name: (type, reason)}."""
        empty = _EMPTY_DUMP
        if not values:
            return empty, {}
        try:
            return self._dump(values, anchors, quiet, dry=False), {}
        except Exception:
            pass
        bad = {}
        for name, value in values.items():
            try:
                self._dump({name: value}, anchors, quiet, dry=True)
            except Exception as e:
                bad[name] = (type(value).__name__, self._reason(value, e))
        good = {n: v for n, v in values.items() if n not in bad}
        try:
            dumped = self._dump(good, anchors, quiet, dry=False) if good else empty
        except Exception as e:  # fails only in combination: give up on all of them
            for name, value in good.items():
                bad[name] = (type(value).__name__, self._reason(value, e))
            dumped = empty
        return dumped, bad

    @staticmethod
    def _reason(value, exc):
        if isinstance(exc, _OverFallbackLimit):
            return str(exc)
        if isinstance(exc, _Unpicklable):
            if exc.type_name == type(value).__name__:
                return exc.reason
            return f"it refers to a {exc.type_name} object: {exc.reason}"
        reason = _unpicklable_reason(type(value))
        if reason is not None:
            return reason
        msg = f"{type(exc).__name__}: {exc}"
        return msg if len(msg) <= 300 else msg[:297] + "..."

    def _pack(self, kind, values, deleted, dumped, bad):
        payload, blobs, oob, offsets, oob_index = dumped
        header = {
            "set": list(values),
            "types": [type(v).__name__ for v in values.values()],
            "offsets": offsets,
            "oob_index": oob_index,
            "del": sorted(deleted),
            "bad": [[n, t, r] for n, (t, r) in sorted(bad.items())],
            "blobs": blobs,
            "oob": oob,
            "origin": self.replica_id,
        }
        if len(payload) > self.payload_threshold:
            # Raft entries stay small: libraft 0.15 crashed on a batch of about 37 MB.
            key = self._put_payload(payload)
            if key is not None:
                header["payload"] = key
                payload = b""
        return _pack(kind, header, payload)

    def _put_payload(self, payload):
        """The payload's blob key; None when the store failed and it fits the fallback's limit
        (it then goes inline); _OverFallbackLimit when it does not."""
        self._fallback.inline_bytes = 0  # the payload holds whatever was inlined into it
        return self._fallback.put(self.store, payload)

    def _stored_payload(self, header, payload):
        key = header.get("payload")
        if key is None:
            return payload
        if len(payload):
            raise DeltaFormatError("corrupt nbos state: a stored payload and an inline one")
        return memoryview(self._get(key)).cast("B")

    def _prefetch(self, header):
        """Fetches the blobs this replica lacks (raises before anything is changed)."""
        fetched = {}
        for token, key in header.get("blobs", ()):
            if key is None or key in fetched:
                continue
            if token is not None:
                e, obj = self._table.lookup(token)
                if obj is not None and e.key == key:
                    continue  # this replica already has that content
            fetched[key] = self._get(key)
        # Out-of-band buffers become the storage of what unpickles them, so each must be a
        # writable buffer of its own (the store's are, unless another buffer has the same key).
        buffers, seen = [], set()
        for k in header.get("oob", ()):
            data = self._get(k)
            buffers.append(data if k not in seen and _writable(data) else bytearray(data))
            seen.add(k)
        names = header.get("set", [])
        if len(header.get("offsets", ())) != len(names) or \
                len(header.get("oob_index", ())) != len(names):
            raise DeltaFormatError("corrupt nbos state header (offsets)")
        return fetched, buffers

    def _load_install(self, header, payload, fetched, buffers):
        """Loads the payload name by name, binding each name as soon as it is loaded (code run
        by later unpickling may look it up). A name whose pickle cannot be loaded here becomes
        a placeholder, and so do its objects where other names refer to them; returns
        [Unreplicable] for such names."""
        ns = self.ns
        names, offsets = header["set"], header["offsets"]
        oob_index = header["oob_index"]
        types_ = header.get("types", [])
        origin = header.get("origin")
        rebinds, problems = {}, []
        f, base = io.BytesIO(payload), 0
        u = _DeltaUnpickler(self, f, iter(buffers), fetched, rebinds)
        for i, name in enumerate(names):
            f.seek(base + offsets[i])
            try:
                value = u.load()
            except Exception as exc:
                reason = f"it could not be rebuilt on this replica ({type(exc).__name__}: {exc})"
                type_name = types_[i] if i < len(types_) else "object"
                value = NotReplicated(name, type_name, reason, origin)
                problems.append(Unreplicable(name, reason, type_name))
                if i + 1 < len(names):
                    # Go on with a new unpickler (the old one may hold unread input). Every
                    # memo entry this name's pickle creates must exist, since the unpickler
                    # numbers entries by counting them. Objects of the failed pickle that may
                    # be incomplete become the placeholder, so names sharing them refer to it.
                    memo = u.memo.copy()
                    end = offsets[i + 1]
                    first = _count_memoize(payload[:offsets[i]])
                    total = first + _count_memoize(payload[offsets[i]:end])
                    for index in range(first, total):
                        if index not in memo or not _complete(memo[index]):
                            memo[index] = value
                    prefix = _memo_restorer(total)
                    f, base = io.BytesIO(prefix + bytes(payload)), len(prefix)
                    u = _DeltaUnpickler(self, f, iter(buffers[oob_index[i + 1]:]), fetched,
                                        rebinds)
                    u.restore_memo = memo
                    u.load()  # runs the restorer: memo entries 0..total-1
                    u.restore_memo = None
            ns.update(rebinds)
            rebinds.clear()
            ns[name] = value
        ns.update(self._placeholders(header))
        return problems

    def _placeholders(self, header):
        origin = header.get("origin")
        return {n: NotReplicated(n, t, r, origin) for n, t, r in header.get("bad", ())}

    # -- public API --

    def begin(self, code):
        """Call before the cell runs, with its transformed source. Returns a token for end()."""
        if isinstance(code, bytes):
            code = code.decode("utf-8", "replace")
        names = _scan(code) or _EMPTY_NAMES
        ids = self._ids()
        reads = self._expand_reads(names.reads)
        fps = {n: self._fingerprint(self.ns[n]) for n in reads}
        return _Cell(ids, fps, names)

    def end(self, cell):
        """Call after the cell ran. Returns (delta bytes, [Unreplicable(name, reason), ...])."""
        after, changed, deleted, anchors = self._rebound(cell)
        fallback = StoreFallback(self.fallback_limit_bytes)
        self._digests, self._fallback = {}, fallback
        try:
            quiet = set()
            for n, fp in cell.fps.items():
                if n in after and n not in changed:
                    if self._fingerprint(self.ns[n]) == fp:
                        quiet.add(n)
                    else:
                        changed.add(n)
            values = {n: self.ns[n] for n in sorted(changed, key=self._order_key)}
            dumped, bad = self._serialize(values, anchors, quiet)
            for n in bad:
                del values[n]
            delta = b""
            if values or deleted or bad:
                try:
                    delta = self._pack(KIND_DELTA, values, deleted, dumped, bad)
                except _OverFallbackLimit as e:
                    bad.update((n, (type(v).__name__, str(e))) for n, v in values.items())
                    values = {}
                    delta = self._pack(KIND_DELTA, values, deleted, _EMPTY_DUMP, bad)
        finally:
            self._digests = self._fallback = None
        self.store_fallback = fallback if fallback.inline_bytes and values else None
        problems = []
        for n, (type_name, reason) in bad.items():
            if self._reported.get(n) != id(self.ns[n]):
                self._reported[n] = id(self.ns[n])
                problems.append(Unreplicable(n, reason, type_name))
        for n in itertools.chain(values, deleted):
            self._reported.pop(n, None)
        return delta, problems

    def _rebound(self, cell):
        """(name -> id of every visible name now, names whose binding the cell changed or that
        it binds, names it deleted, id -> name of the objects still bound where they were)."""
        before = cell.ids
        after, anchors, changed = {}, {}, set()
        ns = self.ns
        for n in self._visible():
            v = ns[n]
            i = id(v)
            after[n] = i
            if before.get(n) != i:
                changed.add(n)
            elif type(v) not in _NO_ANCHOR:
                anchors.setdefault(i, n)
        deleted = [n for n in before if n not in after]
        for n in cell.names.bound:
            if n in after and n not in cell.fps:
                changed.add(n)
        return after, changed, deleted, anchors

    def apply(self, delta):
        """Apply a delta produced by another replica's end() to this namespace.

        Returns [Unreplicable(name, reason)] for names whose value could not be rebuilt here
        (normally empty); those names are bound to NotReplicated placeholders. b"" (a cell that
        changed no name) changes nothing."""
        if not len(delta):
            return []
        header, payload = _unpack(delta)
        if header["kind"] != "delta":
            raise DeltaFormatError("apply() got a snapshot; use restore()")
        payload = self._stored_payload(header, payload)
        fetched, buffers = self._prefetch(header)
        for n in header.get("del", ()):
            self.ns.pop(n, None)
        return self._load_install(header, payload, fetched, buffers)

    def blob_keys(self, data):
        """Distinct blob keys a delta or snapshot refers to, in first-use order."""
        header, _ = _unpack(data)
        keys = [header.get("payload")] + [k for _, k in header.get("blobs", ())] + \
            list(header.get("oob", ()))
        return list(dict.fromkeys(k for k in keys if k is not None))

    def snapshot(self):
        """The whole user namespace (without hidden names) and its object tokens, as bytes."""
        values = {n: self.ns[n] for n in sorted(self._visible(), key=self._order_key)}
        fallback = StoreFallback(self.fallback_limit_bytes)
        self._digests, self._fallback = {}, fallback
        try:
            dumped, bad = self._serialize(values, {}, set())
            if fallback.exceeded:  # a snapshot that leaves names out must not replace the state
                raise _OverFallbackLimit(next(iter(bad.values()))[1])
            for n in bad:
                del values[n]
            data = self._pack(KIND_SNAPSHOT, values, (), dumped, bad)
        finally:
            self._digests = self._fallback = None
        self.store_fallback = fallback if fallback.inline_bytes and values else None
        return data

    def reset(self):
        """Back to the state before any delta: no visible names, an empty object table (what
        restore() of an empty namespace's snapshot would give)."""
        self._table = _Table()
        for n in self._visible():
            del self.ns[n]
        self._reported.clear()

    def restore(self, data):
        """Rebuild the namespace and the object table from a snapshot(). Returns what apply()
        returns."""
        header, payload = _unpack(data)
        if header["kind"] != "snapshot":
            raise DeltaFormatError("restore() got a delta; use apply()")
        old_table, self._table = self._table, _Table()
        try:
            payload = self._stored_payload(header, payload)
            fetched, buffers = self._prefetch(header)
        except BaseException:
            self._table = old_table
            raise
        ns = self.ns
        for n in self._visible():
            del ns[n]
        self._reported.clear()
        return self._load_install(header, payload, fetched, buffers)
