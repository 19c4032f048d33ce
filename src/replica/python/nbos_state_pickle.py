"""Fingerprints and delta pickling: how namespace values become the pickles of a delta, and back.

Contract
--------
    FingerprintPickler(sync, h, top).dump(value)   # feeds a content fingerprint of value into
                                                   # the hash h; tensors/arrays appear as cheap
                                                   # fingerprints, code by identity
    DeltaPickler(sync, file, anchors, quiet, delta_names, dry)
        .dump(value) per name; .blobs, .oob         # one pickler per payload (one shared memo)
    DeltaUnpickler(sync, file, buffers, fetched, rebinds).load()
    Table                                          # tokens <-> objects (weak), per replica
    NotReplicated, NotReplicatedError, Unreplicable, DeltaApplyError
    StoreFallback, OverFallbackLimit               # a failing blob store during one write
    unpicklable_reason(type) -> str | None         # why objects of a type are never replicated
    memo_restorer(n), count_memoize(data), complete(obj)
                                                   # going on after a name failed to load

`sync` is the StateSync the pickler works for: it gives .ns (the namespace), ._table,
.store, .oob_threshold, ._digest(array), ._fallback (a StoreFallback while it writes) and
._tracked_types(). This module's helpers are referred to by pickles, by module name: every
replica must load it under the name "nbos_state_pickle" (nbos_state re-exports them under its
own name for pickles written before the split).

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
"""

import copyreg
import enum
import functools
import importlib
import io
import itertools
import os
import pickle
import pickletools
import sys
import threading
import types
import warnings
import weakref
from collections import namedtuple

import cloudpickle

import nbos_state_codec as codec
import nbos_state_wire as wire

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

_PROTOCOL = 5


class NotReplicatedError(RuntimeError):
    """Raised when a standby uses a value that could not be replicated to it."""


