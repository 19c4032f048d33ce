"""Tests of nbos_state: an executor and standbys simulated as separate namespaces.

Run: cd src/replica/python && /usr/bin/python3 -m pytest -q nbos_state_test.py
"""

import builtins
import hashlib
import multiprocessing
import os
import pickle
import sys
import traceback
import types
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nbos_state  # noqa: E402
from nbos_state import StateSync, describe  # noqa: E402

HIDDEN = frozenset({"__name__", "__builtins__"})


# ------------------------------------------------------------------------------------------
# Blob stores with the C++ store's interface: put(bytes|memoryview) -> hex sha256 key, get (a
# fresh writable buffer per call), contains. They count calls so that tests can assert
# deduplication.


class MemStore:
    def __init__(self):
        self.blobs = {}
        self.puts = self.gets = 0
        self.put_bytes = 0

    def put(self, data):
        b = bytes(data)
        key = hashlib.sha256(b).hexdigest()
        self.puts += 1
        self.put_bytes += len(b)
        self.blobs[key] = b
        return key

    def get(self, key):
        self.gets += 1
        return bytearray(self.blobs[key])

    def contains(self, key):
        return key in self.blobs


class DirStore:
    """Directory-backed store, shared between processes."""

    def __init__(self, path):
        self.path = path
        self.puts = self.gets = 0

    def put(self, data):
        b = bytes(data)
        key = hashlib.sha256(b).hexdigest()
        self.puts += 1
        dest = os.path.join(self.path, key)
        if not os.path.exists(dest):
            tmp = f"{dest}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(b)
            os.replace(tmp, dest)
        return key

    def get(self, key):
        self.gets += 1
        path = os.path.join(self.path, key)
        data = bytearray(os.path.getsize(path))
        with open(path, "rb") as f:
            f.readinto(data)
        return data

    def contains(self, key):
        return os.path.exists(os.path.join(self.path, key))


# ------------------------------------------------------------------------------------------
# Per-value digests, deterministic across processes


def digest(value):
    h = hashlib.sha256()
    _feed(h, value, set())
    return h.hexdigest()


def _w(h, *parts):
    for p in parts:
        h.update(p if isinstance(p, bytes) else repr(p).encode())
        h.update(b"\0")


