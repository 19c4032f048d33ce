"""Test helpers: a replica in a process of its own, and a fake CUDA for torch.

Process state (RNG streams, library settings) is global to a process, so the executor and the
standby of a test that replicates it must be different processes.

Contract
--------
    replica = ReplicaProcess(store_dir, replica_id)   # spawns it; .close() ends it
    replica.call(op, arg=None) -> result              # AssertionError with the child's
                                                      # traceback when the op raised there
        "new"        a fresh namespace and StateSync over DirStore(store_dir)
        "cell"       run `arg` as the executor: begin, exec, end -> (delta, [problem messages])
        "apply"      sync.apply(arg) -> [problem messages]
        "restore"    sync.restore(arg) -> [problem messages]
        "snapshot"   sync.snapshot() -> bytes
        "exec"       exec `arg` in the namespace, without replicating anything
        "eval"       eval `arg` in the namespace -> its value (must pickle)
        "unrebuilt"  dict(sync.unrebuilt)
    replica_processes(tmp_path_factory)               # a module fixture body: yields an
                                                      # (executor, standby) pair over one
                                                      # store, closed after the module
    pair = ReplicaPair(executor, standby)             # two ReplicaProcesses
        pair.run(code) -> (delta, executor's problems, standby's problems): a cell on the
                          executor, its delta applied on the standby
        pair.both(expression) -> its value, asserted equal on both
    install_fake_cuda(initialized, device=0) -> FakeCuda   # in the process that calls it:
        replaces torch.cuda's functions that nbos uses with ones keeping a 16-byte generator
        state in memory; .sets lists the states set_rng_state received; remove_fake_cuda()
        puts the real ones back
    import_engine() -> the nbos_engine module, with a stand-in for the C++ module _nbos and
        MPLBACKEND left as it was
"""

import multiprocessing
import os
import sys
import traceback
import types

from nbos_state import StateSync
from nbos_state_test import HIDDEN, DirStore, new_ns


class ReplicaProcess:
    def __init__(self, store_dir, replica_id):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, store_dir, replica_id), daemon=True)
        self._proc.start()

    def call(self, op, arg=None, timeout=60):
        self._conn.send((op, arg))
        if not self._conn.poll(timeout):
            raise TimeoutError(op)
        status, result = self._conn.recv()
        assert status == "ok", result
        return result

    def close(self):
        try:
            self.call("quit", timeout=10)
        finally:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()


def replica_processes(tmp_path_factory):
    store_dir = str(tmp_path_factory.mktemp("blobs"))
    executor, standby = ReplicaProcess(store_dir, 1), ReplicaProcess(store_dir, 2)
    try:
        yield executor, standby
    finally:
        executor.close()
        standby.close()


class ReplicaPair:
    def __init__(self, executor, standby):
        self.ex, self.sb = executor, standby

    def run(self, code):
        delta, problems = self.ex.call("cell", code)
        return delta, problems, self.sb.call("apply", delta)

    def both(self, expression):
        want = self.ex.call("eval", expression)
        assert self.sb.call("eval", expression) == want, expression
        return want


def _serve(conn, store_dir, replica_id):
    store = DirStore(store_dir)
    ns = sync = None
    while True:
        op, arg = conn.recv()
        if op == "quit":
            conn.send(("ok", None))
            return
        try:
            result = None
            if op == "new":
                ns = new_ns()
                sync = StateSync(ns, HIDDEN, store, replica_id=replica_id)
            elif op == "cell":
                cell = sync.begin(arg)
                exec(compile(arg, "<cell>", "exec"), ns)
                delta, problems = sync.end(cell)
                result = delta, [p.message() for p in problems]
            elif op in ("apply", "restore"):
                result = [p.message() for p in getattr(sync, op)(arg)]
            elif op == "snapshot":
                result = sync.snapshot()
            elif op == "exec":
                exec(compile(arg, "<exec>", "exec"), ns)
            elif op == "eval":
                result = eval(arg, ns)
            elif op == "unrebuilt":
                result = dict(sync.unrebuilt)
            else:
                raise ValueError(f"unknown op {op!r}")
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class FakeCuda:
    """The state behind install_fake_cuda's functions."""

    def __init__(self, initialized, device):
        self.initialized, self.device = initialized, device
        self.state = bytes(16)
        self.sets = []

    def get_rng_state(self, device="cuda"):
        if not self.initialized:
            raise AssertionError("reading the CUDA generator would initialise CUDA")
        import torch
        return torch.tensor(list(self.state), dtype=torch.uint8)

    def set_rng_state(self, new_state, device="cuda"):
        if not self.initialized:
            raise AssertionError("setting the CUDA generator would initialise CUDA")
        self.state = bytes(new_state.tolist())
        self.sets.append(self.state)

    def set_device(self, device):
        self.initialized, self.device = True, device

    def current_device(self):
        return self.device


_FAKED = ("is_available", "is_initialized", "get_rng_state", "set_rng_state", "set_device",
          "current_device", "empty_cache")
_real_cuda = {}


def install_fake_cuda(initialized, device=0):
    import torch
    fake = FakeCuda(initialized, device)
    if not _real_cuda:
        _real_cuda.update((n, getattr(torch.cuda, n)) for n in _FAKED)
    torch.cuda.is_available = lambda: True
    torch.cuda.is_initialized = lambda: fake.initialized
    torch.cuda.empty_cache = lambda: None
    for name in ("get_rng_state", "set_rng_state", "set_device", "current_device"):
        setattr(torch.cuda, name, getattr(fake, name))
    return fake


def remove_fake_cuda():
    import torch
    for name, function in _real_cuda.items():
        setattr(torch.cuda, name, function)


def import_engine():
    sys.modules.setdefault("_nbos", types.ModuleType("_nbos"))
    backend = os.environ.get("MPLBACKEND")
    try:
        import nbos_engine
    finally:
        if backend is None:
            os.environ.pop("MPLBACKEND", None)
        else:
            os.environ["MPLBACKEND"] = backend
    return nbos_engine
