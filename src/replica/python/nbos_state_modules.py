"""Notebook-local modules: their source and their module-level state travel with the namespace.

A module is local when its file lies outside the interpreter's installed trees (the standard
library, site- and dist-packages, the user site) and outside nbos's own: the notebook's own
helpers (`utils.py` beside it, a package of the project). Other replicas may not have its file (no shared workspace), or
may have a newer one (edited since the executor imported it, without a reload); either way a
replica that imported the file itself could run other code than the executor. So a delta carries
what the executor runs:

    "nbos:module:<name>"        (file, is_package, digest, source): the module's source as the
                                executor loaded it, sent when this replica has not sent or
                                applied that version before (every replica applies every delta,
                                so all know it). A standby whose module of that name is another
                                version runs the source into it (as importlib.reload does: the
                                module object stays the same); one without it creates it, as an
                                import would. Parents come before their submodules.
    "nbos:module-state:<name>"  {attribute: value}: the module's data (what is not its own
                                functions, classes or submodules, nor dunder names, nor values
                                that cannot be replicated, such as locks and open files, which
                                keep what running the source gave them). Applied after the
                                namespace's names, through the same pickler, so objects shared
                                with the namespace stay shared.

Contract
--------
    LocalModules(is_local=is_local_file)
    token = m.begin(values, fp)   # before a cell: `values` are what the cell reads (its
                                  # expanded reads); remembers the local modules they belong to,
                                  # their version and fp(state) (fp: StateSync's fingerprint)
    m.end(token, fp)              # after it: {pseudo-name: value} for modules new on this replica,
                                  # reloaded, or touched with changed state
    m.everything()                # every local module's source and state (snapshots)
    m.apply(pseudo_name, value)   # on a standby; raises when the source cannot run here
    is_pseudo_name(name)          # whether a delta name is one of this module's

What is not replicated: `%autoreload` (it patches code objects in place), attributes deleted
from a module, and modules imported by code that no cell's reads lead to before the next
snapshot (they are found at the next cell that imports anything).
"""

import contextlib
import functools
import hashlib
import importlib.util
import io
import os
import site
import sys
import sysconfig
import types

import nbos_state_pickle as pk
import nbos_state_wire as wire

__all__ = ["LocalModules", "SOURCE_PREFIX", "STATE_PREFIX", "is_pseudo_name", "is_local_file"]

SOURCE_PREFIX = wire.MODULE_PREFIX
STATE_PREFIX = wire.MODULE_STATE_PREFIX


def is_pseudo_name(name):
    return name.startswith(SOURCE_PREFIX) or name.startswith(STATE_PREFIX)


def _installed_trees():
    # nbos's own modules are compiled into the binary; run from their sources (their tests),
    # the files beside them are nbos's too.
    trees = {os.path.dirname(__file__)} if os.path.isabs(__file__) else set()
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            trees.add(paths[key])
    try:
        trees.update(site.getsitepackages())
        trees.add(site.getusersitepackages())
    except Exception:  # site may be trimmed in embedded interpreters
        pass
    trees.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    return tuple(sorted(os.path.realpath(t) + os.sep for t in trees if t))


_INSTALLED = None


@functools.lru_cache(maxsize=4096)
def is_local_file(path):
    """Whether a module file is the notebook's own: a source file outside the installed trees
    (as named, and as its symbolic links resolve) and outside any site- or dist-packages
    directory (a virtual environment's, a conda prefix's)."""
    global _INSTALLED
    if not isinstance(path, str) or not path.endswith(".py") or not os.path.isabs(path):
        return False
    if _INSTALLED is None:
        _INSTALLED = _installed_trees()
    if "/site-packages/" in path or "/dist-packages/" in path:
        return False
    return not path.startswith(_INSTALLED) and not os.path.realpath(path).startswith(_INSTALLED)


def _module_file(module):
    f = getattr(module, "__file__", None)
    return f if isinstance(f, str) else None


def _version(module):
    """What changes when a module is (re)loaded: importlib.reload gives it a new spec."""
    return id(module), id(getattr(module, "__spec__", None))


def _state(module):
    """The module's data: what running its source does not define by itself."""
    name = module.__name__
    out = {}
    for attr, value in list(vars(module).items()):
        if attr.startswith("__") and attr.endswith("__"):
            continue
        t = type(value)
        if t is types.ModuleType:
            continue
        if (t is types.FunctionType or isinstance(value, type)) and \
                getattr(value, "__module__", None) == name:
            continue
        if t is not type and pk.unpicklable_reason(t) is not None:
            continue
        out[attr] = value
    return out