def _feed(h, v, seen):
    t = type(v)
    np = sys.modules.get("numpy")
    pd = sys.modules.get("pandas")
    torch = sys.modules.get("torch")
    if isinstance(v, nbos_state.NotReplicated):
        _w(h, "placeholder", object.__getattribute__(v, "_nbos_name"))
        return
    if v is None or t in (int, float, bool, str, bytes, complex, range, slice):
        _w(h, t.__name__, v)
        return
    if isinstance(v, (types.ModuleType,)):
        _w(h, "module", v.__name__)
        return
    if id(v) in seen:
        _w(h, "cycle")
        return
    seen = seen | {id(v)}
    if torch is not None and isinstance(v, torch.Tensor):
        # Non-leaf tensors are replicated detached (documented), so compare requires_grad of
        # leaves only.
        _w(h, "tensor", type(v).__name__, str(v.dtype), tuple(v.shape), str(v.layout),
           v.requires_grad and v.is_leaf)
        data = v.detach().cpu()
        if data.layout is not torch.strided:
            data = data.to_dense()
        h.update(data.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        if v.is_leaf and v.grad is not None:
            _w(h, "grad")
            _feed(h, v.grad, seen)
        return
    if torch is not None and isinstance(v, torch.nn.Module):
        _w(h, "nn", t.__qualname__, [m.training for m in v.modules()])
        for k, x in v.state_dict().items():
            _w(h, k)
            _feed(h, x, seen)
        return
    if torch is not None and isinstance(v, torch.optim.Optimizer):
        _w(h, "optim", t.__qualname__)
        _feed(h, v.state_dict(), seen)
        return
    if np is not None and isinstance(v, np.ndarray):
        _w(h, "ndarray", v.dtype.str, v.shape)
        if v.dtype.hasobject:
            for x in v.reshape(-1):
                _feed(h, x, seen)
        else:
            h.update(np.ascontiguousarray(v).tobytes())
        return
    if np is not None and isinstance(v, np.generic):
        _w(h, "npscalar", v.dtype.str, v.tobytes())
        return
    if pd is not None and isinstance(v, (pd.DataFrame, pd.Series)):
        cols = list(v.columns) if isinstance(v, pd.DataFrame) else [v.name]
        dtypes = list(map(str, v.dtypes)) if isinstance(v, pd.DataFrame) else [str(v.dtype)]
        _w(h, "pandas", t.__name__, cols, dtypes, list(v.index))
        h.update(pd.util.hash_pandas_object(v, index=True).values.tobytes())
        return
    if t is types.FunctionType:
        c = v.__code__
        _w(h, "fn", v.__qualname__, c.co_code, c.co_names, c.co_varnames)
        _feed(h, v.__defaults__, seen)
        for cell in v.__closure__ or ():
            try:
                _feed(h, cell.cell_contents, seen)
            except ValueError:
                _w(h, "empty")
        return
    if t is types.MethodType:
        _w(h, "method")
        _feed(h, v.__func__, seen)
        return
    if isinstance(v, type):
        # __slotnames__ is copyreg's cache, added to a class when its instances are pickled.
        _w(h, "class", v.__qualname__, sorted(k for k in vars(v) if k != "__slotnames__"))
        for k, x in sorted(vars(v).items()):
            if not k.startswith("__") and isinstance(x, (int, float, str, list, dict)):
                _w(h, k)
                _feed(h, x, seen)
        return
    if isinstance(v, (list, tuple)):
        _w(h, t.__name__, len(v))
        for x in v:
            _feed(h, x, seen)
        return
    if isinstance(v, dict):
        _w(h, t.__name__, len(v))
        for k, x in v.items():
            _feed(h, k, seen)
            _feed(h, x, seen)
        return
    if isinstance(v, (set, frozenset)):
        _w(h, t.__name__, sorted(digest(x) for x in v))
        return
    if isinstance(v, bytearray):
        _w(h, "bytearray", bytes(v))
        return
    if hasattr(v, "__dict__"):
        _w(h, "obj", t.__qualname__)
        _feed(h, dict(vars(v)), seen)
        return
    try:
        _w(h, "pickle", t.__qualname__, pickle.dumps(v, 4))
    except Exception:
        _w(h, "repr", t.__qualname__, repr(v))


def ns_digests(ns, exclude=()):
    return {n: digest(v) for n, v in ns.items()
            if not nbos_state.is_hidden_name(n, HIDDEN) and n not in exclude}


def new_ns():
    return {"__name__": "__main__", "__builtins__": builtins}


# ------------------------------------------------------------------------------------------
# An executor and standbys in this process


class Cluster:
    def __init__(self, standbys=1, threshold=64 * 1024, store=None):
        self.store = store or MemStore()
        self.threshold = threshold
        self.ns = new_ns()
        self.sync = StateSync(self.ns, HIDDEN, self.store, oob_threshold=threshold, replica_id=1)
        self.standbys = []
        for i in range(standbys):
            ns = new_ns()
            self.standbys.append((ns, StateSync(ns, HIDDEN, self.store, threshold,
                                                replica_id=i + 2)))
        self.count = 0
        self.deltas = []

    @property
    def sb(self):
        return self.standbys[0][0]

    def run(self, code, expect_error=None):
        """Runs a cell on the executor, replicates its delta, returns (delta, problems)."""
        self.count += 1
        cell = self.sync.begin(code)
        try:
            exec(compile(code, f"<cell-{self.count}>", "exec"), self.ns)
        except Exception as e:
            if expect_error is None or not isinstance(e, expect_error):
                raise
        delta, problems = self.sync.end(cell)
        self.deltas.append(delta)
        for _, sync in self.standbys:
            sync.apply(delta)
        return delta, problems

    def assert_in_sync(self, exclude=()):
        want = ns_digests(self.ns, exclude)
        for ns, _ in self.standbys:
            got = ns_digests(ns, exclude)
            assert sorted(got) == sorted(want)
            diff = [n for n in want if want[n] != got[n]]
            assert not diff, f"names differ on a standby: {diff}"


def names_set(delta):
    return sorted(describe(delta)["set"])


# ------------------------------------------------------------------------------------------
# Plain values, bindings, mutation


def test_plain_values_and_every_binding_form():
    c = Cluster()
    c.run("i = 1; s = 'hello'; f = 2.5; n = None; t = (1, 'a', [2]); st = {1, 2}\n"
          "fs = frozenset({3}); by = b'xy'; ba = bytearray(b'ab'); cx = 1 + 2j\n"
          "lst = [1, [2, 3], {'k': 'v'}]; d = {'a': 1, 'b': [1, 2]}")
    c.assert_in_sync()
    c.run("i += 1; s += ' world'; lst += [4]")
    c.run("a, *rest = [1, 2, 3, 4]\n(p, q), r = (5, 6), 7\ntotal: int = 0\nonly_annotated: int\n"
          "for k in range(4):\n    total += k\n"
          "if (w := 10) > 5:\n    big_w = w * 2\n")
    c.run("import os.path as osp, json\nfrom collections import OrderedDict as OD, defaultdict\n"
          "import xml.etree.ElementTree\n"
          "od = OD(a=1); dd = defaultdict(list); dd['x'].append(1)")
    c.run("import contextlib\nwith contextlib.nullcontext(42) as cm_val:\n    pass\n"
          "try:\n    1 / 0\nexcept ZeroDivisionError as err:\n    caught = str(err)\n"
          "match {'kind': 'pt', 'x': 1, 'y': 2}:\n"
          "    case {'kind': 'pt', 'x': mx, **others}:\n        pass\n")
    c.run("def setg():\n    global from_global\n    from_global = 'set'\nsetg()")
    c.run("sq = [v * v for v in range(5)]\nwal = [y2 for qq in range(3) if (y2 := qq * 2)]")
    c.run("partial = 1\nraise ValueError('cell fails after binding')", expect_error=ValueError)
    c.assert_in_sync()
    sb = c.sb
    assert sb["i"] == 2 and sb["s"] == "hello world" and sb["lst"][-1] == 4
    assert (sb["a"], sb["rest"], sb["p"], sb["q"], sb["r"]) == (1, [2, 3, 4], 5, 6, 7)
    assert sb["total"] == 6 and sb["big_w"] == 20 and sb["w"] == 10
    assert "only_annotated" not in sb
    assert sb["xml"].etree.ElementTree.fromstring("<a/>").tag == "a"
    assert sb["osp"].join("a", "b") == "a/b" and sb["json"].dumps(1) == "1"
    assert sb["dd"]["x"] == [1] and type(sb["dd"]).__name__ == "defaultdict"
    assert sb["dd"]["new"] == []  # default_factory survived
    assert sb["cm_val"] == 42 and "err" not in sb and sb["caught"] == "division by zero"
    assert sb["mx"] == 1 and sb["others"] == {"y": 2}
    assert sb["from_global"] == "set"
    assert "v" not in sb and sb["y2"] == 4 and sb["wal"] == [2, 4]
    assert sb["partial"] == 1


def test_hidden_names_are_not_replicated():
    c = Cluster()
    c.ns["get_ipython"] = lambda: None
    c.run("_ = 5; __ = 6; _i3 = 'x'; _7 = 1; _ii = 'y'; In = []; Out = {}; _oh = {}\n"
          "__x = 2; _private = 3; __version__ = '1'")
    assert sorted(k for k in c.sb if k not in HIDDEN) == ["__x", "_private"]


def test_mutation_through_methods_and_subscripts():
    c = Cluster()
    c.run("lst = [1]; d = {}; s = set()\nclass Box:\n    pass\nbox = Box(); box.items = []")
    d, _ = c.run("lst.append(2)")
    assert names_set(d) == ["lst"]
    for code in ["d.update(x=1)", "s.add(3)", "box.items.append('z')", "box.value = 7",
                 "d['nested'] = {'q': [1]}", "d['nested']['q'].append(2)", "lst.sort(reverse=True)",
                 "lst[0] = 10"]:
        d, _ = c.run(code)
        assert names_set(d), code
        c.assert_in_sync()
    assert c.sb["d"] == {"x": 1, "nested": {"q": [1, 2]}} and c.sb["lst"] == [10, 1]
    assert c.sb["box"].items == ["z"] and c.sb["box"].value == 7


def test_untouched_names_are_not_fingerprinted():
    """Cost grows with what the cell touches, not with the size of the namespace."""
    c = Cluster()
    for i in range(0, 2000, 500):
        c.run("\n".join(f"v{j} = list(range(50))" for j in range(i, i + 500)))
    calls = []
    orig = StateSync._fingerprint

    def counting(self, value):
        calls.append(value)
        return orig(self, value)

    StateSync._fingerprint = counting
    try:
        d, _ = c.run("v7.append(1)\nz = len(v8)")
    finally:
        StateSync._fingerprint = orig
    assert len(calls) == 4  # v7 and v8, before and after
    assert names_set(d) == ["v7", "z"]
    assert c.sb["v7"][-1] == 1


def test_deletions_replicate():
    c = Cluster()
    c.run("x = 1; y = 2; z = 3; w = 4; keep = 5")
    c.run("del x")
    c.run("del globals()['y']")
    c.run("exec('del z')")
    d, _ = c.run("for name in ['w']:\n    globals().pop(name)\nexec('q = 7')")
    assert describe(d)["del"] == ["w"]
    c.assert_in_sync()
    assert sorted(k for k in c.sb if k not in HIDDEN) == ["keep", "name", "q"]


def test_syntax_error_gives_empty_delta():
    c = Cluster()
    c.run("x = 1")
    cell = c.sync.begin("x = (")
    delta, problems = c.sync.end(cell)
    assert (delta, problems) == (b"", [])
    assert c.standbys[0][1].apply(delta) == []
    c.assert_in_sync()


def test_a_cell_that_changes_no_name_gives_an_empty_delta():
    c = Cluster()
    c.run("x = [1]\ny = 2")
    for code in ("pass", "x[0]", "print(y)", "z = y; del z"):
        delta, problems = c.run(code)
        assert (delta, problems) == (b"", []), code
    delta, _ = c.run("x.append(3)")  # a change in place is still one
    assert describe(delta)["set"] == ["x"]
    c.assert_in_sync()


def test_format_version_is_checked():
    c = Cluster()
    delta, _ = c.run("x = 1")
    bad = bytearray(delta)
    bad[4] = 99
    with pytest.raises(nbos_state.DeltaFormatError, match="version 99"):
        c.standbys[0][1].apply(bytes(bad))
    with pytest.raises(nbos_state.DeltaFormatError, match="magic"):
        c.standbys[0][1].apply(b"garbage-garbage")
    with pytest.raises(nbos_state.DeltaFormatError, match="restore"):
        c.standbys[0][1].apply(c.sync.snapshot())
    with pytest.raises(nbos_state.DeltaFormatError, match="apply"):
        c.standbys[0][1].restore(delta)


# ------------------------------------------------------------------------------------------
# Functions, classes, aliasing


def test_functions_lambdas_classes_defined_in_the_notebook():
    c = Cluster()
    c.run("""
base = 10
def add(x, y=1):
    return x + y + base
sq = lambda v: v * v
def make_counter():
    n = 0
    def inc():
        nonlocal n
        n += 1
        return n
    return inc
counter = make_counter()
def fact(k):
    return 1 if k <= 1 else k * fact(k - 1)
class Point:
    dims = 2
    def __init__(self, x, y):
        self.x, self.y = x, y
    def norm2(self):
        return sq(self.x) + sq(self.y)
    @property
    def first(self):
        return self.x
    @staticmethod
    def origin():
        return Point(0, 0)
class Point3(Point):
    dims = 3
    def __init__(self, x, y, z):
        super().__init__(x, y)
        self.z = z
    def norm2(self):
        return super().norm2() + sq(self.z)
p = Point3(1, 2, 3)
""")
    c.run("counter(); counter()")
    c.run("base = 100")
    c.assert_in_sync()
    sb, ex = c.sb, c.ns
    assert sb["add"](1) == 102 and sb["sq"](4) == 16 and sb["fact"](5) == 120
    assert sb["add"].__globals__ is sb and sb["Point"].norm2.__globals__ is sb
    assert sb["Point"] is not ex["Point"]  # the standby has its own class objects
    assert type(sb["p"]) is sb["Point3"] and isinstance(sb["p"], sb["Point"])
    assert sb["p"].norm2() == 14 and sb["p"].first == 1 and sb["Point"].origin().x == 0
    assert sb["counter"]() == 3 and ex["counter"]() == 3

    c.run("def bump():\n    global base\n    base += 1")
    c.run("bump()")
    assert sb["base"] == 101
    c.run("hist = []\ndef record(v):\n    hist.append(v)\nclass Rec:\n"
          "    def add(self, v):\n        record(v * 10)\nrec = Rec()")
    d, _ = c.run("record(5)")
    assert names_set(d) == ["hist"]  # found through record's bytecode
    d, _ = c.run("rec.add(1)")
    assert names_set(d) == ["hist"]  # method -> record -> hist
    assert sb["hist"] == [5, 10]
    sb["rec"].add(2)  # runs against the standby's own namespace
    assert sb["hist"] == [5, 10, 20] and ex["hist"] == [5, 10]
    sb["hist"].pop()

    c.run("Point.dims = 5")
    assert sb["Point"].dims == 5 and sb["p"].dims == 3 and type(sb["p"]) is sb["Point3"]
    c.run("class Point3(Point3):\n    pass\np2 = Point3(0, 0, 1)")
    assert type(sb["p2"]) is sb["Point3"] and sb["p2"].norm2() == 1
    c.assert_in_sync()


def test_aliases_and_shared_objects_keep_identity():
    c = Cluster()
    c.run("a = [1, 2]; cfg = {'lr': 0.1}\nclass Trainer:\n    def __init__(self, cfg):\n"
          "        self.cfg = cfg\n        self.log = []\nt = Trainer(cfg)")
    d, _ = c.run("b = a")
    assert names_set(d) == ["b"]
    assert c.sb["b"] is c.sb["a"]
    c.run("a.append(3)")
    assert c.sb["b"] is c.sb["a"] and c.sb["b"] == [1, 2, 3]
    c.run("b.append(4)")
    assert c.sb["a"] == [1, 2, 3, 4]
    c.run("cfg['lr'] = 0.5")
    assert c.sb["t"].cfg is c.sb["cfg"] and c.sb["t"].cfg["lr"] == 0.5
    trainer = c.sb["t"]
    c.run("t.log.append('epoch 1')\nt.extra = cfg")
    assert c.sb["t"] is trainer and trainer.extra is c.sb["cfg"]
    c.run("holder = {'inner': a, 'again': a}")
    assert c.sb["holder"]["inner"] is c.sb["a"] is c.sb["holder"]["again"]
    c.run("old = a; a = [0]")
    assert c.sb["old"] is c.sb["b"] and c.sb["a"] == [0] and c.sb["a"] is not c.sb["b"]
    c.run("cyc = [1]; cyc.append(cyc)")
    c.run("cyc.append(2)")
    assert c.sb["cyc"][1] is c.sb["cyc"] and c.sb["cyc"][2] == 2
    c.assert_in_sync()


def test_lru_cache_functions_are_rebuilt():
    c = Cluster()
    c.run("import functools\n@functools.lru_cache(maxsize=None)\ndef fib(n):\n"
          "    return n if n < 2 else fib(n - 1) + fib(n - 2)\nx = fib(30)")
    fib = c.sb["fib"]
    assert fib(31) == 1346269 and fib.__wrapped__.__globals__ is c.sb
    assert fib.cache_info().currsize > 0  # its own cache, filled by the call above


def test_a_value_that_cannot_be_rebuilt_fails_alone():
    c = Cluster()
    c.run("class Fragile:\n    def __init__(self):\n        self.v = 1\n"
          "    def __setstate__(self, state):\n"
          "        if globals().get('REPLICA') == 'standby':\n"
          "            raise RuntimeError('cannot rebuild here')\n"
          "        self.__dict__.update(state)")
    c.sb["REPLICA"] = "standby"
    cell = c.sync.begin("a_ok = [1]; fr = Fragile(); holder = {'fr': fr, 'a': a_ok}; z_ok = 2")
    exec("a_ok = [1]; fr = Fragile(); holder = {'fr': fr, 'a': a_ok}; z_ok = 2", c.ns)
    delta, problems = c.sync.end(cell)
    assert problems == []
    failed = c.standbys[0][1].apply(delta)
    assert [p.name for p in failed] == ["fr"]
    assert "cannot rebuild here" in failed[0].reason and failed[0].type_name == "Fragile"
    assert c.sb["a_ok"] == [1] and c.sb["z_ok"] == 2 and c.sb["holder"]["a"] is c.sb["a_ok"]
    assert c.sb["holder"]["fr"] is c.sb["fr"]  # the placeholder, where the object was shared
    with pytest.raises(nbos_state.NotReplicatedError, match="could not be rebuilt"):
        c.sb["holder"]["fr"].v
    # Later deltas still apply (the memo indices stayed aligned).
    c.run("a_ok.append(2)\nnew = [holder['a'], 3]")
    assert c.sb["a_ok"] == [1, 2] and c.sb["new"][0] is c.sb["a_ok"]


# ------------------------------------------------------------------------------------------
# numpy / pandas


def test_numpy_arrays_small_large_and_dedup():
    pytest.importorskip("numpy")
    c = Cluster()
    c.run("import numpy as np\nsmall = np.arange(10)\nrng = np.random.default_rng(0)\n"
          "big = rng.random(100_000)\nmat = np.asfortranarray(rng.random((300, 200)))\n"
          "rec = np.zeros(3, dtype=[('a', 'i4'), ('b', 'f8')])\nobjarr = np.array([1, 'x', None])")
    store = c.store
    assert store.puts == 2  # big and mat, not the small ones
    c.assert_in_sync()
    big = c.sb["big"]
    assert big.flags.writeable
    d, _ = c.run("d = {'arr': big, 'other': mat}")
    assert store.puts == 2  # already stored, content unchanged
    assert c.sb["d"]["arr"] is big and c.sb["d"]["other"] is c.sb["mat"]
    assert describe(d)["blobs"] == [] or all(k in store.blobs for _, k in describe(d)["blobs"])
    d, _ = c.run("d['x'] = 1")
    assert store.puts == 2  # d re-sent, its arrays are not re-stored
    assert c.sb["d"]["arr"] is big
    gets = store.gets
    c.run("big[0] = -1.0\nsmall += 1\nmat[1, 1] = 7")
    assert store.puts == 4 and store.gets == gets + 2
    assert c.sb["big"] is big and big[0] == -1.0 and c.sb["mat"][1, 1] == 7
    assert c.sb["mat"].flags.f_contiguous
    c.run("view = big[:10]\nbig.shape = (1000, 100)")  # views are copied; shape change in place
    assert c.sb["big"] is big and big.shape == (1000, 100)
    c.run("rec['a'][1] = 5\nobjarr[0] = [1, 2]")
    c.assert_in_sync()
    keys = c.sync.blob_keys(c.deltas[0])
    assert len(keys) == 2 and all(store.contains(k) for k in keys)
    # Big bytes/bytearrays, subclass arrays (their state holds the data as bytes) and pickle-5
    # out-of-band buffers use the store too.
    d, _ = c.run("import pickle\nraw = b'x' * 100_000\nbuf = bytearray(100_000)\n"
                 "masked = np.ma.masked_array(np.ones(20_000))\n"
                 "class Blob:\n    def __init__(self, data):\n        self.data = data\n"
                 "    def __reduce_ex__(self, protocol):\n"
                 "        return (rebuild_blob, (pickle.PickleBuffer(self.data),))\n"
                 "def rebuild_blob(buf):\n    return Blob(bytearray(buf))\n"
                 "blob = Blob(bytearray(b'z' * 70_000))")
    h = describe(d)
    assert len(h["oob"]) == 1 and len(h["blobs"]) == 3 and len(d) < 40_000  # mask: 20 KB
    assert len(c.sync.blob_keys(d)) == 4
    assert c.sb["blob"].data == bytearray(b"z" * 70_000) and c.sb["raw"] == b"x" * 100_000
    buf = c.sb["buf"]
    c.run("buf[0] = 1")
    assert c.sb["buf"] is buf and buf[0] == 1
    c.assert_in_sync()


class ReadOnlyStore(MemStore):
    """A store whose get returns immutable bytes: standbys must copy what they keep."""

    def get(self, key):
        self.gets += 1
        return self.blobs[key]


@pytest.mark.parametrize("store_type", [MemStore, ReadOnlyStore])
def test_equal_contents_in_one_delta_never_share_memory(store_type):
    # A standby keeps a fetched buffer as the storage of the first array, tensor or pickle-5
    # buffer built from it; every other object with the same content (same blob key) gets a copy.
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    c = Cluster(threshold=1024, store=store_type())
    c.run("import numpy as np, torch, pickle\n"
          "a1 = np.ones(10_000)\na2 = np.ones(10_000)\n"
          "t1 = torch.ones(10_000)\nt2 = torch.ones(10_000)\n"
          "class Blob:\n    def __init__(self, data):\n        self.data = data\n"
          "    def __reduce_ex__(self, protocol):\n"
          "        return (rebuild_blob, (pickle.PickleBuffer(self.data),))\n"
          "def rebuild_blob(buf):\n    return Blob(np.frombuffer(buf, dtype=np.uint8))\n"
          "b1 = Blob(np.full(70_000, ord('z'), np.uint8))\n"
          "b2 = Blob(np.full(70_000, ord('z'), np.uint8))")
    c.assert_in_sync()
    sb = c.sb
    assert len(describe(c.deltas[-1])["oob"]) == 2
    for x, y in (("a1", "a2"), ("t1", "t2")):
        assert not np.shares_memory(np.asarray(sb[x]), np.asarray(sb[y])), (x, y)
    assert not np.shares_memory(sb["b1"].data, sb["b2"].data)
    assert sb["a1"].flags.writeable and sb["b1"].data.flags.writeable
    # Writing one leaves the others, and the store's copy, as they were.
    sb["a1"][0] = 5.0
    sb["t1"][0] = 5.0
    sb["b1"].data[0] = 0
    assert sb["a2"][0] == 1.0 and float(sb["t2"][0]) == 1.0 and sb["b2"].data[0] == ord("z")
    c.run("a1[1] = 2.0\nt2[1] = 3.0")
    assert sb["a1"][1] == 2.0 and float(sb["t2"][1]) == 3.0 and float(sb["t1"][1]) == 1.0
    assert bytes(c.store.blobs[c.store.put(np.ones(10_000).tobytes())]) == \
        np.ones(10_000).tobytes()


def test_reading_a_huge_name_does_not_reserialize_it():
    pytest.importorskip("numpy")
    c = Cluster()
    c.run("import numpy as np\nhuge = np.ones(4 * 1024 * 1024)")  # 32 MiB
    puts, put_bytes = c.store.puts, c.store.put_bytes
    d, _ = c.run("m = float(huge.mean())\nshape = huge.shape\nalias = huge")
    assert names_set(d) == ["alias", "m", "shape"]
    assert c.store.puts == puts and c.store.put_bytes == put_bytes and len(d) < 2000
    assert c.sb["alias"] is c.sb["huge"]
    d, _ = c.run("huge[-1] = 2.0")
    assert names_set(d) == ["huge"] and c.store.puts == puts + 1
    assert c.sb["huge"][-1] == 2.0


def test_pandas_dataframes():
    pytest.importorskip("pandas")
    c = Cluster(threshold=4096)
    c.run("import pandas as pd\nimport numpy as np\n"
          "df = pd.DataFrame({'a': range(5), 'b': list('abcde')})\n"
          "big = pd.DataFrame({'x': np.arange(20_000.0), 'y': np.arange(20_000)})")
    c.run("df['c'] = df['a'] * 2")
    c.run("df.loc[0, 'a'] = 100")
    c.run("sub = df[df.a > 1]\ncol = df['b']\nser = pd.Series([1.5, 2.5], index=['p', 'q'])")
    c.assert_in_sync()
    df = c.sb["df"]
    c.run("df.drop(columns=['c'], inplace=True)")
    assert c.sb["df"] is df and list(df.columns) == ["a", "b"]
    puts = c.store.puts
    d, _ = c.run("n = len(big)\nm = big['x'].sum()")
    assert names_set(d) == ["m", "n"] and c.store.puts == puts
    c.run("big['z'] = big['x'] + 1")
    c.assert_in_sync()
    assert c.sb["big"]["z"].iloc[-1] == 20_000.0


# ------------------------------------------------------------------------------------------
# torch: identity across cells


TORCH_CELLS = [
    "import torch\ntorch.manual_seed(0)\n"
    "model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), "
    "torch.nn.Linear(64, 1))\nX = torch.randn(128, 16)\nY = torch.randn(128, 1)",
    "opt = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
    "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)",
    "def train_step():\n    opt.zero_grad()\n    loss = ((model(X) - Y) ** 2).mean()\n"
    "    loss.backward()\n    opt.step()\n    return loss.item()\nlosses = [train_step()]",
    "for _ in range(3):\n    losses.append(train_step())\nsched.step()",
]
CONTINUE = "losses.append(train_step())\nsched.step()"


@pytest.mark.parametrize("threshold", [64 * 1024, 512])
def test_torch_model_and_optimizer_identity(threshold):
    torch = pytest.importorskip("torch")
    c = Cluster(threshold=threshold)
    for code in TORCH_CELLS:
        c.run(code)
    c.assert_in_sync()
    sb, ex = c.sb, c.ns
    params = list(sb["model"].parameters())
    group = sb["opt"].param_groups[0]["params"]
    assert all(a is b for a, b in zip(params, group)) and len(group) == 4
    assert all(any(p is k for p in params) for k in sb["opt"].state)
    assert sb["sched"].optimizer is sb["opt"]
    if threshold == 512:
        assert c.store.puts > 0
    # Backward in one cell, step in the next: the gradients must travel too.
    c.run("opt.zero_grad()\nloss = ((model(X) - Y) ** 2).mean()\nloss.backward()")
    assert torch.equal(sb["model"][0].weight.grad, ex["model"][0].weight.grad)
    assert sb["loss"].grad_fn is None and not sb["loss"].requires_grad
    c.run("opt.step()")
    c.assert_in_sync()
    # A forward pass that changes nothing stores nothing.
    puts = c.store.puts
    d, _ = c.run("with torch.no_grad():\n    score = float(((model(X) - Y) ** 2).mean())")
    assert names_set(d) == ["score"] and c.store.puts == puts
    # Writes through .data do not bump _version; the fingerprint still sees them.
    c.run("with torch.no_grad():\n    pass\nmodel[2].bias.data.fill_(0.25)")
    assert float(sb["model"][2].bias[0]) == 0.25
    # Failover: the standby continues training exactly like the executor would.
    exec(CONTINUE, ex)
    exec(CONTINUE, sb)
    for a, b in zip(ex["model"].parameters(), sb["model"].parameters()):
        assert torch.equal(a, b)
    assert ex["losses"] == sb["losses"] and ex["opt"].param_groups[0]["lr"] == \
        sb["opt"].param_groups[0]["lr"]
    c.assert_in_sync()


def test_torch_misc_tensors():
    torch = pytest.importorskip("torch")
    c = Cluster(threshold=1024)
    c.run("import torch\nt = torch.arange(1000, dtype=torch.float32).reshape(10, 100)\n"
          "v = t[0]\nb16 = torch.ones(600, dtype=torch.bfloat16)\n"
          "flags = torch.tensor([True, False])\nempty = torch.empty(0, 3)\n"
          "w = torch.nn.Parameter(torch.zeros(3))\nlin = torch.nn.Linear(3, 3)\n"
          "lin.weight = w2 = torch.nn.Parameter(torch.ones(3, 3))\n"
          "sparse = torch.eye(3).to_sparse()")
    c.assert_in_sync()
    sb = c.sb
    assert isinstance(sb["w"], torch.nn.Parameter) and sb["lin"].weight is sb["w2"]
    c.run("t.add_(1)")
    assert torch.equal(sb["t"], c.ns["t"])
    assert float(sb["v"][0]) == 0.0  # views are independent copies on standbys (documented)
    c.run("t.data = t.data.double()")  # dtype change keeps the tensor object
    assert sb["t"].dtype == torch.float64
    c.run("lin.half()")
    assert sb["lin"].weight is sb["w2"] and sb["w2"].dtype == torch.float16
    c.assert_in_sync(exclude=("v",))


# ------------------------------------------------------------------------------------------
# Values that cannot be replicated


def test_unpicklable_values_are_reported_and_become_placeholders(tmp_path):
    c = Cluster()
    path = str(tmp_path / "out.txt")
    d, problems = c.run(f"import threading\nf = open({path!r}, 'w')\ngen = (i for i in range(3))\n"
                        "lock = threading.Lock()\nholder = [threading.Lock()]\nok = 42\n"
                        "sock = __import__('socket').socket()")
    c.ns["sock"].close()
    reasons = dict(problems)
    assert sorted(reasons) == ["f", "gen", "holder", "lock", "sock"]
    assert reasons["f"] == "open file objects cannot be replicated"
    assert reasons["gen"] == "generators cannot be replicated"
    assert reasons["lock"] == "locks cannot be replicated"
    assert "lock" in reasons["holder"] and "sockets" in reasons["sock"]
    msg = [p for p in problems if p.name == "f"][0].message()
    assert msg == ("nbos: cannot replicate 'f' (TextIOWrapper): "
                   "open file objects cannot be replicated")
    assert names_set(d) == ["ok", "threading"]
    sb = c.sb
    assert sb["ok"] == 42
    assert "not replicated" in repr(sb["f"])
    with pytest.raises(nbos_state.NotReplicatedError) as e:
        sb["f"].write("x")
    assert str(e.value) == ("'f' was created on replica 1 and cannot be used here: "
                            "open file objects cannot be replicated")
    for use in (lambda: next(sb["gen"]), lambda: list(sb["gen"]), lambda: sb["lock"].acquire(),
                lambda: sb["holder"][0], lambda: sb["f"](), lambda: bool(sb["lock"])):
        with pytest.raises(nbos_state.NotReplicatedError):
            use()

    def with_lock():
        with sb["lock"]:
            pass

    with pytest.raises(nbos_state.NotReplicatedError):
        with_lock()
    # Touching them again is not reported again; aliases get the same placeholder.
    d, problems = c.run("f.write('x')\ng2 = f\nnext(gen)\nok += 1")
    assert problems == [] and sb["g2"] is sb["f"] and sb["ok"] == 43
    d, problems = c.run(f"f.close()\nf = open({path!r})")
    assert [p.name for p in problems] == ["f"]
    c.ns["f"].close()
    # A standby that became the executor can snapshot its placeholders.
    snap = c.standbys[0][1].snapshot()
    ns = new_ns()
    StateSync(ns, HIDDEN, c.store).restore(snap)
    assert isinstance(ns["gen"], nbos_state.NotReplicated) and ns["ok"] == 43


# ------------------------------------------------------------------------------------------
# Snapshots


def test_snapshot_restore_equals_incremental_and_keeps_tokens():
    torch = pytest.importorskip("torch")
    pytest.importorskip("pandas")
    c = Cluster(threshold=1024)
    for code in TORCH_CELLS:
        c.run(code)
    c.run("import numpy as np, pandas as pd\narr = np.arange(5000.0)\nalias = arr\n"
          "df = pd.DataFrame({'a': arr[:100]})\nclass K:\n    def __init__(self):\n"
          "        self.items = [arr]\nk = K()\nf = open(__import__('os').devnull)\n"
          "lst = [1, 2]; lst2 = lst")
    snap = c.sync.snapshot()
    c.ns["f"].close()
    assert [b[0] for b in describe(snap)["bad"]] == ["f"]
    ns = new_ns()
    ns["junk"] = "removed by restore"
    restored = StateSync(ns, HIDDEN, c.store, oob_threshold=1024)
    restored.restore(snap)
    assert "junk" not in ns
    assert ns_digests(ns) == ns_digests(c.sb)
    assert ns_digests(ns, exclude=("f",)) == ns_digests(c.ns, exclude=("f",))
    assert ns["alias"] is ns["arr"] and ns["k"].items[0] is ns["arr"] and ns["lst2"] is ns["lst"]
    assert ns["opt"].param_groups[0]["params"][0] is ns["model"][0].weight
    # Deltas made after the snapshot apply to the restored replica: the tokens survived.
    c.standbys.append((ns, restored))
    c.run("losses.append(train_step())\narr[0] = -1\nlst.append(3)")
    assert ns["arr"][0] == -1 and ns["alias"] is ns["arr"] and ns["lst2"] == [1, 2, 3]
    exec(CONTINUE, c.ns)
    exec(CONTINUE, ns)
    for a, b in zip(c.ns["model"].parameters(), ns["model"].parameters()):
        assert torch.equal(a, b)


def test_reset_then_the_deltas_again_gives_the_replicated_state():
    """A replica whose namespace got ahead of the log (a cell that could not commit) resets and
    replays the deltas: names the log never had are gone, identities are rebuilt."""
    c = Cluster()
    c.run("a = [1, 2]\nb = a\nn = 1")
    c.run("n += 1\na.append(n)")
    ahead = StateSync(c.ns, HIDDEN, c.store, oob_threshold=c.threshold, replica_id=1)
    exec("import os\nn = 99\na.append(99)\nextra = {'x': 1}", c.ns)
    ahead.reset()
    assert [n for n in c.ns if not n.startswith("__")] == []
    for delta in c.deltas:
        ahead.apply(delta)
    assert "extra" not in c.ns and "os" not in c.ns
    assert c.ns["n"] == 2 and c.ns["a"] == [1, 2, 2] and c.ns["b"] is c.ns["a"]
    c.assert_in_sync()


# ------------------------------------------------------------------------------------------
# Code run through magics / exec strings, and a real IPython shell


def test_code_in_magic_and_exec_strings_is_scanned():
    c = Cluster()
    sync_ns = c.ns

    class FakeShell:
        def run_line_magic(self, name, line):
            exec(line, sync_ns)

        def run_cell_magic(self, name, line, cell):
            exec(cell, sync_ns)

    shell = FakeShell()
    c.ns["get_ipython"] = lambda: shell
    c.run("lst = []; d = {}")
    d, _ = c.run("get_ipython().run_line_magic('time', 'lst.append(1)')")
    assert names_set(d) == ["lst"]
    d, _ = c.run("get_ipython().run_cell_magic('time', '', 'd[1] = 2\\nnew = 3\\n')")
    assert names_set(d) == ["d", "new"]
    d, _ = c.run("exec('lst.append(2)')")
    assert names_set(d) == ["lst"]
    c.assert_in_sync()


def test_with_a_real_ipython_shell(tmp_path, monkeypatch):
    pytest.importorskip("IPython")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))
    # The shell installs its own __main__ module; put the real one back afterwards.
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell.instance(config=cfg)
    try:
        store = MemStore()
        ex = StateSync(shell.user_ns, shell.user_ns_hidden, store)
        sb_ns = new_ns()
        sb = StateSync(sb_ns, HIDDEN, store)

        def run(raw):
            cell = ex.begin(shell.transform_cell(raw))
            shell.run_cell(raw, store_history=True)
            delta, problems = ex.end(cell)
            sb.apply(delta)
            return delta

        run("a = [1]\nb = 2")
        run("a")  # sets _, _1, Out, _i2 ...: none of it is replicated
        assert sorted(k for k in sb_ns if k not in HIDDEN) == ["a", "b"]
        d = run("%time a.append(2)")
        assert names_set(d) == ["a"] and sb_ns["a"] == [1, 2]
        run("%%time\nc = a + [3]\n")
        assert sb_ns["c"] == [1, 2, 3]
        run("def f():\n    return a\ng = f")
        assert sb_ns["g"]() is sb_ns["a"]
        d = run("%reset -f")
        assert sorted(describe(d)["del"]) == ["a", "b", "c", "f", "g"]
        assert sorted(k for k in sb_ns if k not in HIDDEN) == []
    finally:
        InteractiveShell.clear_instance()


