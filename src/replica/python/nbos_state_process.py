"""Process state beyond the namespace: RNG streams and library settings that travel with it.

`random.seed(7)`, `np.set_printoptions(...)`, `pd.set_option(...)`, `plt.rcParams[...] = ...`, a
logger's level or a warnings filter change the libraries' module state, not the namespace. Each
such piece of state is one entry of a registry; StateSync carries the entries a cell changed in
its delta, as the pseudo-names PREFIX + entry name (nbos_state_wire), and all of them in
snapshots.

Contract
--------
    ENTRIES                     the registry, in the order deltas carry and apply entries; a
                                library more is one Entry more:
    Entry(name, module, capture, apply)
        name                    the entry's stable name on the wire
        module                  the sys.modules key that must be imported for the entry to be
                                captured; capturing imports nothing, applying imports it where a
                                standby lacks it
        capture() -> value      the state now, through the library's public getters: picklable,
                                comparable with ==; None when there is nothing to carry
        apply(value)            makes this process's state `value` (may raise; it then applied
                                what it could)
    state = ProcessState()      one per replica; the state the process has now counts as sent
                                (every replica starts from its libraries' defaults)
    state.changed() -> {name: value}
                                on the executor after each cell: the entries whose capture
                                differs from the last value this replica sent or applied, and
                                those imported since; they count as sent from then on. An entry
                                whose capture raises is left out. Costs tens of microseconds
                                with numpy, torch, pandas and matplotlib imported
    state.everything() -> {name: value}
                                every entry of an imported module (for snapshots)
    state.apply(name, value)    on a standby: imports the entry's module if needed and applies
                                it (KeyError for an entry this replica does not know, or what
                                its apply raises); what the process then has counts as applied,
                                so that this replica, once executor, does not send it back
    bind_cuda_rng()             GpuBinding.bind calls it after torch.cuda.set_device: puts the
                                CUDA generator state last captured or applied on this replica
                                onto the current device when it is not there yet; never raises

Entries: "random" (the random module's generator), "numpy.random" (numpy's legacy global
RandomState), "torch.random" (torch's CPU generator, initial_seed() included), "torch.cuda.random"
(the CUDA generator of the device the last cell ran on; captured only once the process
initialised CUDA, and applied on a standby only at its next GPU bind, so that applying never
initialises CUDA), "numpy.printoptions", "pandas.options" (every registered option),
"matplotlib.rcParams" (the backend included, unless it is still to be resolved), "logging.levels"
(levels of the root and of the named loggers that have one), "logging.handlers" (the handlers
logging.basicConfig makes: a StreamHandler on sys.stdout or sys.stderr, a FileHandler, with their
level and format; other handlers are the replica's own),
"warnings.filters",
"sys.recursionlimit", "torch.flags" (threads, deterministic algorithms, cuDNN flags, default
dtype, float32 matmul precision; not interop threads, which cannot be set after parallel work
started), and the IPython shell's own: "ipython.traceback" (%xmode, %colors), "ipython.precision"
(%precision), "ipython.extensions" (%load_ext: loaded where missing), "ipython.figure_formats"
(%config InlineBackend.figure_format).

Limits: an unseeded generator differs between replicas until the executor draws from it or
seeds it (each replica seeds its own at import). Not seen: a value mutated in place inside
matplotlib.rcParams (rcParams['font.family'].append(...)), a level assigned to Logger.level
directly (logging's own caches miss it too), a module imported while another left sys.modules
(the number of modules says when to look for newly imported libraries). A notebook that imports
torch in a cell sends torch's thread count, so standbys use the executor's. matplotlib's backend
is carried only once resolved (reading it resolves it); numpy's global generator only when it is
numpy's MT19937.
"""

import importlib
import sys
import warnings
from collections import namedtuple

import nbos_state_wire as wire

__all__ = ["PREFIX", "ENTRIES", "Entry", "ProcessState", "bind_cuda_rng"]

PREFIX = wire.PROCESS_PREFIX

Entry = namedtuple("Entry", "name module capture apply")


# ------------------------------------------------------------------------------------------
# Helpers shared by entries


def _tensor_bytes(t):
    return t.contiguous().numpy().tobytes()  # a generator state: a CPU uint8 tensor


def _byte_tensor(torch, data):
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _set_each(changes, setter):
    """setter(key, value) for every pair, the deprecation warnings silenced; the failures are
    raised together at the end, after the others were set."""
    failed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key, value in changes:
            try:
                setter(key, value)
            except Exception as e:
                failed.append(f"{key} ({type(e).__name__}: {e})")
    if failed:
        raise ValueError("could not set " + "; ".join(failed)[:500])


