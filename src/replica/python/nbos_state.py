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
                                      # cell bound, changed and deleted no name and changed no
                                      # process state
        # problems: list of Unreplicable(name, reason) 2-tuples with .type_name and .message(),
        #   e.g. "nbos: cannot replicate 'f' (TextIOWrapper): open file objects cannot be
        #   replicated". A problem is reported once per (name, object); the delta still carries
        #   every other name, and standbys bind the name to a NotReplicated placeholder. A
        #   process-state entry that cannot be pickled is reported once per value (its name is
        #   "nbos:process:<entry>": "nbos: cannot replicate the numpy.random state: ...") and
        #   left out: standbys keep theirs.
    sync.apply(delta)               # on a standby: fetches the blobs it lacks, then applies;
                                    # returns [Unreplicable] for names whose value could not be
                                    # rebuilt on this replica (normally []), bound to
                                    # placeholders, and for process-state entries that could not
                                    # be rebuilt or applied (left as they were here)
    sync.blob_keys(delta)           # blob keys a delta/snapshot refers to (for prefetching)
    data = sync.snapshot()          # full state: every non-hidden name + object tokens
    sync.restore(data)              # rebuild the namespace (and object table) from scratch;
                                    # returns like apply()
    describe(data)                  # the parsed header of a delta/snapshot (names, keys, ...)

Process state
-------------
A cell also changes state that lives in libraries, not in the namespace: RNG streams
(`random.seed(7)`, `np.random.seed`, `torch.manual_seed`), numpy print options, pandas options,
matplotlib rcParams, logger levels, warnings filters, the recursion limit, torch's flags. The
entries of nbos_state_process that changed since this replica last sent or applied them travel
in the cell's delta, after the names, as the pseudo-names "nbos:process:<entry>", pickled with
the names (so a warnings filter's notebook-defined category is the namespace's class on the
standby); snapshots carry every entry of an imported library (one that cannot be pickled is
left out). Standbys apply them through the registry and never bind them; an entry that cannot be
rebuilt or applied is reported like a name and recorded in `unrebuilt`, and the rest of the
delta still applies.

`store` is any object with put(bytes|memoryview) -> str key (idempotent, content-addressed),
get(key) -> a buffer (bytes, or a fresh writable buffer per call that arrays and tensors rebuilt
from it may keep as their memory) and contains(key) -> bool. `hidden` is IPython's
`user_ns_hidden` (anything supporting `in`); names matching IPython's own conventions (_, __,
___, _i, _ii, _iN, _N, _oh, _ih, _dh, In, Out, exit, quit, get_ipython, dunder names) are always
skipped.

The work is split by job, each module with its contract at its top:
    nbos_state_scan      which names a cell binds, deletes and reads (its AST)
    nbos_state_codec     arrays and tensors as bytes, their fingerprints
    nbos_state_pickle    fingerprints and delta pickling: picklers, unpickler, object table,
                         NotReplicated placeholders
    nbos_state_wire      the byte format of deltas and snapshots
    nbos_state_process   process state beyond the namespace (RNG streams, library settings)
    nbos_state_modules   notebook-local modules (their source travels with the state)
    nbos_state           this module: StateSync, which ties them together