# ------------------------------------------------------------------------------------------
# A standby in a separate process (spawn): nothing may rely on shared memory


def _standby_main(conn, store_dir, threshold):
    ns = new_ns()
    sync = StateSync(ns, HIDDEN, DirStore(store_dir), oob_threshold=threshold, replica_id=2)
    while True:
        op, arg = conn.recv()
        try:
            if op == "quit":
                conn.send(("ok", None))
                return
            if op == "apply":
                sync.apply(arg)
                result = None
            elif op == "exec":
                exec(compile(arg, "<standby>", "exec"), ns)
                result = None
            elif op == "eval":
                result = eval(arg, ns)
            elif op == "digests":
                result = ns_digests(ns, arg)
            elif op == "cell":  # run a cell as the executor (after a failover)
                cell = sync.begin(arg)
                exec(compile(arg, "<standby-cell>", "exec"), ns)
                result = sync.end(cell)[0]
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def test_standby_in_a_separate_process(tmp_path):
    pytest.importorskip("torch")
    threshold = 1024
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_standby_main, args=(child, str(tmp_path), threshold), daemon=True)
    proc.start()

    def call(op, arg=None):
        parent.send((op, arg))
        if not parent.poll(60):
            raise TimeoutError(op)
        status, result = parent.recv()
        assert status == "ok", result
        return result

    try:
        store = DirStore(str(tmp_path))
        ns = new_ns()
        sync = StateSync(ns, HIDDEN, store, oob_threshold=threshold, replica_id=1)
        cells = TORCH_CELLS + [
            "import numpy as np\narr = np.arange(10_000.0)\nd = {'arr': arr, 'n': 1}\n"
            "class Acc:\n    def __init__(self):\n        self.total = 0\n"
            "    def add(self, v):\n        self.total += v\n        log.append(v)\n"
            "log = []\nacc = Acc()\nlam = lambda x: x * arr[1]",
            "acc.add(5)\narr *= 2\nd['n'] += 1",
            "fh = open(__import__('os').devnull)",
        ]
        for code in cells:
            cell = sync.begin(code)
            exec(compile(code, "<cell>", "exec"), ns)
            delta, _ = sync.end(cell)
            call("apply", delta)
        ns["fh"].close()
        assert call("digests", ["fh"]) == ns_digests(ns, ["fh"])
        assert call("eval", "opt.param_groups[0]['params'][0] is model[0].weight") is True
        assert call("eval", "d['arr'] is arr and bool(lam(3) == 6.0)") is True
        assert call("eval", "repr(fh)").startswith("<nbos: 'fh'")
        # Failover: the standby process continues training and must match the executor.
        exec(CONTINUE, ns)
        call("exec", CONTINUE)
        assert call("digests", ["fh"]) == ns_digests(ns, ["fh"])
        # ... and now it executes cells and this process is its standby.
        delta = call("cell", "acc.add(7)\nlosses.append(train_step())\narr[0] = 99.0")
        sync.apply(delta)
        assert ns["log"] == [5, 7] and ns["arr"][0] == 99.0 and ns["d"]["arr"] is ns["arr"]
        assert ns["opt"].param_groups[0]["params"][0] is ns["model"][0].weight
        assert call("digests", ["fh"]) == ns_digests(ns, ["fh"])
        call("quit")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