def _differing(value, current):
    """(key, value) pairs of dict `value` that dict `current` does not have equal."""
    missing = object()
    for key, v in value.items():
        old = current.get(key, missing)
        try:
            same = old is v or bool(old == v)
        except Exception:
            same = False
        if not same:
            yield key, v


def _same(a, b):
    try:
        return a is b or bool(a == b)
    except Exception:
        return False


# ------------------------------------------------------------------------------------------
# Entries


def _random_apply(value):
    sys.modules["random"].setstate(value)


def _numpy_rng_capture():
    _, key, pos, has_gauss, gauss = sys.modules["numpy.random"].get_state()
    return ("MT19937", key.tobytes(), pos, has_gauss, gauss)


def _numpy_rng_apply(value):
    np = sys.modules["numpy"]
    name, key, pos, has_gauss, gauss = value
    np.random.set_state((name, np.frombuffer(key, dtype=np.uint32), pos, has_gauss, gauss))


def _torch_rng_capture():
    return _tensor_bytes(sys.modules["torch"].get_rng_state())


def _torch_rng_apply(value):
    torch = sys.modules["torch"]
    torch.set_rng_state(_byte_tensor(torch, value))  # its seed too: initial_seed() follows


class _CudaGenerator:
    """The CUDA generator state of the device this replica's cells last ran on."""

    def __init__(self):
        self.state = None   # bytes, last captured or applied
        self.device = None  # the device that has it; None while it waits for a GPU bind

    def capture(self):
        torch = sys.modules["torch"]
        if self.device is None and self.state is not None:
            return self.state  # applied here, not on a device yet
        if not torch.cuda.is_initialized():
            return self.state
        self.state = _tensor_bytes(torch.cuda.get_rng_state())
        self.device = torch.cuda.current_device()
        return self.state

    def apply(self, value):
        self.state, self.device = bytes(value), None

    def bind(self):
        if self.state is None:
            return
        torch = sys.modules["torch"]
        device = torch.cuda.current_device()
        if device != self.device:
            torch.cuda.set_rng_state(_byte_tensor(torch, self.state))
            self.device = device


_CUDA = _CudaGenerator()


def bind_cuda_rng():
    """See the module docstring."""
    try:
        _CUDA.bind()
    except Exception as e:
        sys.stderr.write(f"nbos: cannot restore the CUDA generator state on this device: "
                         f"{type(e).__name__}: {e}\n")


def _printoptions_capture():
    return sys.modules["numpy"].get_printoptions()


def _printoptions_apply(value):
    sys.modules["numpy"].set_printoptions(**value)


def _pandas_config():
    return sys.modules["pandas._config.config"]


def _pandas_capture():
    # pandas keeps every registered option in nested dicts, one per dotted prefix: a copy of
    # them compares in C, where get_option per key costs microseconds each.
    return _nested_copy(_pandas_config()._global_config)


def _nested_copy(d):
    return {k: _nested_copy(v) if type(v) is dict else v for k, v in d.items()}


def _flat(options, prefix=""):
    out = {}
    for key, value in options.items():
        if type(value) is dict:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _pandas_apply(value):
    config = _pandas_config()
    # A deprecated option that names its replacement sets the replacement, which has its own key.
    renamed = {k for k, d in config._deprecated_options.items() if d.rkey}
    changes = [(k, v) for k, v in _differing(_flat(value), _flat(_pandas_capture()))
               if k not in renamed]
    _set_each(changes, sys.modules["pandas"].set_option)


def _rc_capture():
    rc = sys.modules["matplotlib"].rcParams
    # dict.items, not rcParams' own methods: reading "backend" through them resolves it.
    value = dict(dict.items(rc))
    backend = rc._get_backend_or_none()
    if backend is None:
        del value["backend"]
    else:
        value["backend"] = backend
    return value


def _rc_apply(value):
    rc = sys.modules["matplotlib"].rcParams
    changes = [(k, v) for k, v in _differing(value, dict(dict.items(rc))) if k != "backend"]
    _set_each(changes, rc.__setitem__)
    backend = value.get("backend")
    if backend is not None and backend != rc._get_backend_or_none():
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None:
            pyplot.switch_backend(backend)
        else:
            rc["backend"] = backend


def _named_loggers(logging):
    return [(name, logger) for name, logger in list(logging.root.manager.loggerDict.items())
            if isinstance(logger, logging.Logger)]


