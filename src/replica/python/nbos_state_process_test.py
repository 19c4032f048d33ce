"""Tests of process state replication (nbos_state_process through StateSync).

The executor and the standby are processes of their own (nbos_state_testing.ReplicaProcess), one
pair for the module: each test sets state on the executor, applies the cell's delta on the
standby, and checks that both then draw, print, log and warn alike. State a test leaves behind
was replicated too, so the pair stays alike for the next test.

Run: cd src/replica/python && /usr/bin/python3 -m pytest -q nbos_state_process_test.py
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nbos_state_process as process  # noqa: E402
from nbos_state import describe  # noqa: E402
from nbos_state_testing import ReplicaPair, replica_processes  # noqa: E402

P = process.PREFIX


replicas = pytest.fixture(scope="module", name="replicas")(replica_processes)


@pytest.fixture
def pair(replicas):
    """The replicas with fresh namespaces and StateSyncs (process state as the last test left
    it); run(code) runs a cell on the executor and applies its delta on the standby."""
    executor, standby = replicas
    executor.call("new")
    standby.call("new")
    return ReplicaPair(executor, standby)


def process_names(delta):
    return [n for n in describe(delta)["set"] if n.startswith(P)]


# ------------------------------------------------------------------------------------------
# One test per entry


def test_random_state(pair):
    pair.run("import random")
    before = pair.sb.call("eval", "random.getstate()")
    delta, problems, applied = pair.run("random.seed(7)\nfirst = random.gauss(0, 1)")
    assert problems == applied == [] and P + "random" in process_names(delta)
    assert pair.sb.call("eval", "random.getstate()") != before
    # gauss() caches its second value: the standby must hand out the same one next.
    draws = pair.both("[random.gauss(0, 1), random.random(), random.randrange(10**9)]")
    assert len(set(draws)) == 3


def test_numpy_random_state(pair):
    delta, _, applied = pair.run("import numpy as np\nnp.random.seed(7)\nx = np.random.randn(3)")
    assert applied == [] and P + "numpy.random" in process_names(delta)
    pair.both("np.random.get_state()[3:]")  # has_gauss, gauss: an odd number of normals
    # This draw only uses the cached normal: the generator's words do not change.
    delta, _, _ = pair.run("y = np.random.randn()")
    assert process_names(delta) == [P + "numpy.random"]
    pair.both("np.random.randn(2).tolist() + np.random.randint(0, 10**9, 2).tolist()")


def test_torch_cpu_generator(pair):
    pytest.importorskip("torch")
    delta, _, applied = pair.run("import torch\ntorch.manual_seed(1234)\nt = torch.rand(2)")
    assert applied == [] and P + "torch.random" in process_names(delta)
    assert pair.both("torch.initial_seed()") == 1234
    pair.both("torch.rand(3).tolist() + torch.randn(3).tolist()")


def test_torch_cuda_generator_waits_for_a_gpu_bind(pair):
    pytest.importorskip("torch")
    setup = "import torch, nbos_state_testing as testing\n"
    try:
        pair.ex.call("exec", setup + "fake = testing.install_fake_cuda(initialized=True)")
        pair.sb.call("exec", setup + "fake = testing.install_fake_cuda(initialized=False)")
        delta, problems, applied = pair.run(
            "torch.cuda.set_rng_state(torch.arange(16, dtype=torch.uint8))")
        assert problems == applied == [] and P + "torch.cuda.random" in process_names(delta)
        # Applying neither initialised CUDA nor touched a device (the fake raises if it did).
        assert pair.sb.call("eval", "(fake.initialized, fake.sets)") == (False, [])
        pair.sb.call("exec", "engine = testing.import_engine()\nengine.GPUS.bind([3], {})")
        assert pair.sb.call("eval", "(fake.device, fake.sets)") == (3, [bytes(range(16))])
        pair.both("torch.cuda.get_rng_state().tolist()")
        # Bound again to the same device, which has the state already: nothing to put there.
        pair.sb.call("exec", "engine.GPUS.release({})\nengine.GPUS.bind([3], {})")
        assert pair.sb.call("eval", "len(fake.sets)") == 1
        # The executor's next cell on another device draws from the same state too.
        pair.ex.call("exec", "engine = testing.import_engine()\nengine.GPUS.bind([5], {})")
        assert pair.ex.call("eval", "(fake.device, fake.sets[-1])") == (5, bytes(range(16)))
    finally:
        for replica in (pair.ex, pair.sb):
            replica.call("exec", "testing.remove_fake_cuda()")


def test_numpy_print_options(pair):
    shown = "repr(np.array([1.23456789, -2.5e-9, 3.0, 4.0, 5.0]))"
    pair.run("import numpy as np")
    default = pair.sb.call("eval", shown)
    delta, _, applied = pair.run(
        "np.set_printoptions(precision=2, suppress=True, threshold=3, edgeitems=1, sign='+')")
    assert applied == [] and process_names(delta) == [P + "numpy.printoptions"]
    assert pair.both(shown) != default
    pair.run("np.set_printoptions(legacy='1.13')")
    assert pair.both("np.get_printoptions()['legacy']") == "1.13"
    pair.both(shown)
    pair.run("np.set_printoptions(legacy=False, precision=8, suppress=False, threshold=1000, "
             "edgeitems=3, sign='-')")
    assert pair.both(shown) == default


def test_pandas_options(pair):
    pytest.importorskip("pandas")
    shown = "repr(pd.DataFrame({'a': np.arange(30) / 7}))"
    pair.run("import numpy as np\nimport pandas as pd")
    default = pair.sb.call("eval", shown)
    delta, _, applied = pair.run("pd.set_option('display.max_rows', 6)\n"
                                 "pd.set_option('display.precision', 2)\n"
                                 "pd.set_option('display.column_space', 20)")  # deprecated
    assert applied == [] and process_names(delta) == [P + "pandas.options"]
    assert pair.both(shown) != default
    assert pair.both("pd.get_option('display.max_rows')") == 6
    pair.run("pd.reset_option('display.max_rows')\npd.reset_option('display.precision')")
    assert pair.both(shown) == default


def test_matplotlib_rcparams_and_backend(pair):
    pytest.importorskip("matplotlib")
    delta, _, applied = pair.run(
        "import matplotlib\nmatplotlib.use('agg')\nimport matplotlib.pyplot as plt\n"
        "matplotlib.rcParams['lines.linewidth'] = 4.5\nplt.rcParams['figure.figsize'] = [3, 2]")
    assert applied == [] and P + "matplotlib.rcParams" in process_names(delta)
    assert pair.both("matplotlib.get_backend()") == "agg"
    assert pair.both("list(plt.figure().get_size_inches())") == [3, 2]
    pair.both("plt.plot([1, 2])[0].get_linewidth()")
    pair.both("sorted((k, repr(v)) for k, v in dict.items(matplotlib.rcParams))")


def test_logging_levels(pair):
    name = "nbos.process_test.app"
    exists = f"{name!r} in __import__('logging').root.manager.loggerDict"
    assert not pair.sb.call("eval", exists)  # the standby creates it
    delta, _, applied = pair.run(f"import logging\nlogging.getLogger({name!r}).setLevel(40)\n"
                                 "logging.getLogger().setLevel(logging.INFO)")
    assert applied == [] and process_names(delta) == [P + "logging.levels"]
    levels = f"[logging.getLogger({name!r} + '.child').getEffectiveLevel(), " \
             "logging.getLogger().level]"
    assert pair.both(levels) == [40, 20]
    pair.run(f"logging.getLogger({name!r}).setLevel(logging.NOTSET)\n"
             "logging.getLogger().setLevel(logging.WARNING)")
    assert pair.both(levels) == [30, 30]


def test_logging_handlers_of_basic_config(pair, tmp_path):
    path = str(tmp_path / "app.log")
    handlers = "[(type(h).__name__, h.level, h.formatter._fmt, getattr(h, 'baseFilename', None),"\
               " getattr(h, 'stream', None) is sys.stderr) for h in logging.getLogger().handlers]"
    pair.run("import logging, sys")
    before = pair.both(handlers)
    delta, _, applied = pair.run(
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s:%(name)s:%(message)s')\n"
        f"logging.getLogger('nbos.process_test.file').addHandler(logging.FileHandler({path!r}))")
    assert applied == [] and P + "logging.handlers" in process_names(delta)
    assert pair.both(handlers)[len(before):] == [
        ("StreamHandler", 0, "%(levelname)s:%(name)s:%(message)s", None, True)]
    assert pair.both("[h.baseFilename for h in "
                     "logging.getLogger('nbos.process_test.file').handlers]") == [path]
    pair.run("for h in list(logging.getLogger().handlers) + "
             "list(logging.getLogger('nbos.process_test.file').handlers):\n"
             "    h.close()\n"
             "    logging.getLogger().removeHandler(h)\n"
             "    logging.getLogger('nbos.process_test.file').removeHandler(h)")
    assert pair.both(handlers) == []


def test_warnings_filters_keep_notebook_categories(pair):
    pair.run("import warnings\nclass NbWarning(UserWarning):\n    pass\n"
             "def outcome(category):\n    try:\n        warnings.warn('w', category)\n"
             "    except Warning as e:\n        return type(e).__name__\n    return 'no error'")
    assert pair.both("outcome(NbWarning)") == "no error"
    delta, _, applied = pair.run("warnings.filterwarnings('error', category=NbWarning)")
    assert applied == [] and process_names(delta) == [P + "warnings.filters"]
    assert pair.both("outcome(NbWarning)") == "NbWarning"
    assert pair.sb.call("eval", "warnings.filters[0][2] is NbWarning")
    # A category defined in the same cell as its filter.
    pair.run("class Other(UserWarning):\n    pass\nwarnings.simplefilter('error', Other)")
    assert pair.sb.call("eval", "warnings.filters[0][2] is Other")
    assert pair.both("outcome(Other)") == "Other"
    pair.run("warnings.filters[:] = [f for f in warnings.filters\n"
             "    if f[2] not in (NbWarning, Other)]\nwarnings._filters_mutated()")
    assert pair.both("outcome(NbWarning)") == "no error"


def test_recursion_limit(pair):
    delta, _, applied = pair.run("import sys\nlimit = sys.getrecursionlimit() + 123\n"
                                 "sys.setrecursionlimit(limit)")
    assert applied == [] and process_names(delta) == [P + "sys.recursionlimit"]
    assert pair.both("sys.getrecursionlimit()") == pair.ex.call("eval", "limit")
    pair.run("sys.setrecursionlimit(limit - 123)")


def test_torch_flags(pair):
    pytest.importorskip("torch")
    flags = "(torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), " \
            "torch.is_deterministic_algorithms_warn_only_enabled(), " \
            "torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, " \
            "str(torch.get_default_dtype()), torch.get_float32_matmul_precision(), " \
            "str(torch.ones(1).dtype))"
    pair.run("import torch")
    default = pair.sb.call("eval", flags)
    delta, _, applied = pair.run(
        "torch.set_num_threads(torch.get_num_threads() + 1)\n"
        "torch.use_deterministic_algorithms(True, warn_only=True)\n"
        "torch.backends.cudnn.benchmark = True\ntorch.backends.cudnn.deterministic = True\n"
        "torch.set_default_dtype(torch.float64)\ntorch.set_float32_matmul_precision('medium')")
    assert applied == [] and process_names(delta) == [P + "torch.flags"]
    assert pair.both(flags)[5:] == ("torch.float64", "medium", "torch.float64")
    pair.run("torch.set_num_threads(torch.get_num_threads() - 1)\n"
             "torch.use_deterministic_algorithms(False)\n"
             "torch.backends.cudnn.benchmark = torch.backends.cudnn.deterministic = False\n"
             "torch.set_default_dtype(torch.float32)\n"
             "torch.set_float32_matmul_precision('highest')")
    assert pair.both(flags) == default


# ------------------------------------------------------------------------------------------
# Deltas, failures, snapshots


def test_a_delta_with_only_process_state(pair):
    pair.run("import random")
    delta, problems, applied = pair.run("random.seed(99)")
    assert len(delta) and problems == applied == []
    header = describe(delta)
    assert header["set"] == [P + "random"] and header["del"] == header["bad"] == []
    pair.both("random.random()")
    assert P + "random" not in pair.sb.call("eval", "list(globals())")


def test_pseudo_names_come_after_the_names(pair):
    delta, _, _ = pair.run("import random\nrandom.seed(5)\nz = 1\nimport sys\n"
                           "sys.setrecursionlimit(sys.getrecursionlimit())\na = 2")
    names = describe(delta)["set"]
    assert names == ["random", "sys", "a", "z", P + "random"]


def test_a_pass_cell_stays_empty(pair):
    pair.run("import random, logging, warnings\nimport numpy as np")
    assert pair.ex.call("cell", "pass") == (b"", [])
    assert pair.ex.call("cell", "x = np.arange(3).sum() + len(warnings.filters)")[0] != b""
    # Reads names and creates a logger (at no level of its own): nothing to send.
    assert pair.ex.call("cell", "str((x, random, logging.getLogger('a.b')))") == (b"", [])


def test_a_cell_that_names_nothing_does_not_look_at_process_state(pair):
    """`pass` cannot call code: the registry is not even asked (here the state changed outside
    any cell, which nbos does not see; the next cell that runs code carries it)."""
    pair.run("import random")
    pair.ex.call("exec", "random.seed(99)")
    assert pair.ex.call("cell", "pass")[0] == b""
    delta, _, applied = pair.run("y = 1")
    assert applied == [] and P + "random" in process_names(delta)
    pair.both("random.random()")


def test_changed_is_empty_when_nothing_changed():
    import random
    state = process.ProcessState()
    assert state.changed() == {}
    random.random()
    assert list(state.changed()) == ["random"]
    assert state.changed() == {}


def test_an_entry_that_fails_to_apply_does_not_stop_the_others(pair):
    pair.run("import random\nimport numpy as np")
    pair.sb.call("exec", "import numpy\ndef refuse(**options):\n"
                         "    raise RuntimeError('no print options here')\n"
                         "real_set_printoptions = numpy.set_printoptions\n"
                         "numpy.set_printoptions = refuse")
    try:
        delta, problems, applied = pair.run(
            "x = 5\nnp.set_printoptions(precision=1)\nrandom.seed(11)")
        assert problems == []
        assert applied == ["nbos: cannot replicate the numpy.printoptions state: it could not "
                           "be applied on this replica (RuntimeError: no print options here)"]
        assert pair.sb.call("unrebuilt") == {
            P + "numpy.printoptions": "RuntimeError: no print options here"}
        assert pair.sb.call("eval", "x") == 5
        pair.both("random.random()")
        assert P + "numpy.printoptions" not in pair.sb.call("eval", "list(globals())")
    finally:
        pair.sb.call("exec", "numpy.set_printoptions = real_set_printoptions")
    # The next change of the entry applies, and the standby follows again.
    pair.run("np.set_printoptions(precision=3)")
    assert pair.sb.call("unrebuilt") == {}
    pair.both("repr(np.array([1 / 3]))")
    pair.run("np.set_printoptions(precision=8)")


def test_an_entry_that_cannot_be_rebuilt_does_not_stop_the_others(pair, tmp_path):
    # An installed library the standby lacks (a notebook-local module would travel with it).
    installed = tmp_path / "site-packages"
    installed.mkdir()
    (installed / "nbos_only_here.py").write_text("class HereWarning(UserWarning):\n    pass\n")
    pair.ex.call("exec", f"import sys\nsys.path.insert(0, {str(installed)!r})")
    pair.run("import random, sys, warnings")
    delta, problems, applied = pair.run(
        "x = 1\nrandom.seed(4)\n"
        "warnings.simplefilter('error', __import__('nbos_only_here').HereWarning)\n"
        "sys.setrecursionlimit(sys.getrecursionlimit() + 7)")
    assert problems == [] and process_names(delta) == [
        P + "random", P + "warnings.filters", P + "sys.recursionlimit"]
    assert applied == ["nbos: cannot replicate the warnings.filters state: it could not be "
                       "rebuilt on this replica (ModuleNotFoundError: No module named "
                       "'nbos_only_here')"]
    assert list(pair.sb.call("unrebuilt")) == [P + "warnings.filters"]
    assert pair.both("(x, random.random(), sys.getrecursionlimit())")[0] == 1
    assert P + "warnings.filters" not in pair.sb.call("eval", "list(globals())")
    pair.run("warnings.filters[:] = [f for f in warnings.filters\n"
             "    if f[2].__name__ != 'HereWarning']\nwarnings._filters_mutated()\n"
             "sys.setrecursionlimit(sys.getrecursionlimit() - 7)")
    assert pair.sb.call("unrebuilt") == {}
    pair.both("repr(warnings.filters)")


def test_an_unpicklable_value_is_reported_once_and_never_bound(pair):
    pair.run("import numpy as np")
    delta, problems, applied = pair.run(
        "np.set_printoptions(formatter={'float': (lambda lock: lambda x: lock and '%.1f' % x)("
        "__import__('threading').Lock())})")
    assert problems == ["nbos: cannot replicate the numpy.printoptions state: it refers to a "
                        "lock object: locks cannot be replicated"]
    assert delta == b"" and applied == []  # no placeholder to bind anywhere
    assert pair.ex.call("cell", "pass") == (b"", [])
    assert pair.sb.call("eval", "np.get_printoptions()['formatter']") is None
    pair.run("np.set_printoptions(formatter=None)")


def test_snapshot_carries_process_state_and_restore_applies_it(pair):
    pytest.importorskip("pandas")
    pair.run("import random, logging, warnings\nimport numpy as np\nimport pandas as pd")
    pair.ex.call("cell", "random.seed(21)\nnp.random.seed(21)\nnp.random.randn()\n"
                         "pd.set_option('display.max_columns', 3)\n"
                         "logging.getLogger('nbos.snapshot').setLevel(10)\n"
                         "warnings.filterwarnings('ignore', message='nbos snapshot')\nv = 1")
    snapshot = pair.ex.call("snapshot")
    entries = process_names(snapshot)
    for entry in ("random", "numpy.random", "numpy.printoptions", "pandas.options",
                  "logging.levels", "warnings.filters", "sys.recursionlimit"):
        assert P + entry in entries
    assert describe(snapshot)["set"][-len(entries):] == entries
    pair.sb.call("new")
    assert pair.sb.call("restore", snapshot) == []
    pair.both("(v, random.random(), np.random.randn(), pd.get_option('display.max_columns'), "
              "logging.getLogger('nbos.snapshot').level, warnings.filters[0][1].pattern)")
    pair.run("pd.reset_option('display.max_columns')\nwarnings.filters.pop(0)")


def test_dataloader_iterators_still_fail_clearly(pair):
    pytest.importorskip("torch")
    _, problems, _ = pair.run("import torch\nfrom torch.utils.data import DataLoader\n"
                              "it = iter(DataLoader(list(range(10)), batch_size=2))\n"
                              "gen = (i for i in range(3))")
    assert sorted(p.split("'")[1] for p in problems) == ["gen", "it"]
    for name in ("it", "gen"):
        pair.sb.call("exec", f"try:\n    next({name})\n    failed = None\n"
                             "except Exception as e:\n    failed = type(e).__name__, str(e)")
        kind, message = pair.sb.call("eval", "failed")
        assert kind == "NotReplicatedError" and "cannot be used here" in message, message


def test_apply_imports_the_module_of_an_entry(monkeypatch):
    applied = []
    entry = process.Entry("colorsys", "colorsys", lambda: None, applied.append)
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    process.ProcessState([entry]).apply("colorsys", 3)
    assert applied == [3] and "colorsys" in sys.modules


# ------------------------------------------------------------------------------------------
# The IPython shell's own settings (%xmode, %colors, %precision, %load_ext, %config)

SHELL = ("from IPython.core.interactiveshell import InteractiveShell\n"
         "shell = InteractiveShell.instance()")


@pytest.fixture
def shell_pair(pair):
    for replica in (pair.ex, pair.sb):
        replica.call("exec", SHELL)
        replica.call("new")  # the shell's settings now count as each replica's start
    pair.run("shell = __import__('IPython').get_ipython()")
    return pair


def test_ipython_traceback_mode_and_colors(shell_pair):
    delta, _, applied = shell_pair.run("shell.run_line_magic('xmode', 'Plain')\n"
                                       "shell.run_line_magic('colors', 'NoColor')")
    assert applied == [] and process_names(delta) == [P + "ipython.traceback"]
    assert shell_pair.both("(shell.InteractiveTB.mode, shell.colors)") == ("Plain", "NoColor")
    shell_pair.run("shell.run_line_magic('xmode', 'Context')\n"
                   "shell.run_line_magic('colors', 'Linux')")
    assert shell_pair.both("(shell.InteractiveTB.mode, shell.colors)") == ("Context", "Linux")


def test_ipython_float_precision(shell_pair):
    shell_pair.run("shell.run_line_magic('precision', '3')")
    assert shell_pair.both("shell.display_formatter.formatters['text/plain']"
                           "(__import__('math').pi)") == "3.142"
    shell_pair.run("shell.run_line_magic('precision', '')")
    assert shell_pair.both("shell.display_formatter.formatters['text/plain']"
                           "(__import__('math').pi)") == "3.141592653589793"


def test_ipython_extensions_are_loaded_where_missing(shell_pair):
    loaded = "sorted(shell.extension_manager.loaded)"
    assert "IPython.extensions.storemagic" not in shell_pair.both(loaded)
    delta, _, applied = shell_pair.run("shell.run_line_magic('load_ext', 'storemagic')")
    assert applied == [] and P + "ipython.extensions" in process_names(delta)
    assert "IPython.extensions.storemagic" in shell_pair.both(loaded)
    assert shell_pair.sb.call("eval", "'store' in shell.magics_manager.magics['line']")


def test_ipython_inline_figure_formats(shell_pair):
    formats = "sorted(InlineBackend.instance(parent=shell).figure_formats)"
    shell_pair.run("from matplotlib_inline.config import InlineBackend")
    shell_pair.run("InlineBackend.instance(parent=shell).figure_formats = {'svg'}")
    assert shell_pair.both(formats) == ["svg"]
    shell_pair.run("InlineBackend.instance(parent=shell).figure_formats = {'png'}")
    assert shell_pair.both(formats) == ["png"]