class FailingStore(MemStore):
    """A MemStore whose puts fail while `down` is set (a store that went away)."""

    down = False

    def put(self, data):
        if self.down:
            self.puts += 1
            raise RuntimeError("UNAVAILABLE: cannot reach the store")
        return super().put(data)


def test_data_the_store_does_not_take_goes_in_the_delta():
    # With the store down, arrays, tensors, big bytes and out-of-band buffers of the cell go
    # inline: the standby rebuilds all of them without the store, and names that never needed it
    # replicate too. One failed put per cell; the next cell tries the store again.
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    store = FailingStore()
    c = Cluster(threshold=1024, store=store)
    c.run("import numpy as np, torch, pickle\na = np.arange(10_000.0)\nn = 1")
    store.down = True
    puts, gets = store.puts, store.gets
    d, problems = c.run("a += 1\nt = torch.ones(5_000)\nbig = b'x' * 5_000\nn = 2\n"
                        "pb = pickle.PickleBuffer(bytearray(b'y' * 5_000))")
    assert problems == [] and names_set(d) == ["a", "big", "n", "pb", "t"]
    assert describe(d)["blobs"] == [] and describe(d)["oob"] == []
    assert store.puts == puts + 1 and store.gets == gets
    fallback = c.sync.store_fallback
    assert fallback.inline_bytes == 80_000 + 20_000 + 5_000 + 5_000
    assert "UNAVAILABLE: cannot reach the store" in fallback.message()
    assert "; 107 KB of this cell's data went through the replication log" in fallback.message()
    c.assert_in_sync(exclude=("pb",))
    assert bytes(c.sb["pb"]) == b"y" * 5_000  # an in-band PickleBuffer loads as its bytes
    # Back up: the same array content goes to the store again (the inline copy left no key).
    store.down = False
    d, _ = c.run("a += 0\nm = 3")
    assert [k for _, k in describe(d)["blobs"]] != [None] and c.sync.store_fallback is None
    assert c.sb["a"] is not None and float(c.sb["a"][0]) == 1.0
    c.assert_in_sync(exclude=("pb",))