class DeltaApplyError(RuntimeError):
    """A delta does not fit this replica's namespace (it needs a snapshot restore)."""


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
        if wire.is_pseudo_name(self.name):
            return f"nbos: cannot replicate {wire.readable_name(self.name)}: {self.reason}"
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
        the bytes, which count against the limit (OverFallbackLimit past it)."""
        if self.error is None:
            try:
                return store.put(data)
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
        self.take(memoryview(data).nbytes)
        return None

    def take(self, nbytes):
        """Counts nbytes more inlined, or raises OverFallbackLimit once over the limit."""
        if self.inline_bytes + nbytes > self.limit_bytes:
            self.exceeded = True
            raise OverFallbackLimit(
                f"the blob store failed ({self.error}) and this cell's data is over the"
                f" {amount(self.limit_bytes)} the replication log takes instead")
        self.inline_bytes += nbytes

    def message(self):
        return (f"nbos: the blob store failed ({self.error}); {amount(self.inline_bytes)} of"
                " this cell's data went through the replication log instead")


class OverFallbackLimit(RuntimeError):
    pass


EMPTY_DUMP = (b"", [], [], [], [])


def amount(nbytes):
    return f"{nbytes / 2**20:.1f} MB" if nbytes >= 2**20 else f"{nbytes / 1024:.0f} KB"


class Unpicklable(pickle.PicklingError):
    def __init__(self, reason, type_name):
        super().__init__(reason)
        self.reason = reason
        self.type_name = type_name


_reason_cache = {}


def unpicklable_reason(t):
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

class Entry:
    __slots__ = ("token", "ref", "key", "fp")

    def __init__(self, token, ref):
        self.token, self.ref, self.key, self.fp = token, ref, None, None


class Table:
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
        e = Entry(token, ref)
        by_token[token] = e
        by_id[oid] = e
        return e


# ------------------------------------------------------------------------------------------
# Picklers

_ATOMIC = frozenset({int, float, complex, bool, type(None), str, tuple, frozenset, range,
                     slice, type(Ellipsis), type(NotImplemented)})
NO_ANCHOR = _ATOMIC | {bytes}
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
        if t is LRU_WRAPPER and hasattr(obj, "__wrapped__"):
            # By default it pickles by reference to __main__.<name>; rebuild it (empty cache).
            params = obj.cache_parameters()
            return (_make_lru_cache, (obj.__wrapped__, params["maxsize"], params["typed"]))
        if t is types.ModuleType:
            rv = _reduce_module(obj)
            if rv is not None:
                return rv
        if t is not type:
            reason = unpicklable_reason(t)
            if reason is not None and not (issubclass(t, io.IOBase) and _is_std_stream(obj)):
                if issubclass(t, io.IOBase) and _is_closed(obj):
                    return (_closed_file, (_file_attr(obj, "name"), _file_attr(obj, "mode"),
                                           repr(obj)))
                raise Unpicklable(reason, t.__name__)
        return super().reducer_override(obj)


LRU_WRAPPER = type(functools.lru_cache(maxsize=None)(lambda: None))


def _is_closed(f):
    try:
        return f.closed is True
    except Exception:
        return False


def _file_attr(f, attr):
    try:
        value = getattr(f, attr)
    except Exception:
        return None
    return value if isinstance(value, (str, int)) else None


class ClosedFile:
    """Stands in, on another replica, for a file object that was closed when it was replicated
    (what `with open(...) as f:` leaves bound): its name, mode and closed flag read as the file's
    did, and any other use fails as it would on the closed file, with ValueError."""

    __slots__ = ("name", "mode", "_repr")
    closed = True

    def __init__(self, name, mode, shown):
        self.name, self.mode, self._repr = name, mode, shown

    def _closed(self, *args, **kwargs):
        raise ValueError("I/O operation on closed file.")

    def __getattr__(self, attr):
        self._closed()

    def __repr__(self):
        return self._repr

    __iter__ = __next__ = __enter__ = __exit__ = _closed


def _closed_file(name, mode, shown):
    return ClosedFile(name, mode, shown)


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


class NullWriter:
    def write(self, b):
        return len(b)


class FingerprintPickler(_BasePickler):
    """Pickles into a hash; tensors/arrays/classes/functions appear as cheap fingerprints."""

    def __init__(self, sync, h, top):
        super().__init__(_HashWriter(h), sync.ns, self._buffer)
        self._h = h
        self._sync = sync
        self._top = top
        np = codec.numpy_module()
        self._ndarray = np.ndarray if np is not None else ()
        torch = codec.torch_module()
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
            if not codec.is_plain_tensor(self._torch, obj):
                return None
            return ("t", codec.tensor_fp(obj))
        if obj is not self._top and (t is types.FunctionType or isinstance(obj, type)):
            return ("f", id(obj))
        if t is types.ModuleType:
            return ("m", getattr(obj, "__name__", id(obj)))
        if t is NotReplicated:
            return ("p", id(obj))
        if obj is self._shell and obj is not None:
            return ("shell",)
        return None


class DeltaPickler(_BasePickler):
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
        np = codec.numpy_module()
        self._ndarray = np.ndarray if np is not None else ()
        torch = codec.torch_module()
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
            if codec.is_plain_tensor(self._torch, obj):
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
        if unpicklable_reason(t) is not None:
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
        src, fortran = codec.array_layout(a)
        if a.nbytes <= self._threshold:
            return ("a", tok, None, codec.array_bytes(src).tobytes(), a.dtype, a.shape, fortran)
        key, inline = self._stored(e, lambda: self._sync._digest(a),
                                   lambda: codec.array_bytes(src))
        return ("a", tok, key, inline, a.dtype, a.shape, fortran)

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
            return ("t", tok, None, codec.tensor_bytes(t).tobytes(), meta, grad)
        key, inline = self._stored(e, lambda: codec.tensor_fp(t, with_grad=False),
                                   lambda: codec.tensor_bytes(t))
        return ("t", tok, key, inline, meta, grad)

    def _stored(self, e, fingerprint, raw):
        """(key, None) for a large value in the store, put there unless its fingerprint is the
        one of entry `e`'s last put (key None in a dry run); (None, bytes) when the put failed,
        so the value travels inline."""
        if not self._dry:
            digest = fingerprint()
            if e.key is None or e.fp != digest:
                key = self._put(memoryview(raw()))
                e.key, e.fp = key, (digest if key is not None else None)
                if key is None:
                    return None, self._inline(raw())
        key = e.key if not self._dry else None
        self.blobs.append([e.token, key])
        return key, None


class DeltaUnpickler(pickle.Unpickler):
    def __init__(self, sync, file, buffers, fetched, rebinds):
        super().__init__(file, buffers=buffers)
        self._sync = sync
        self._ns = sync.ns
        self._table = sync._table
        self._fetched = fetched
        self._taken = set()  # keys whose fetched buffer a loaded object now owns
        self.rebinds = rebinds
        self.restore_memo = None  # {index: object} while memo_restorer's pickle is loaded

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
        if key in self._taken or not codec.writable(data):
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
                # A standby prints nothing: numpy warns on reading the flags of, and on writing
                # to, a view from np.broadcast_arrays.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if not obj.flags.writeable:
                        obj.setflags(write=True)
                    obj[...] = codec.array_from_bytes(data, dtype, shape, fortran, writable=False)
                e.key, e.fp = key, None
                return obj
            except Exception:
                pass
        owned = False
        if inline is None:
            data, owned = self._blob_to_keep(key)
        new = codec.array_from_bytes(data, dtype, shape, fortran, owned=owned)
        e = self._table.register(new, token)
        if e is not None:
            e.key = key
        return new

    def _load_tensor(self, token, key, inline, meta, grad):
        torch = codec.torch_module()
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
                        obj.copy_(codec.tensor_from_bytes(data, dtype, shape, writable=False))
                    else:
                        obj.data = codec.tensor_from_bytes(data, dtype, shape,
                                                      owned=owned).to(obj.device)
            else:
                src = codec.tensor_from_bytes(data, dtype, shape,
                                         owned=owned).to(codec.tensor_device(torch, device))
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
            e.fp = codec.tensor_fp(obj, with_grad=False) if key is not None else None
        return obj


# ------------------------------------------------------------------------------------------
# Recovering from a name that cannot be loaded

_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, types.FunctionType,
          types.BuiltinFunctionType, types.ModuleType)


def complete(obj, depth=0):
    """Whether an object found in the memo of a failed load is surely complete (immutable)."""
    if isinstance(obj, _ATOMS):
        return True
    return type(obj) is tuple and depth < 3 and all(complete(x, depth + 1) for x in obj)


def memo_restorer(n):
    """A pickle that makes an unpickler memoize persistent ids 0..n-1, in order."""
    return b"".join([b"\x80\x05"] + [b"J" + i.to_bytes(4, "little", signed=True) + b"Q\x94" + b"0"
                                      for i in range(n)] + [b"N."])


def count_memoize(data):
    """Memo entries a (sequence of) protocol-4+ pickle(s) creates."""
    n = 0
    f = io.BytesIO(data)
    while f.tell() < len(data):
        for op, _, _ in pickletools.genops(f):
            if op.name == "MEMOIZE":
                n += 1
    return n
