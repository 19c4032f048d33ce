"""Tests of notebook-local modules (nbos_state_modules through StateSync).

The executor and the standby are processes of their own (nbos_state_testing.ReplicaProcess)
whose working directories differ: the executor's holds the notebook's modules, the standby's does
not (no shared workspace), so whatever works on the standby came with the deltas. Each test uses
module names of its own: sys.modules outlives a test in those processes.

Run: cd src/replica/python && /usr/bin/python3 -m pytest -q nbos_state_modules_test.py
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nbos_state_modules as modules  # noqa: E402
from nbos_state import describe  # noqa: E402
from nbos_state_testing import ReplicaPair, ReplicaProcess, replica_processes  # noqa: E402


FORGET_EARLIER_TESTS_MODULES = """
import sys
for name in [n for n, m in list(sys.modules.items())
             if "/pytest-of-" in str(getattr(m, "__file__", ""))]:
    del sys.modules[name]
"""


replicas = pytest.fixture(scope="module", name="replicas")(replica_processes)


@pytest.fixture
def pair(replicas, tmp_path):
    """Fresh namespaces; the executor works in tmp_path/notebook (on its sys.path, as a kernel's
    working directory is), the standby in an empty directory."""
    executor, standby = replicas
    notebook, elsewhere = tmp_path / "notebook", tmp_path / "elsewhere"
    notebook.mkdir()
    elsewhere.mkdir()
    for replica, cwd in ((executor, notebook), (standby, elsewhere)):
        replica.call("exec", FORGET_EARLIER_TESTS_MODULES)
        replica.call("new")
        replica.call("exec", f"import os, sys\nos.chdir({str(cwd)!r})\n"
                             f"sys.path[:] = [p for p in sys.path if p != '']\n"
                             f"sys.path.insert(0, {str(cwd)!r})")

    class Pair(ReplicaPair):
        dir = notebook

        def write(self, name, text):
            path = notebook / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

        def run(self, code):
            """The delta of a cell that neither replica reports anything of."""
            delta, problems, applied = super().run(code)
            assert problems == applied == [], (problems, applied)
            return delta

    return Pair(executor, standby)


def module_names(delta):
    return [n for n in describe(delta)["set"] if modules.is_pseudo_name(n)]


def test_a_module_beside_the_notebook_travels_with_the_cell_that_imports_it(pair):
    pair.write("utils_a.py", "def f():\n    return 42\nSCALE = 3\n")
    delta = pair.run("import utils_a\nfrom utils_a import f")
    assert module_names(delta) == ["nbos:module:utils_a", "nbos:module-state:utils_a"]
    assert pair.both("(utils_a.f(), f(), utils_a.SCALE, f is utils_a.f)") == (42, 42, 3, True)
    assert pair.sb.call("eval", "utils_a.__file__") == str(pair.dir / "utils_a.py")
    # Nothing changed: nothing is sent again, not even by a cell that reads the module.
    assert module_names(pair.run("y = utils_a.f()")) == []
    assert pair.ex.call("cell", "pass")[0] == b""


def test_module_level_state_the_notebook_changes_follows(pair):
    pair.write("counter_b.py", "count = 0\nseen = []\ndef bump(x):\n    global count\n"
                               "    count += 1\n    seen.append(x)\n    return count\n")
    pair.run("from counter_b import bump\nimport counter_b")
    delta = pair.run("bump('a')\nbump('b')")
    assert module_names(delta) == ["nbos:module-state:counter_b"]
    assert pair.both("(counter_b.count, counter_b.seen)") == (2, ["a", "b"])
    pair.run("counter_b.count = 40\nshared = counter_b.seen")
    assert pair.both("(counter_b.count, shared is counter_b.seen, bump('c'))") == (40, True, 41)


def test_an_edit_without_a_reload_keeps_the_code_loaded_and_a_reload_takes_the_new(pair):
    pair.write("edited_c.py", "def f():\n    return 1\n")
    pair.run("import edited_c, importlib")
    pair.write("edited_c.py", "def f():\n    return 2\n")
    pair.run("first = edited_c.f()")
    assert pair.both("(first, edited_c.f())") == (1, 1)
    delta = pair.run("importlib.reload(edited_c)\nsecond = edited_c.f()")
    assert "nbos:module:edited_c" in module_names(delta)
    assert pair.both("(second, edited_c.f())") == (2, 2)


def test_a_package_and_its_submodules_with_relative_imports(pair):
    pair.write("pkg_d/__init__.py", "from .sub import g\nNAME = 'pkg'\n")
    pair.write("pkg_d/sub.py", "from . import helper\ndef g():\n    return helper.h() + 1\n")
    pair.write("pkg_d/helper.py", "def h():\n    return 9\n")
    delta = pair.run("import pkg_d\nfrom pkg_d.sub import g")
    sources = [n for n in module_names(delta) if n.startswith("nbos:module:")]
    assert sources == ["nbos:module:pkg_d", "nbos:module:pkg_d.helper", "nbos:module:pkg_d.sub"]
    assert pair.both("(pkg_d.g(), g(), pkg_d.NAME, pkg_d.sub.helper.h())") == (10, 10, "pkg", 9)


def test_a_snapshot_carries_local_modules_to_a_new_replica(pair, tmp_path):
    pair.write("snap_e.py", "TOTAL = 0\ndef add(n):\n    global TOTAL\n    TOTAL += n\n")
    pair.run("import snap_e\nsnap_e.add(5)")
    pair.ex.call("cell", "snap_e.add(2)")  # not applied: the snapshot has it
    fresh = ReplicaProcess(str(tmp_path / "fresh-blobs"), 3)
    try:
        fresh.call("new")
        assert fresh.call("restore", pair.ex.call("snapshot")) == []
        assert fresh.call("eval", "(snap_e.TOTAL, snap_e.add.__module__)") == (7, "snap_e")
    finally:
        fresh.close()


def test_a_module_whose_source_fails_on_a_standby_is_reported_and_the_rest_applies(pair):
    pair.write("only_here_f.py", "import os\nif os.getcwd().endswith('elsewhere'):\n"
                                 "    raise ImportError('not on this replica')\nVALUE = 1\n")
    delta, problems = pair.ex.call("cell", "import only_here_f\nfrom only_here_f import VALUE\n"
                                           "other = 7")
    assert problems == []
    applied = pair.sb.call("apply", delta)
    assert applied and "module only_here_f" in applied[0], applied
    assert "nbos:module:only_here_f" in pair.sb.call("unrebuilt")
    assert pair.sb.call("eval", "(other, VALUE)") == (7, 1)


def test_data_that_cannot_be_replicated_keeps_what_the_source_gave_each_replica(pair):
    pair.write("locked_g.py", "import threading\nlock = threading.Lock()\nhits = 0\n"
                              "def hit():\n    global hits\n    with lock:\n        hits += 1\n")
    pair.run("import locked_g\nlocked_g.hit()")
    assert pair.both("(locked_g.hits, type(locked_g.lock).__name__)") == (1, "lock")
    assert pair.sb.call("eval", "locked_g.hit() or locked_g.hits") == 2


def test_installed_and_nbos_modules_are_not_local(tmp_path):
    assert not modules.is_local_file(os.__file__)
    assert not modules.is_local_file(pytest.__file__)
    assert not modules.is_local_file(modules.__file__)
    assert not modules.is_local_file("/opt/env/lib/python3.11/site-packages/x.py")
    assert not modules.is_local_file("<nbos_state>")
    (tmp_path / "mine.py").write_text("")
    assert modules.is_local_file(str(tmp_path / "mine.py"))