def test_past_its_limit_the_fallback_reports_the_names():
    # Over the limit, every name the cell changed is reported and becomes a placeholder on the
    # standby (as the delta says), and no snapshot is taken: it would stand for the whole state.
    pytest.importorskip("numpy")
    store = FailingStore()
    store.down = True
    c = Cluster(threshold=1024, store=store)
    c.sync.fallback_limit_bytes = 50_000
    d, problems = c.run("import numpy as np\nsmall = np.zeros(1_000)\nhuge = np.zeros(10_000)")
    assert sorted(p.name for p in problems) == ["huge", "np", "small"]
    assert "over the 49 KB the replication log takes" in problems[0].reason
    assert c.sync.store_fallback is None
    assert type(c.sb["huge"]).__name__ == "NotReplicated"
    with pytest.raises(RuntimeError, match="over the 49 KB"):
        c.sync.snapshot()
    # A payload over the limit (no single buffer is) is left out the same way.
    c.sync.payload_threshold = 10_000
    d, problems = c.run("words = ['w%d' % i for i in range(20_000)]\nn = 5")
    assert sorted(p.name for p in problems) == ["n", "words"]
    assert describe(d)["payload_bytes"] == 0 and "payload" not in describe(d)
    assert type(c.sb["n"]).__name__ == "NotReplicated"