def _logging_capture():
    # The levels set: a logger made without one (most of them) inherits, and changes nothing.
    logging = sys.modules["logging"]
    levels = {name: logger.level for name, logger in _named_loggers(logging) if logger.level}
    levels[""] = logging.root.level
    return levels


def _logging_apply(value):
    logging = sys.modules["logging"]
    for name, level in value.items():
        logger = logging.getLogger(name)  # "" is the root logger
        if logger.level != level:
            logger.setLevel(level)
    for name, logger in _named_loggers(logging):
        if logger.level and name not in value:
            logger.setLevel(logging.NOTSET)


_STD_STREAMS = ("stdout", "stderr")


def _handler_record(logging, handler):
    """What rebuilds a handler of the kinds logging.basicConfig makes (a StreamHandler on
    sys.stdout or sys.stderr, a FileHandler), or None for any other handler."""
    f = handler.formatter
    form = (f._fmt, f.datefmt, type(f._style).__name__) if type(f) is logging.Formatter else None
    if type(handler) is logging.StreamHandler:
        stream = next((n for n in _STD_STREAMS if handler.stream is getattr(sys, n)), None)
        return None if stream is None else ("stream", stream, handler.level, form)
    if type(handler) is logging.FileHandler:
        return ("file", (handler.baseFilename, handler.mode), handler.level, form)
    return None


def _handlers_capture():
    logging = sys.modules["logging"]
    out = {}
    for name, logger in [("", logging.root)] + _named_loggers(logging):
        records = [r for r in (_handler_record(logging, h) for h in logger.handlers) if r]
        if records:
            out[name] = records
    return out


_STYLES = {"PercentStyle": "%", "StrFormatStyle": "{", "StringTemplateStyle": "$"}


def _make_handler(logging, record):
    kind, where, level, form = record
    handler = logging.StreamHandler(getattr(sys, where)) if kind == "stream" else \
        logging.FileHandler(where[0], where[1])
    handler.setLevel(level)
    if form is not None:
        handler.setFormatter(logging.Formatter(form[0], form[1], _STYLES.get(form[2], "%")))
    return handler


def _handlers_apply(value):
    # Handlers of the kinds carried are replaced; any other a standby has stays.
    logging = sys.modules["logging"]
    names = {name for name, _ in _named_loggers(logging)} | {""} | set(value)
    for name in names:
        logger = logging.getLogger(name)  # "" is the root logger
        carried = [h for h in logger.handlers if _handler_record(logging, h)]
        if [_handler_record(logging, h) for h in carried] == list(value.get(name, ())):
            continue
        for handler in carried:
            logger.removeHandler(handler)
            handler.close()
        for record in value.get(name, ()):
            logger.addHandler(_make_handler(logging, record))


def _shell():
    """The kernel's IPython shell, or None (no shell: nothing of it to carry)."""
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def _traceback_capture():
    shell = _shell()
    return None if shell is None else (shell.InteractiveTB.mode, shell.colors)


def _traceback_apply(value):
    mode, colors = value
    shell = _shell()
    if shell.InteractiveTB.mode != mode:
        shell.InteractiveTB.set_mode(mode)
    if shell.colors != colors:
        shell.run_line_magic("colors", colors)


def _precision_capture():
    shell = _shell()
    return None if shell is None else \
        shell.display_formatter.formatters["text/plain"].float_precision


def _precision_apply(value):
    shell = _shell()
    shell.display_formatter.formatters["text/plain"].float_precision = value


def _extensions_capture():
    shell = _shell()
    return None if shell is None else tuple(sorted(shell.extension_manager.loaded))


def _extensions_apply(value):
    shell = _shell()
    for name in value:
        if name not in shell.extension_manager.loaded:
            shell.extension_manager.load_extension(name)


def _figure_formats_capture():
    shell = _shell()
    config = sys.modules["matplotlib_inline.config"]
    return None if shell is None else \
        tuple(sorted(config.InlineBackend.instance(parent=shell).figure_formats))


def _figure_formats_apply(value):
    # The trait's observer selects the display formats, as %config InlineBackend.figure_format.
    inline = sys.modules["matplotlib_inline.config"].InlineBackend.instance(parent=_shell())
    if set(inline.figure_formats) != set(value):
        inline.figure_formats = set(value)


def _warnings_capture():
    return tuple(sys.modules["warnings"].filters)


def _warnings_apply(value):
    module = sys.modules["warnings"]
    module.filters[:] = value
    module._filters_mutated()