def _depth_first(names):
    return sorted(names, key=lambda n: (n.count("."), n))


class LocalModules:
    """The local modules of one replica, and the versions of them every replica knows."""

    def __init__(self, is_local=is_local_file):
        self._is_local = is_local
        self._sources = {}    # (id(module), id(spec)) -> (file, is_package, digest, source)
        self._known = {}      # module name -> digest of the version this replica runs
        self._loaded = {}     # module name -> _version() of the module when last seen
        self._modules_seen = 0

    # -- the executor --

    def _local(self, name):
        module = sys.modules.get(name)
        if type(module) is not types.ModuleType or not self._is_local(_module_file(module)):
            return None
        return module

    def _owner(self, value):
        if type(value) is types.ModuleType:
            return value.__name__
        name = getattr(value, "__module__", None)
        if not isinstance(name, str):
            name = getattr(type(value), "__module__", None)
        return name if isinstance(name, str) and name != "__main__" else None

    def begin(self, values, fingerprint):
        """Token for end(): the local modules the cell's reads lead to, with their version and
        state fingerprint."""
        touched = {}
        for value in values:
            name = self._owner(value)
            if name is None or name in touched:
                continue
            module = self._local(name)
            if module is not None:
                touched[name] = (_version(module), fingerprint(_state(module)))
        return touched

    def end(self, token, fingerprint):
        """{pseudo-name: value} of the modules the cell loaded, reloaded or changed."""
        changed = {}
        for name in self._new_local_modules():
            changed[name] = self._local(name)
        for name, (version, state_fp) in token.items():
            module = self._local(name)
            if module is not None and (_version(module) != version or
                                       fingerprint(_state(module)) != state_fp):
                changed[name] = module
        return self._records({n: m for n, m in changed.items() if m is not None})

    def everything(self):
        names = [n for n in list(sys.modules) if self._local(n) is not None]
        return self._records({n: sys.modules[n] for n in names}, all_sources=True)

    def _new_local_modules(self):
        """Local modules that appeared since the last look (cheap when nothing was imported)."""
        if len(sys.modules) == self._modules_seen:
            return []
        self._modules_seen = len(sys.modules)
        return [n for n in list(sys.modules)
                if n not in self._loaded and self._local(n) is not None]

    def _records(self, modules, all_sources=False):
        out = {}
        for name in _depth_first(modules):
            module = modules[name]
            record = self._source(module)
            if record is None:
                continue
            file, package, digest, source = record
            if all_sources or self._known.get(name) != digest:
                out[SOURCE_PREFIX + name] = (file, package, digest, source)
            self._known[name] = digest
            self._loaded[name] = _version(module)
            out[STATE_PREFIX + name] = _state(module)
        return out

    def _source(self, module):
        version = _version(module)
        record = self._sources.get(version)
        if record is None:
            file = _module_file(module)
            try:
                with open(file, "rb") as f:
                    source = f.read().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                return None
            package = hasattr(module, "__path__")
            record = (file, package, hashlib.sha256(source.encode()).hexdigest(), source)
            self._sources[version] = record
        return record

    # -- a standby --

    def apply(self, pseudo_name, value):
        if pseudo_name.startswith(STATE_PREFIX):
            name = pseudo_name[len(STATE_PREFIX):]
            module = sys.modules.get(name)
            if module is None:
                raise ImportError(f"module {name!r} is not loaded here")
            vars(module).update(value)
            return
        name = pseudo_name[len(SOURCE_PREFIX):]
        file, package, digest, source = value
        module = sys.modules.get(name)
        if module is not None and self._known.get(name) == digest:
            return
        self._run_source(name, file, package, source, module)
        self._known[name] = digest
        self._sources[_version(sys.modules[name])] = (file, package, digest, source)
        self._loaded[name] = _version(sys.modules[name])

    @staticmethod
    def _run_source(name, file, package, source, module):
        # What the module prints as it runs was printed on the executor, in the cell that ran it.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            LocalModules._exec_source(name, file, package, source, module)

    @staticmethod
    def _exec_source(name, file, package, source, module):
        code = compile(source, file, "exec", dont_inherit=True)
        if module is None:
            locations = [os.path.dirname(file)] if package else None
            spec = importlib.util.spec_from_file_location(
                name, file, submodule_search_locations=locations)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent and parent in sys.modules:
                setattr(sys.modules[parent], child, module)
            try:
                exec(code, vars(module))
            except BaseException:
                del sys.modules[name]
                raise
            return
        exec(code, vars(module))