def test_a_large_payload_goes_to_the_store():
    # The pickles of values without buffers (long lists, dicts) go to the store once they are
    # over payload_threshold; the delta carries the key, and blob_keys names it for prefetching.
    store = FailingStore()
    c = Cluster(store=store)
    c.sync.payload_threshold = 10_000
    d, _ = c.run("words = ['w%d' % i for i in range(20_000)]\nn = 1")
    header = describe(d)
    assert header["payload_bytes"] == 0 and len(d) < 2_000
    assert c.sync.blob_keys(d) == [header["payload"]] and header["payload"] in store.blobs
    c.assert_in_sync()
    snap = c.sync.snapshot()
    assert describe(snap)["payload_bytes"] == 0
    ns = new_ns()
    StateSync(ns, HIDDEN, store).restore(snap)
    assert ns["words"] == c.ns["words"] and ns["n"] == 1
    # With the store down it goes inline, within the fallback's limit.
    store.down = True
    d, problems = c.run("words.append('x')")
    assert problems == [] and describe(d)["payload_bytes"] > 10_000 and "payload" not in describe(d)
    assert "went through the replication log" in c.sync.store_fallback.message()
    c.assert_in_sync()
    # A standby that cannot fetch a stored payload fails before it changes anything.
    store.down = False
    d, _ = c.run("words.append('y')")
    del store.blobs[describe(d)["payload"]]
    ns = new_ns()
    with pytest.raises(KeyError):
        StateSync(ns, HIDDEN, store).apply(d)
    assert "words" not in ns