_TORCH_FLAGS = ("num_threads", "deterministic", "deterministic_warn_only", "cudnn_deterministic",
                "cudnn_benchmark", "default_dtype", "float32_matmul_precision")


def _torch_flags_capture():
    torch = sys.modules["torch"]
    cudnn = torch.backends.cudnn
    return dict(zip(_TORCH_FLAGS, (
        torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(), cudnn.deterministic,
        cudnn.benchmark, torch.get_default_dtype(), torch.get_float32_matmul_precision())))


def _torch_flags_apply(value):
    torch = sys.modules["torch"]
    cudnn = torch.backends.cudnn

    def deterministic(_):
        torch.use_deterministic_algorithms(value["deterministic"],
                                           warn_only=value["deterministic_warn_only"])

    setters = {
        "num_threads": torch.set_num_threads,
        "deterministic": deterministic,
        "deterministic_warn_only": deterministic,
        "cudnn_deterministic": lambda v: setattr(cudnn, "deterministic", v),
        "cudnn_benchmark": lambda v: setattr(cudnn, "benchmark", v),
        "default_dtype": torch.set_default_dtype,
        "float32_matmul_precision": torch.set_float32_matmul_precision,
    }
    _set_each(list(_differing(value, _torch_flags_capture())), lambda k, v: setters[k](v))


ENTRIES = (
    Entry("random", "random", lambda: sys.modules["random"].getstate(), _random_apply),
    Entry("numpy.random", "numpy.random", _numpy_rng_capture, _numpy_rng_apply),
    Entry("torch.random", "torch", _torch_rng_capture, _torch_rng_apply),
    Entry("torch.cuda.random", "torch", _CUDA.capture, _CUDA.apply),
    Entry("numpy.printoptions", "numpy", _printoptions_capture, _printoptions_apply),
    Entry("pandas.options", "pandas", _pandas_capture, _pandas_apply),
    Entry("matplotlib.rcParams", "matplotlib", _rc_capture, _rc_apply),
    Entry("logging.levels", "logging", _logging_capture, _logging_apply),
    Entry("logging.handlers", "logging", _handlers_capture, _handlers_apply),
    Entry("warnings.filters", "warnings", _warnings_capture, _warnings_apply),
    Entry("sys.recursionlimit", "sys", sys.getrecursionlimit, sys.setrecursionlimit),
    Entry("torch.flags", "torch", _torch_flags_capture, _torch_flags_apply),
    Entry("ipython.traceback", "IPython", _traceback_capture, _traceback_apply),
    Entry("ipython.precision", "IPython", _precision_capture, _precision_apply),
    Entry("ipython.extensions", "IPython", _extensions_capture, _extensions_apply),
    Entry("ipython.figure_formats", "matplotlib_inline.config", _figure_formats_capture,
          _figure_formats_apply),
)


# ------------------------------------------------------------------------------------------


class _Tracked:
    """An entry and what this replica last sent or applied of it."""

    __slots__ = ("entry", "value")

    def __init__(self, entry):
        self.entry, self.value = entry, _NEVER

    def remember(self):
        try:
            self.value = self.entry.capture()
        except Exception:  # compared afresh by the next changed()
            self.value = _NEVER


_NEVER = object()  # the value of an entry this replica has not seen yet


class ProcessState:
    """Per replica: the last value sent or applied per entry (see the module docstring)."""

    def __init__(self, entries=ENTRIES):
        self._tracked = {e.name: _Tracked(e) for e in entries}
        self._imported = (-1, [])  # (len(sys.modules), the _Tracked of imported entries) then
        for t in self._active():
            t.remember()

    def _active(self):
        # Modules are only ever added in practice: the number of modules says when to look.
        count = len(sys.modules)
        if self._imported[0] != count:
            self._imported = count, [t for t in self._tracked.values()
                                     if t.entry.module in sys.modules]
        return self._imported[1]

    def changed(self):
        out = {}
        for t in self._active():
            try:
                value = t.entry.capture()
            except Exception:
                continue
            if _same(value, t.value):
                continue
            t.value = value
            if value is not None:
                out[t.entry.name] = value
        return out

    def everything(self):
        out = {}
        for t in self._active():
            try:
                value = t.entry.capture()
            except Exception:
                continue
            if value is not None:
                out[t.entry.name] = value
        return out

    def apply(self, name, value):
        t = self._tracked[name]
        if t.entry.module not in sys.modules:
            importlib.import_module(t.entry.module)
        try:
            t.entry.apply(value)
        finally:
            t.remember()