Every replica must load them under these names: pickles refer to helpers and to NotReplicated by
module name.

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
"""


import functools
import hashlib
import io
import itertools
import operator
import re
import types

import nbos_state_codec as codec
import nbos_state_modules as modules
import nbos_state_pickle as pk
import nbos_state_process as process
import nbos_state_scan as scan
import nbos_state_wire as wire
from nbos_state_pickle import (  # noqa: F401  (public API; helpers named by older pickles)
    DeltaApplyError, NotReplicated, NotReplicatedError, StoreFallback, Unreplicable,
    _ClassRef, _identity, _import_module, _make_function, _make_lru_cache, _set_function_state)
from nbos_state_wire import FORMAT_VERSION, DeltaFormatError, describe  # noqa: F401

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


_IMMUTABLE = ("imm",)  # the fingerprint of an immutable value


def _pseudo_names(entries):
    return {process.PREFIX + name: value for name, value in entries.items()}


# ------------------------------------------------------------------------------------------


class _Cell:
    __slots__ = ("ids", "fps", "names", "modules")

    def __init__(self, ids, fps, names, modules):
        self.ids, self.fps, self.names, self.modules = ids, fps, names, modules


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
        self._table = pk.Table()
        self._digests = None      # id(array) -> (array, digest) while end() runs
        self._reported = {}       # name -> id of the value last reported as unreplicable
        # Names the log bound that this replica could not rebuild (bound to placeholders here
        # though the executor has their values), and process-state entries it could not rebuild
        # or apply: name -> why. Empty on the executor.
        self.unrebuilt = {}
        self._tracked = None
        self.process = process.ProcessState()
        self._output = None  # see take_output()
        self.modules = modules.LocalModules()

    # -- helpers --

    def _hidden(self, name):
        return is_hidden_name(name, self.hidden)

    def _tracked_types(self):
        if self._tracked is None or not self._tracked:
            torch = codec.torch_module()
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
            raise pk.DeltaApplyError(f"blob {key} is missing from the blob store")
        return data

    def _digest(self, a):
        cache = self._digests
        if cache is not None:
            hit = cache.get(id(a))
            if hit is not None and hit[0] is a:
                return hit[1]
        d = codec.array_digest(a)
        if cache is not None:
            cache[id(a)] = (a, d)  # holds the array so that its id is not reused meanwhile
        return d

    def _fingerprint(self, value):
        t = type(value)
        if t in (int, float, complex, bool, type(None), str, bytes, range):
            return _IMMUTABLE  # only a rebinding changes it (caught by id)
        try:
            np = codec.numpy_module()
            if np is not None and t is np.ndarray and not value.dtype.hasobject:
                return ("a", self._digest(value))
            torch = codec.torch_module()
            if torch is not None and isinstance(value, torch.Tensor) and \
                    codec.is_plain_tensor(torch, value):
                return ("t", codec.tensor_fp(value))
            if t is types.ModuleType:
                return ("m", value.__name__)
            h = hashlib.sha256()
            pk.FingerprintPickler(self, h, value).dump(value)
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
            return scan.code_global_names(value.__code__) if value.__globals__ is ns else frozenset()
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
                        names |= scan.code_global_names(f.__code__)
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
        if isinstance(v, (types.FunctionType, pk.LRU_WRAPPER)):
            return 2, name
        return 3, name

    def _visible(self):
        """The names a delta covers, in the namespace's order. IPython adds the names it binds
        with every cell (_iN, _N) to the hidden set and never drops them: those are skipped at
        C speed, where a call per name had cost 2.4 ms per cell after 10,000 cells
        (bench/state_sync_bench.py)."""
        names = list(itertools.filterfalse(self.hidden.__contains__, self.ns))
        try:  # the names' classification by convention, also at C speed, once it is cached
            return list(itertools.compress(names, map(operator.not_, map(
                _HIDDEN_BY_CONVENTION.__getitem__, names))))
        except KeyError:  # a name not classified yet (or not cached: not a str, cache full)
            hidden = self._hidden
            return [n for n in names if not hidden(n)]

    def _ids(self):
        names = self._visible()
        return dict(zip(names, map(id, map(self.ns.__getitem__, names))))

    # -- serialization --

    def _dump(self, values, anchors, quiet, dry):
        """One pickle stream per name, all from one pickler (one memo: shared objects stay
        shared). Returns (payload, blobs, oob, offsets, oob_index)."""
        out = pk.NullWriter() if dry else io.BytesIO()
        if not dry:
            self._fallback.inline_bytes = 0  # counts this payload's
        p = pk.DeltaPickler(self, out, anchors, quiet, set(values), dry)
        offsets, oob_index = [], []
        for value in values.values():
            offsets.append(0 if dry else out.tell())
            oob_index.append(len(p.oob))
            p.dump(value)
        return (None if dry else out.getvalue()), p.blobs, p.oob, offsets, oob_index

    def _serialize(self, values, anchors, quiet):
        """((payload, blobs, oob, offsets, oob_index), bad), bad = {name: (type, reason)}."""
        empty = pk.EMPTY_DUMP
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
        if isinstance(exc, pk.OverFallbackLimit):
            return str(exc)
        if isinstance(exc, pk.Unpicklable):
            if exc.type_name == type(value).__name__:
                return exc.reason
            return f"it refers to a {exc.type_name} object: {exc.reason}"
        reason = pk.unpicklable_reason(type(value))
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
            "bad": [[n, t, r] for n, (t, r) in sorted(bad.items()) if not wire.is_pseudo_name(n)],
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
        return wire.pack(kind, header, payload)

    def _put_payload(self, payload):
        """The payload's blob key; None when the store failed and it fits the fallback's limit
        (it then goes inline); OverFallbackLimit when it does not."""
        self._fallback.inline_bytes = 0  # the payload holds whatever was inlined into it
        return self._fallback.put(self.store, payload)

    def _stored_payload(self, header, payload):
        key = header.get("payload")
        if key is None:
            return payload
        if len(payload):
            raise wire.DeltaFormatError("corrupt nbos state: a stored payload and an inline one")
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
            buffers.append(data if k not in seen and codec.writable(data) else bytearray(data))
            seen.add(k)
        names = header.get("set", [])
        if len(header.get("offsets", ())) != len(names) or \
                len(header.get("oob_index", ())) != len(names):
            raise wire.DeltaFormatError("corrupt nbos state header (offsets)")
        return fetched, buffers

    def _load_install(self, header, payload, fetched, buffers):
        """Loads the payload name by name, binding each name as soon as it is loaded (code run
        by later unpickling may look it up) and applying each process-state entry. A name whose
        pickle cannot be loaded here becomes a placeholder, and so do its objects where other
        names refer to them; an entry that cannot be loaded or applied is left as it is here.
        Returns [Unreplicable] for such names and entries."""
        ns = self.ns
        names, offsets = header["set"], header["offsets"]
        rebinds, problems = {}, []
        for name in itertools.chain(names, (b[0] for b in header.get("bad", ()))):
            self.unrebuilt.pop(name, None)
        f, base = io.BytesIO(payload), 0
        u = pk.DeltaUnpickler(self, f, iter(buffers), fetched, rebinds)
        for i, name in enumerate(names):
            f.seek(base + offsets[i])
            loaded = True
            try:
                value = u.load()
            except Exception as exc:
                loaded = False
                value = self._unloadable(header, i, exc, problems)
                if i + 1 < len(names):
                    f, base, u = self._resume(header, payload, i, value, u.memo, buffers,
                                              fetched, rebinds)
            ns.update(rebinds)
            rebinds.clear()
            if not wire.is_pseudo_name(name):
                ns[name] = value
            elif loaded:
                self._apply_pseudo(name, value, problems)
        ns.update(self._placeholders(header))
        return problems

    def _unloadable(self, header, i, exc, problems):
        """The placeholder of the i-th name of the payload, which failed to load with exc."""
        name = header["set"][i]
        types_ = header.get("types", [])
        reason = f"it could not be rebuilt on this replica ({type(exc).__name__}: {exc})"
        type_name = types_[i] if i < len(types_) else "object"
        problems.append(pk.Unreplicable(name, reason, type_name))
        self.unrebuilt[name] = f"{type(exc).__name__}: {exc}"[:300]
        return pk.NotReplicated(name, type_name, reason, header.get("origin"))

    def _resume(self, header, payload, i, placeholder, memo, buffers, fetched, rebinds):
        """(file, base, unpickler) that go on with the name after the i-th, whose pickle failed
        to load: a new unpickler, since the old one may hold unread input. Every memo entry the
        failed pickle creates must exist, since the unpickler numbers entries by counting them.
        Objects of the failed pickle that may be incomplete become the placeholder, so names
        sharing them refer to it."""
        offsets = header["offsets"]
        memo = memo.copy()
        end = offsets[i + 1]
        first = pk.count_memoize(payload[:offsets[i]])
        total = first + pk.count_memoize(payload[offsets[i]:end])
        for index in range(first, total):
            if index not in memo or not pk.complete(memo[index]):
                memo[index] = placeholder
        prefix = pk.memo_restorer(total)
        f = io.BytesIO(prefix + bytes(payload))
        u = pk.DeltaUnpickler(self, f, iter(buffers[header["oob_index"][i + 1]:]), fetched,
                              rebinds)
        u.restore_memo = memo
        u.load()  # runs the restorer: memo entries 0..total-1
        u.restore_memo = None
        return f, len(prefix), u

    def take_output(self):
        """The output of the cell whose delta apply() last applied, once; None when none."""
        output, self._output = self._output, None
        return output

    def _apply_pseudo(self, name, value, problems):
        """Applies a process-state entry or a local module's source or data, or keeps the cell's
        output for take_output() (nbos_state_wire)."""
        try:
            if name == wire.OUTPUT_NAME:
                self._output = value
            elif modules.is_pseudo_name(name):
                self.modules.apply(name, value)
            else:
                self.process.apply(name[len(process.PREFIX):], value)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            problems.append(pk.Unreplicable(
                name, f"it could not be applied on this replica ({why})", type(value).__name__))
            self.unrebuilt[name] = why[:300]

    def _placeholders(self, header):
        origin = header.get("origin")
        return {n: pk.NotReplicated(n, t, r, origin) for n, t, r in header.get("bad", ())}

    # -- public API --

    def begin(self, code):
        """Call before the cell runs, with its transformed source. Returns a token for end()."""
        if isinstance(code, bytes):
            code = code.decode("utf-8", "replace")
        names = scan.scan(code) or scan.UNKNOWN_NAMES
        ids = self._ids()
        reads = self._expand_reads(names.reads)
        fps = {n: self._fingerprint(self.ns[n]) for n in reads}
        touched = self.modules.begin([self.ns[n] for n in reads], self._fingerprint)
        return _Cell(ids, fps, names, touched)

    def end(self, cell, output=None):
        """Call after the cell ran, with the value its display hook showed (None: none).
        Returns (delta bytes, [Unreplicable(name, reason), ...])."""
        after, changed, deleted = self._rebound(cell)
        fallback = pk.StoreFallback(self.fallback_limit_bytes)
        self._digests, self._fallback = {}, fallback
        try:
            quiet = set()
            for n, fp in cell.fps.items():
                if n in after and n not in changed:
                    if self._fingerprint(self.ns[n]) == fp:
                        quiet.add(n)
                    else:
                        changed.add(n)
            changed |= self._mutated_aliases(cell, after, changed)
            values = self._cell_values(cell, changed, output)
            anchors = self._anchors(cell, after) if values else {}
            dumped, bad = self._serialize(values, anchors, quiet)
            for n in bad:
                del values[n]
            delta = b""
            if values or deleted or not all(map(wire.is_pseudo_name, bad)):
                try:
                    delta = self._pack(wire.KIND_DELTA, values, deleted, dumped, bad)
                except pk.OverFallbackLimit as e:
                    bad.update((n, (type(v).__name__, str(e))) for n, v in values.items())
                    values = {}
                    delta = self._pack(wire.KIND_DELTA, values, deleted, pk.EMPTY_DUMP, bad)
        finally:
            self._digests = self._fallback = None
        self.store_fallback = fallback if fallback.inline_bytes and values else None
        if self._reported:
            for n in itertools.chain(values, deleted):
                self._reported.pop(n, None)
        return delta, self._problems(bad) if bad else []

    def _mutated_aliases(self, cell, after, changed):
        """Names still bound to an object the cell read under a name it then rebound or deleted
        (`b = a; a.append(1); a = 0`), whose content changed: no read of their own shows it."""
        left = {cell.ids[n]: fp for n, fp in cell.fps.items()
                if fp != _IMMUTABLE and after.get(n) != cell.ids[n]}
        if not left:
            return set()
        ns = self.ns
        return {n for n, i in after.items()
                if i in left and n not in changed and self._fingerprint(ns[n]) != left[i]}

    def _cell_values(self, cell, changed, output):
        """What the delta carries, in the order a standby must load it: the sources of local
        modules (names refer to their classes and functions), the names, the cell's output,
        then the modules' data and the process state (nbos_state_wire). A cell that names
        nothing (`pass`, a literal, a comment) called no code and imported nothing: modules and
        process state are not looked at."""
        names = cell.names
        ran_code = bool(names.reads or names.bound or names.deleted)
        local = self.modules.end(cell.modules, self._fingerprint) if ran_code else {}
        values = {n: v for n, v in local.items() if n.startswith(modules.SOURCE_PREFIX)}
        values.update((n, self.ns[n]) for n in sorted(changed, key=self._order_key))
        if output is not None:
            values[wire.OUTPUT_NAME] = output
        values.update((n, v) for n, v in local.items() if n.startswith(modules.STATE_PREFIX))
        if ran_code:
            values.update(_pseudo_names(self.process.changed()))
        return values

    def _problems(self, bad):
        """[Unreplicable] of end(): a name's once per object bound to it, an entry's once per
        value (the executor sends an entry again only when it changed)."""
        problems = []
        for n, (type_name, reason) in bad.items():
            if n == wire.OUTPUT_NAME:
                continue  # only Out[N] is missing elsewhere: the value is bound to no name
            if wire.is_pseudo_name(n):
                problems.append(pk.Unreplicable(n, reason, type_name))
            elif self._reported.get(n) != id(self.ns[n]):
                self._reported[n] = id(self.ns[n])
                problems.append(pk.Unreplicable(n, reason, type_name))
        return problems

    def _rebound(self, cell):
        """(name -> id of every visible name now, names whose binding the cell changed or that
        it binds, names it deleted). Compared at C speed: most cells rebind nothing."""
        before, after = cell.ids, self._ids()
        if after == before:
            changed, deleted = set(), ()
        else:
            changed = {n for n, _ in after.items() - before.items()}
            deleted = before.keys() - after.keys()
        for n in cell.names.bound:
            if n in after and n not in cell.fps:
                changed.add(n)
        return after, changed, deleted

    def _anchors(self, cell, after):
        """id -> name of the objects still bound where they were before the cell (the first
        such name): only needed when the delta carries something."""
        before, ns, anchors = cell.ids, self.ns, {}
        for n, i in after.items():
            if before.get(n) == i and type(ns[n]) not in pk.NO_ANCHOR:
                anchors.setdefault(i, n)
        return anchors

    def apply(self, delta):
        """Apply a delta produced by another replica's end() to this namespace.

        Returns [Unreplicable(name, reason)] for names whose value could not be rebuilt here
        (normally empty); those names are bound to NotReplicated placeholders. Process-state
        entries that could not be rebuilt or applied are returned too, and left as they are
        here. b"" (a cell that changed no name and no process state) changes nothing."""
        if not len(delta):
            return []
        header, payload = wire.unpack(delta)
        if header["kind"] != "delta":
            raise wire.DeltaFormatError("apply() got a snapshot; use restore()")
        payload = self._stored_payload(header, payload)
        fetched, buffers = self._prefetch(header)
        for n in header.get("del", ()):
            self.ns.pop(n, None)
            self.unrebuilt.pop(n, None)
        return self._load_install(header, payload, fetched, buffers)

    def blob_keys(self, data):
        """Distinct blob keys a delta or snapshot refers to, in first-use order."""
        header, _ = wire.unpack(data)
        keys = [header.get("payload")] + [k for _, k in header.get("blobs", ())] + \
            list(header.get("oob", ()))
        return list(dict.fromkeys(k for k in keys if k is not None))

    def snapshot(self):
        """The whole user namespace (without hidden names), its object tokens and every
        process-state entry of an imported library, as bytes."""
        local = self.modules.everything()
        values = {n: v for n, v in local.items() if n.startswith(modules.SOURCE_PREFIX)}
        values.update((n, self.ns[n]) for n in sorted(self._visible(), key=self._order_key))
        values.update((n, v) for n, v in local.items() if n.startswith(modules.STATE_PREFIX))
        values.update(_pseudo_names(self.process.everything()))
        fallback = pk.StoreFallback(self.fallback_limit_bytes)
        self._digests, self._fallback = {}, fallback
        try:
            dumped, bad = self._serialize(values, {}, set())
            if fallback.exceeded:  # a snapshot that leaves names out must not replace the state
                raise pk.OverFallbackLimit(next(iter(bad.values()))[1])
            for n in bad:
                del values[n]
            data = self._pack(wire.KIND_SNAPSHOT, values, (), dumped, bad)
        finally:
            self._digests = self._fallback = None
        self.store_fallback = fallback if fallback.inline_bytes and values else None
        return data

    def reset(self):
        """Back to the state before any delta: no visible names, an empty object table (what
        restore() of an empty namespace's snapshot would give). Process state stays as it is."""
        self._table = pk.Table()
        for n in self._visible():
            del self.ns[n]
        self._reported.clear()
        self.unrebuilt.clear()

    def restore(self, data):
        """Rebuild the namespace and the object table from a snapshot(), and apply its process
        state. Returns what apply() returns."""
        header, payload = wire.unpack(data)
        if header["kind"] != "snapshot":
            raise wire.DeltaFormatError("restore() got a delta; use apply()")
        old_table, self._table = self._table, pk.Table()
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
        self.unrebuilt.clear()
        return self._load_install(header, payload, fetched, buffers)