def test_a_closed_file_replicates_as_a_closed_file(tmp_path):
    """`with open(...) as f:` leaves f bound to a closed file: nothing to report, and on a standby
    it behaves as the closed file did."""
    c = Cluster()
    path = str(tmp_path / "data.txt")
    d, problems = c.run(f"with open({path!r}, 'w') as f:\n    f.write('x')\nn = 1")
    assert problems == [] and names_set(d) == ["f", "n"]
    sb = c.sb["f"]
    assert (sb.closed, sb.name, sb.mode) == (True, path, "w")
    assert repr(sb) == repr(c.ns["f"])
    for use in (lambda: sb.write("y"), lambda: sb.read(), lambda: next(iter(sb))):
        with pytest.raises(ValueError, match="closed file"):
            use()


def test_an_alias_of_a_name_the_cell_mutated_then_rebound():
    """`b = a`, then a cell mutates the object through `a` and rebinds `a`: only `b` still holds
    the object, and the cell never read `b`."""
    c = Cluster()
    c.run("a = [1]\nb = a\nd = {'k': 1}\ne = d")
    d, _ = c.run("a.append(2)\na = 0\ndel d['k']\ndel d")
    assert names_set(d) == ["a", "b", "e"]
    assert c.sb["b"] == [1, 2] and c.sb["e"] == {} and "d" not in c.sb
    c.assert_in_sync()


def test_the_cells_output_travels_with_it_for_the_output_history():
    """Out[N] and _ on a standby are the executor's output, the same object as its name."""
    c = Cluster()
    c.run("x = [1, 2]")
    cell = c.sync.begin("x")
    delta, problems = c.sync.end(cell, output=c.ns["x"])
    assert problems == [] and names_set(delta) == ["nbos:output"]
    sync = c.standbys[0][1]
    sync.apply(delta)
    assert sync.take_output() is c.sb["x"] and sync.take_output() is None
    assert "nbos:output" not in c.sb


def test_writing_into_a_broadcast_view_on_a_standby_prints_no_warning():
    # numpy warns on reading the flags of, and on writing to, a view from np.broadcast_arrays. A
    # replica holds one that it made as executor when the next executor changes it.
    pytest.importorskip("numpy")
    store = MemStore()
    first, second = new_ns(), new_ns()
    syncs = {id(first): StateSync(first, HIDDEN, store, replica_id=1),
             id(second): StateSync(second, HIDDEN, store, replica_id=2)}

    def run(ns, other, code):
        cell = syncs[id(ns)].begin(code)
        exec(code, ns)
        delta, _ = syncs[id(ns)].end(cell)
        return syncs[id(other)].apply(delta)

    run(first, second,
        "import numpy as np\nv = np.broadcast_arrays(np.zeros(3), np.zeros((2, 3)))[0]")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(second, first, "v += 1") == []
    assert [str(w.message) for w in caught] == []
    assert first["v"].tolist() == [[1.0] * 3] * 2
