"""The Python side of the nbos execution engine.

Runs cells through IPython's InteractiveShell, so magics, the display hook, `Out`, history and rich
output behave as in ipykernel. Everything that leaves the process goes through the C++ module
`_nbos`: stream text, iopub messages, stdin requests. The C++ side owns sockets, message headers,
signatures and threads; this module owns Python semantics and builds message *content*.
"""

import builtins
import contextlib
import getpass
import json
import os
import re
import signal
import sqlite3
import struct
import sys
import traceback
import uuid

import _nbos

# Plots without `%matplotlib inline` must still appear in the notebook, as under ipykernel.
os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")

from IPython.core.displayhook import DisplayHook  # noqa: E402
from IPython.core.displaypub import DisplayPublisher  # noqa: E402
from IPython.core.error import StdinNotImplementedError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from IPython.core.magic import Magics, line_magic, magics_class  # noqa: E402
from traitlets.config import Config  # noqa: E402


def _json_default(obj):
    """Makes values that rich reprs commonly return JSON-serialisable."""
    import datetime

    if isinstance(obj, (datetime.date, datetime.datetime)):
        return obj.isoformat()
    if isinstance(obj, bytes):
        import base64

        return base64.b64encode(obj).decode("ascii")
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if hasattr(obj, "tolist"):  # numpy scalars and arrays
        return obj.tolist()
    return repr(obj)


def _dumps(obj):
    return json.dumps(obj, default=_json_default, ensure_ascii=False)


def publish(msg_type, content, metadata=None, buffers=None):
    _nbos.publish(msg_type, _dumps(content), _dumps(metadata or {}), list(buffers or []))


def value_digest(value):
    """A content digest that is equal for equal values in two processes.

    Tensors, arrays, frames and modules by their data; functions and classes by their code;
    everything else by its pickle. Used to check that replicas hold the same namespace.
    """
    import hashlib
    import pickle
    import types

    h = hashlib.sha256()

    def feed(obj, depth=0):
        h.update(type(obj).__qualname__.encode())
        mod = sys.modules.get("torch")
        if mod is not None:
            if isinstance(obj, mod.Tensor):
                t = obj.detach().cpu().contiguous()
                h.update(str((tuple(t.shape), str(t.dtype))).encode())
                h.update(t.numpy().tobytes() if t.dtype != mod.bfloat16 else t.float().numpy().tobytes())
                return
            if isinstance(obj, mod.nn.Module):
                for k, v in sorted(obj.state_dict().items()):
                    h.update(k.encode())
                    feed(v, depth + 1)
                return
            if isinstance(obj, mod.optim.Optimizer):
                feed(obj.state_dict(), depth + 1)
                return
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.ndarray):
            h.update(str((obj.shape, str(obj.dtype))).encode())
            h.update(np.ascontiguousarray(obj).tobytes())
            return
        pd = sys.modules.get("pandas")
        if pd is not None and isinstance(obj, (pd.DataFrame, pd.Series)):
            labels = obj.columns if isinstance(obj, pd.DataFrame) else [obj.name]
            h.update(repr(list(labels)).encode())
            h.update(pd.util.hash_pandas_object(obj, index=True).values.tobytes())
            return
        if isinstance(obj, dict) and depth < 8:
            for k in sorted(obj, key=repr):
                h.update(repr(k).encode())
                feed(obj[k], depth + 1)
            return
        if isinstance(obj, (list, tuple)) and depth < 8:
            for item in obj:
                feed(item, depth + 1)
            return
        if isinstance(obj, types.FunctionType):
            code = obj.__code__
            h.update(code.co_code)
            h.update(repr(code.co_consts).encode())
            h.update(repr(code.co_names).encode())
            return
        if isinstance(obj, type):
            h.update(obj.__qualname__.encode())
            h.update(repr(sorted(k for k in vars(obj) if not k.startswith("__"))).encode())
            return
        if isinstance(obj, types.ModuleType):
            h.update(obj.__name__.encode())
            return
        try:
            h.update(pickle.dumps(obj, protocol=5))
        except Exception:
            h.update(repr(obj).encode(errors="replace"))

    feed(value)
    return h.hexdigest()


@contextlib.contextmanager
def _warnings_to_log():
    """Warnings raised while this replica rebuilds values another replica bound (a __setstate__
    that warns, a library's own) go to the replica's log: on its stderr they would reach a
    cell's output, which only the executor writes. Only showwarning changes, not the filters:
    the delta may set those (the process-state registry)."""
    import warnings

    def log(message, category, filename, lineno, file=None, line=None):
        text = warnings.formatwarning(message, category, filename, lineno, line).strip()
        _nbos.log_warning("nbos: while rebuilding another replica's values: " + text)

    shown = warnings.showwarning
    warnings.showwarning = log
    try:
        yield
    finally:
        warnings.showwarning = shown

class OutStream:
    """sys.stdout/sys.stderr: text goes to the C++ stream buffer, which coalesces it."""

    encoding = "utf-8"
    errors = "replace"
    newlines = None
    closed = False
    line_buffering = False

    def __init__(self, name, fd):
        self.name = name
        self._fd = fd

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        try:
            _nbos.write_stream(self.name, text)
        except UnicodeEncodeError:
            _nbos.write_stream(self.name, text.encode("utf-8", "replace").decode("utf-8"))
        return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        _nbos.flush_streams()

    def isatty(self):
        return False

    def fileno(self):
        return self._fd

    def readable(self):
        return False

    def writable(self):
        return True

    def seekable(self):
        return False

    def close(self):
        pass


class NbosDisplayHook(DisplayHook):
    """Publishes a cell's trailing expression as execute_result."""

    def start_displayhook(self):
        self._bundle = {"data": {}, "metadata": {}, "execution_count": None}

    def write_output_prompt(self):
        self._bundle["execution_count"] = self.prompt_count

    def write_format_data(self, format_dict, md_dict=None):
        self._bundle["data"] = format_dict
        self._bundle["metadata"] = md_dict or {}

    def finish_displayhook(self):
        sys.stdout.flush()
        sys.stderr.flush()
        if self._bundle["data"]:
            publish("execute_result", self._bundle)
        self._bundle = None


class NbosDisplayPublisher(DisplayPublisher):
    """display() and friends become display_data / update_display_data / clear_output."""

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kw):
        sys.stdout.flush()
        sys.stderr.flush()
        content = {"data": data, "metadata": metadata or {}, "transient": transient or {}}
        publish("update_display_data" if update else "display_data", content)

    def clear_output(self, wait=False):
        sys.stdout.flush()
        sys.stderr.flush()
        publish("clear_output", {"wait": bool(wait)})


class ZMQInteractiveShell(InteractiveShell):
    """The shell of a kernel served over ZeroMQ.

    Named like ipykernel's shell because libraries detect "running in a Jupyter kernel" by
    `get_ipython().__class__.__name__ == "ZMQInteractiveShell"` and should behave here as there.
    """

    displayhook_class = NbosDisplayHook
    display_pub_class = NbosDisplayPublisher

    def init_io(self):
        # The streams are installed by the engine; nothing to set up for a terminal.
        pass

    def _showtraceback(self, etype, evalue, stb):
        sys.stdout.flush()
        sys.stderr.flush()
        content = {"ename": str(etype.__name__), "evalue": str(evalue), "traceback": stb}
        self._last_error = content
        publish("error", content)

    def set_next_input(self, text, replace=False):
        self.payload_manager.write_payload(
            {"source": "set_next_input", "text": text, "replace": replace}
        )

    def ask_exit(self):
        self.exit_now = True
        self.payload_manager.write_payload({"source": "ask_exit", "keepkernel": False})

    def enable_gui(self, gui=None):
        if gui not in (None, "inline"):
            print(f"nbos: GUI event loop '{gui}' is not available in a remote kernel",
                  file=sys.stderr)

    def init_environment(self):
        # Output goes to a notebook, not a terminal: colour-capable TERM, and no interactive
        # pagers in `!git log` and friends, as users of Jupyter kernels expect.
        os.environ.update({"TERM": "xterm-color", "CLICOLOR": "1", "PAGER": "cat",
                           "GIT_PAGER": "cat"})

    def init_hooks(self):
        super().init_hooks()
        # Help (`obj?`, %pinfo, %less) goes to the frontend's pager as a payload, not to stdout.
        from IPython.core import page, payloadpage

        self.set_hook("show_in_pager", page.as_hook(payloadpage.page), 99)

    def init_magics(self):
        super().init_magics()
        self.register_magics(KernelMagics)


@magics_class
class KernelMagics(Magics):
    """The magics a Jupyter kernel adds to IPython's own."""

    @line_magic
    def autosave(self, arg_s):
        """Set the notebook's autosave interval in seconds (0 disables it)."""
        try:
            interval = int(arg_s)
        except ValueError as e:
            from IPython.core.error import UsageError

            raise UsageError("%autosave requires an integer, got %r" % arg_s) from e
        from IPython.display import publish_display_data

        publish_display_data(
            {"application/javascript": "IPython.notebook.set_autosave_interval(%i)"
             % (interval * 1000)})
        print("Autosaving every %i seconds" % interval if interval else "Autosave disabled")

    def _page_file(self, arg_s):
        from IPython.core import page
        from IPython.core.error import UsageError
        from IPython.utils.openpy import read_py_file

        if not arg_s:
            raise UsageError("Missing filename.")
        if arg_s.endswith(".py"):
            text = self.shell.pycolorize(read_py_file(arg_s, skip_encoding_cookie=False))
        else:
            with open(arg_s, encoding="utf-8", errors="replace") as f:
                text = f.read()
        page.page(text)

    @line_magic
    def less(self, arg_s):
        """Show a file through the pager."""
        self._page_file(arg_s)

    more = line_magic("more")(less)

    @line_magic
    def man(self, arg_s):
        """Show a man page through the pager."""
        from IPython.core import page
        from IPython.utils.process import getoutput

        page.page(getoutput("man %s | col -b" % arg_s))

    @line_magic
    def clear(self, arg_s):
        """Clear the terminal (an ANSI clear sequence in the output)."""
        self.shell.system("clear")

    @line_magic
    def connect_info(self, arg_s):
        """Print how to connect another client to this kernel."""
        path = CONNECTION_FILE
        if not path:
            print("This kernel has no connection file to share.")
            return
        with open(path, encoding="utf-8") as f:
            print(f.read())
        print("\nPaste the above JSON into a file, and connect with:\n"
              "    $> jupyter <app> --existing <file>\n"
              "or, if you are local, you can connect with just:\n"
              f"    $> jupyter <app> --existing {os.path.basename(path)}")


class Comm:
    """A kernel-side comm; the frontend side is addressed by comm_id."""

    def __init__(self, target_name="", data=None, metadata=None, buffers=None, comm_id=None,
                 primary=True, target_module=None, **kwargs):
        self.comm_id = comm_id or uuid.uuid4().hex
        self.target_name = target_name
        self.target_module = target_module
        self.primary = primary
        self._closed = not primary
        self._msg_callback = None
        self._close_callback = None
        if primary:
            self._closed = False
            content = {"comm_id": self.comm_id, "target_name": target_name, "data": data or {}}
            if target_module is not None:
                content["target_module"] = target_module
            publish("comm_open", content, metadata, buffers)
            comm_manager.register_comm(self)

    def send(self, data=None, metadata=None, buffers=None):
        publish("comm_msg", {"comm_id": self.comm_id, "data": data or {}}, metadata, buffers)

    def close(self, data=None, metadata=None, buffers=None, deleting=False):
        if self._closed:
            return
        self._closed = True
        publish("comm_close", {"comm_id": self.comm_id, "data": data or {}}, metadata, buffers)
        comm_manager.unregister_comm(self)

    def on_msg(self, callback):
        self._msg_callback = callback

    def on_close(self, callback):
        self._close_callback = callback

    def handle_msg(self, msg):
        if self._msg_callback is not None:
            self._msg_callback(msg)

    def handle_close(self, msg):
        if self._close_callback is not None:
            self._close_callback(msg)


class CommManager:
    def __init__(self):
        self.comms = {}
        self.targets = {}

    def register_target(self, target_name, f):
        self.targets[target_name] = f

    def unregister_target(self, target_name, f=None):
        return self.targets.pop(target_name, None)

    def register_comm(self, comm):
        self.comms[comm.comm_id] = comm
        return comm.comm_id

    def unregister_comm(self, comm):
        self.comms.pop(comm.comm_id, None)

    def get_comm(self, comm_id):
        return self.comms.get(comm_id)

    def comm_open(self, msg):
        content = msg["content"]
        comm = Comm(comm_id=content.get("comm_id"), primary=False,
                    target_name=content.get("target_name", ""))
        self.register_comm(comm)
        handler = self.targets.get(content.get("target_name"))
        if handler is not None:
            try:
                handler(comm, msg)
                return
            except Exception:
                traceback.print_exc()
        else:
            print(f"No such comm target registered: {content.get('target_name')}",
                  file=sys.stderr)
        # The frontend must learn that this comm is dead.
        comm._closed = False
        comm.close()

    def comm_msg(self, msg):
        comm = self.get_comm(msg["content"].get("comm_id"))
        if comm is not None:
            try:
                comm.handle_msg(msg)
            except Exception:
                traceback.print_exc()

    def comm_close(self, msg):
        comm = self.comms.pop(msg["content"].get("comm_id"), None)
        if comm is not None:
            comm._closed = True
            try:
                comm.handle_close(msg)
            except Exception:
                traceback.print_exc()

    def comm_info(self, target_name=None):
        return {
            cid: {"target_name": c.target_name}
            for cid, c in self.comms.items()
            if target_name is None or c.target_name == target_name
        }


comm_manager = CommManager()
CONNECTION_FILE = ""  # set by Engine


class KernelShim:
    """What libraries look for at get_ipython().kernel."""

    def __init__(self):
        self.comm_manager = comm_manager
        self.implementation = "nbos"


def _input(prompt=""):
    sys.stdout.flush()
    sys.stderr.flush()
    return _nbos.input_request(str(prompt), False)


def _getpass(prompt="Password: ", stream=None):
    sys.stdout.flush()
    sys.stderr.flush()
    return _nbos.input_request(str(prompt), True)


def _no_input(prompt=""):
    raise StdinNotImplementedError(
        "raw_input was called, but this frontend does not support input requests."
    )


def _no_getpass(prompt="", stream=None):
    raise StdinNotImplementedError(
        "getpass was called, but this frontend does not support input requests."
    )



# --- GPU binding (DESIGN.md §6) -------------------------------------------------------------

class GpuBinding:
    """The GPUs granted to the running cell. Before the cell: NBOS_GPU_IDS names them, torch's
    current device is the first, and the modules, tensors and optimizer state this replica moved
    to host memory after its previous cell go back onto it. After the cell: they move to host
    memory again and torch frees its cached GPU memory, so the daemon can grant the devices to
    another kernel. Without torch or CUDA only the bookkeeping and NBOS_GPU_IDS remain."""

    def __init__(self):
        self.ids = []
        self._parked = []  # names moved to host memory at the end of the previous cell

    def _torch_cuda(self):
        torch = sys.modules.get("torch")
        try:
            return torch if torch is not None and torch.cuda.is_available() else None
        except Exception:  # a broken CUDA install must not break the cell
            return None

    def bind(self, ids, user_ns):
        self.ids = [int(i) for i in ids]
        if self.ids:
            os.environ["NBOS_GPU_IDS"] = ",".join(str(i) for i in self.ids)
        else:
            os.environ.pop("NBOS_GPU_IDS", None)
        torch = self._torch_cuda()
        if torch is None or not self.ids:
            return
        torch.cuda.set_device(self.ids[0])
        # The CUDA generator state the log brought (or this replica's, when the grant moved to
        # another device) goes onto the device the cell will draw from.
        process_state = sys.modules.get("nbos_state_process")
        if process_state is not None:
            process_state.bind_cuda_rng()
        device = torch.device("cuda", self.ids[0])
        for name in self._parked:
            value = user_ns.get(name)
            if value is not None:
                user_ns[name] = _move(value, device, torch)
        self._parked = []

    def release(self, user_ns):
        torch = self._torch_cuda()
        if torch is not None and self.ids:
            cpu = torch.device("cpu")
            for name, value in list(user_ns.items()):
                if not name.startswith("_") and _on_cuda(value, torch):
                    user_ns[name] = _move(value, cpu, torch)
                    self._parked.append(name)
            torch.cuda.empty_cache()
        self.ids = []

    def clear_environment(self):
        os.environ.pop("NBOS_GPU_IDS", None)

    def device(self):
        torch = self._torch_cuda()
        if torch is not None and self.ids:
            return torch.device("cuda", self.ids[0])
        try:
            import torch as t
            return t.device("cpu")
        except ImportError:
            return "cpu"


def _on_cuda(value, torch):
    if isinstance(value, torch.Tensor):
        return value.is_cuda
    if isinstance(value, torch.nn.Module):
        return any(p.is_cuda for p in value.parameters())
    if isinstance(value, torch.optim.Optimizer):
        return any(isinstance(t, torch.Tensor) and t.is_cuda
                   for state in value.state.values() for t in state.values())
    return False


def _move(value, device, torch):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, torch.nn.Module):
        return value.to(device)
    if isinstance(value, torch.optim.Optimizer):
        for state in value.state.values():
            for k, t in state.items():
                if isinstance(t, torch.Tensor):
                    state[k] = t.to(device)
        return value
    return value


GPUS = GpuBinding()


def _install_nbos_module():
    """`import nbos` in a cell: nbos.device() and nbos.gpu_ids() for the running cell."""
    import types
    mod = types.ModuleType("nbos", "nbos runtime helpers inside a kernel")
    mod.device = GPUS.device
    mod.gpu_ids = lambda: list(GPUS.ids)
    sys.modules["nbos"] = mod


# A checkpoint that also carries the side effects so far: magic, u32 little-endian length of the
# JSON that follows, the JSON, then nbos_state's snapshot. Checkpoints without side effects (and
# those written before) are the bare snapshot.
_CHECKPOINT_MAGIC = b"NBCK"
# Inputs a standby keeps before its history thread writes them: waking that thread and writing
# one row cost each standby about 0.5 ms of CPU per cell, as much as its Raft thread. A killed
# standby loses at most these from its own copy of the history; the executor wrote each of them.
_STANDBY_HISTORY_BATCH = 32


def _as_compiled(code):
    """What IPython compiles of a cell that needs no transformation (most do not): itself, with a
    final newline."""
    return code if code.endswith("\n") else code + "\n"


def _cwd():
    """The working directory, or None once a cell removed it: cells still run then, as on
    ipykernel, and only a cell's own os.getcwd() fails."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        return None


def _merge_side_effects(state, changes):
    """Folds one cell's side effects (see Engine._process_changes) into `state`, the sum of all
    before it, in the same shape: applying `state` alone has the effect of applying them all."""
    if "cwd" in changes:
        state["cwd"] = changes["cwd"]
    if "sys_path" in changes:
        state["sys_path"] = changes["sys_path"]
    for k, v in changes.get("env_set", {}).items():
        state.setdefault("env_set", {})[k] = v
        if k in state.get("env_unset", []):
            state["env_unset"].remove(k)
    for k in changes.get("env_unset", []):
        state.get("env_set", {}).pop(k, None)
        if k not in state.setdefault("env_unset", []):
            state["env_unset"].append(k)
    if changes.get("replay"):
        state.setdefault("replay", []).extend(changes["replay"])


class _HistoryConnection(sqlite3.Connection):
    """IPython's history database as a replica writes it: every cell's input still goes to the
    file when the cell ends, but the commit does not wait for the disk (synchronous=OFF, this
    connection only). Each of a kernel's three replicas writes its history, and with the default
    each cell's commit synced the file twice beside the Raft log's own syncs: about 1 ms of CPU
    per replica per cell. A crashed process loses nothing; a crashed host may lose or damage its
    copy, which IPython then sets aside and starts afresh."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.execute("PRAGMA synchronous = OFF")


def _forget_history_from(hm, line):
    """Drops this session's history from `line` on. A cell this replica ran whose effects never
    reached the log (they could not be committed, or another cell's came first) used the line
    that the log's cell now takes; IPython would otherwise refuse the duplicate line when it
    writes the cache, print an error into a later cell's output and move to a new session."""
    if len(hm.input_hist_parsed) <= line:
        return  # the usual case: the log's cells are all this replica has stored
    del hm.input_hist_parsed[line:]
    del hm.input_hist_raw[line:]
    with hm.db_input_cache_lock:
        hm.db_input_cache = [e for e in hm.db_input_cache if e[0] < line]
    with hm.db_output_cache_lock:
        hm.db_output_cache = [e for e in hm.db_output_cache if e[0] < line]
    for table in ("history", "output_history"):
        with contextlib.suppress(Exception), hm.db:
            hm.db.execute(f"DELETE FROM {table} WHERE session = ? AND line >= ?",
                          (hm.session_number, line))


class Engine:
    """One per process. C++ calls handle() on the main thread with the GIL held."""

    def __init__(self, version, connection_file=""):
        global CONNECTION_FILE
        CONNECTION_FILE = connection_file
        sys.stdout = OutStream("stdout", 1)
        sys.stderr = OutStream("stderr", 2)
        config = Config()
        config.HistoryManager.connection_options = {"factory": _HistoryConnection}
        self.shell = ZMQInteractiveShell.instance(config=config)
        self.shell._last_error = None
        self.shell.kernel = KernelShim()
        # As IPython's own applications do by default: %store persists across sessions.
        self.shell.extension_manager.load_extension("storemagic")
        self.version = version
        self.sync = None  # set by enable_replication
        self._delta = None
        self._side_effects = None
        self._process_state = {}  # every side effect so far, merged (see _merge_side_effects)
        self._standby_source = None  # the next Done's cell as compiled, when not _as_compiled
        self._handlers = {
            "execute_request": self.execute,
            "complete_request": self.complete,
            "inspect_request": self.inspect,
            "is_complete_request": self.is_complete,
            "history_request": self.history,
            "comm_info_request": self.comm_info,
            "comm_open": self.comm_open,
            "comm_msg": self.comm_msg,
            "comm_close": self.comm_close,
            "nbos_namespace_request": self.namespace_digests,
        }
        self.set_interruptible(False)
        _install_nbos_module()

    @staticmethod
    def set_interruptible(on):
        """SIGINT raises KeyboardInterrupt only while a request runs; idle, it is ignored."""
        signal.signal(signal.SIGINT, signal.default_int_handler if on else signal.SIG_IGN)

    def kernel_info(self):
        import IPython

        return _dumps({
            "status": "ok",
            "protocol_version": "5.3",
            "implementation": "nbos",
            "implementation_version": self.version,
            "language_info": {
                "name": "python",
                "version": sys.version.split()[0],
                "mimetype": "text/x-python",
                "codemirror_mode": {"name": "ipython", "version": sys.version_info[0]},
                "pygments_lexer": "ipython%d" % sys.version_info[0],
                "nbconvert_exporter": "python",
                "file_extension": ".py",
            },
            "banner": f"Python {sys.version}\nIPython {IPython.__version__} on nbos {self.version}",
            "help_links": [
                {"text": "Python Reference", "url": "https://docs.python.org/3/"},
                {"text": "IPython Reference", "url": "https://ipython.readthedocs.io/"},
            ],
            "debugger": False,
        })

    def handle(self, msg_type, msg_json, buffers):
        """Returns the reply content as JSON text, or None for messages without a reply."""
        handler = self._handlers.get(msg_type)
        if handler is None:
            return None
        msg = json.loads(msg_json)
        msg["buffers"] = [memoryview(b) for b in buffers]
        reply = handler(msg)
        return None if reply is None else _dumps(reply)

    def execute(self, msg):
        content = msg["content"]
        shell = self.shell
        code = content.get("code", "")
        if not isinstance(code, str):
            return {"status": "error", "ename": "TypeError", "evalue": "code must be a string",
                    "traceback": [], "execution_count": shell.execution_count}
        silent = bool(content.get("silent", False))
        store_history = bool(content.get("store_history", not silent))
        user_expressions = content.get("user_expressions") or {}
        allow_stdin = bool(content.get("allow_stdin", False))
        cell_id = (msg.get("metadata") or {}).get("cellId")

        if not silent:
            publish("execute_input", {"code": code, "execution_count": shell.execution_count})
        saved_input, saved_getpass = builtins.input, getpass.getpass
        builtins.input = _input if allow_stdin else _no_input
        getpass.getpass = _getpass if allow_stdin else _no_getpass
        shell._last_error = None
        nbos_meta = (msg.get("metadata") or {}).get("nbos") or {}
        gpu_ids = nbos_meta.get("gpu_ids") if isinstance(nbos_meta, dict) else None
        # Bound outside the sync window: NBOS_GPU_IDS is this replica's, not replicated state.
        GPUS.bind(gpu_ids if isinstance(gpu_ids, list) else [], shell.user_ns)
        sync_token = self._begin_sync(code)
        self.set_interruptible(True)
        try:
            result = shell.run_cell(code, store_history=store_history, silent=silent,
                                    cell_id=cell_id)
        finally:
            self.set_interruptible(False)
            builtins.input, getpass.getpass = saved_input, saved_getpass
            GPUS.release(shell.user_ns)
        self._end_sync(sync_token, result.result)
        GPUS.clear_environment()

        reply = {"execution_count": shell.execution_count - 1}
        if result.success:
            reply["status"] = "ok"
            reply["user_expressions"] = shell.user_expressions(user_expressions)
        else:
            err = result.error_before_exec or result.error_in_exec
            shown = shell._last_error or {}
            reply.update({
                "status": "error",
                "ename": shown.get("ename", type(err).__name__),
                "evalue": shown.get("evalue", str(err)),
                "traceback": shown.get("traceback", []),
                "user_expressions": {},
            })
        reply["payload"] = shell.payload_manager.read_payload()
        shell.payload_manager.clear_payload()
        return reply

    # --- replication (nbos replica) -------------------------------------------------------

    def namespace_digests(self, msg):
        """nbos_namespace_request: a digest per user name, to compare replicas' namespaces."""
        shell = self.shell
        hidden = set(shell.user_ns_hidden)
        digests = {}
        for name, value in list(shell.user_ns.items()):
            if name in hidden or name.startswith("_"):
                continue
            digests[name] = value_digest(value)
        return {"status": "ok", "digests": digests,
                "execution_count": shell.execution_count}

    def enable_replication(self, store, replica_id):
        """Record each cell's namespace delta; large buffers go to `store`."""
        import nbos_state

        # The live dict, so names IPython hides later are skipped too.
        self.sync = nbos_state.StateSync(self.shell.user_ns, self.shell.user_ns_hidden, store,
                                         replica_id=replica_id)
        # _begin_sync needs the transformed source before run_cell transforms the same cell:
        # run_cell gets the result of the first call instead of transforming twice.
        self._transformed = None
        transform = self.shell.transform_cell

        def transform_once(raw_cell):
            memo, self._transformed = self._transformed, None
            if memo is not None and memo[0] is raw_cell:
                return memo[1]
            return transform(raw_cell)

        self.shell.transform_cell = transform_once

    def _begin_sync(self, code):
        if self.sync is None:
            return None
        try:
            source = self.shell.transform_cell(code)
            self._transformed = (code, source)
        except Exception:
            source = code
        # Process state outside the namespace that cells change and users rely on.
        # os.environ's encoded mapping: copied at C speed, decoded only where the cell changed it.
        self._process_before = (_cwd(), os.environ._data.copy(), list(sys.path))
        self._cell_code = code
        self._cell_source = source
        return self.sync.begin(source)

    def _end_sync(self, token, output):
        if self.sync is None:
            return
        delta, not_replicated = self.sync.end(token, output)
        for problem in not_replicated:
            print(problem.message(), file=sys.stderr)
        if self.sync.store_fallback is not None:
            message = self.sync.store_fallback.message()
            print(message, file=sys.stderr)
            _nbos.log_warning(message)
        self._delta = delta
        self._side_effects = self._process_changes()
        _merge_side_effects(self._process_state, self._side_effects)

    _REPLAYED = re.compile(r"^\s*[%!]\s*(pip|conda|mamba)\s+(install|uninstall)\b.*$",
                           re.MULTILINE)

    def _process_changes(self):
        """What the cell changed outside the namespace: cwd, environment, sys.path, and package
        installs, which every replica must repeat on its own host."""
        cwd, env, path = self._process_before
        changes = {}
        now_cwd = _cwd()
        if now_cwd is not None and now_cwd != cwd:
            changes["cwd"] = now_cwd
        now = os.environ._data
        if now != env:
            key, value = os.environ.decodekey, os.environ.decodevalue
            env_set = {key(k): value(v) for k, v in now.items() if env.get(k) != v}
            env_unset = [key(k) for k in env if k not in now]
            if env_set:
                changes["env_set"] = env_set
            if env_unset:
                changes["env_unset"] = env_unset
        if list(sys.path) != path:
            changes["sys_path"] = list(sys.path)
        replay = [m.group(0).strip() for m in self._REPLAYED.finditer(self._cell_code)]
        if replay:
            changes["replay"] = replay
        if self._cell_source != _as_compiled(self._cell_code):
            changes["source"] = self._cell_source  # for the standbys' compiler cache
        return changes

    def take_delta(self):
        delta, self._delta = self._delta, None
        return delta or b""

    def take_side_effects(self):
        changes, self._side_effects = self._side_effects, None
        return json.dumps(changes) if changes else ""

    def apply_delta(self, delta, replaying=False):
        """Applies another replica's delta; returns divergence(). The cell's output joins the
        output history (Out, _, _N) as on the executor, unless `replaying` a journal (the
        execution count does not follow the records then)."""
        with _warnings_to_log():
            self._report_unrebuilt(self.sync.apply(delta))
        output = self.sync.take_output()
        if output is not None and not replaying:
            self.shell.displayhook.update_user_ns(output)
        return self.divergence()

    @staticmethod
    def _report_unrebuilt(problems):
        # Standbys publish nothing: this goes to the replica's log.
        if problems:
            _nbos.log_warning("nbos: could not rebuild on this replica: " +
                              "; ".join(p.message() for p in problems))

    def divergence(self):
        """"" while this namespace holds every value the log bound; else which names could not be
        rebuilt here, and why (for the replica's replies: it may not run cells)."""
        unrebuilt = self.sync.unrebuilt if self.sync is not None else {}
        if not unrebuilt:
            return ""
        import nbos_state_wire

        shown = sorted(unrebuilt.items())[:5]
        text = "; ".join(f"{nbos_state_wire.readable_name(name)} ({why})" for name, why in shown)
        if len(unrebuilt) > len(shown):
            text += f"; and {len(unrebuilt) - len(shown)} more"
        return f"{len(unrebuilt)} name(s) could not be rebuilt on this replica: {text}"

    def apply_side_effects(self, changes_json):
        changes = json.loads(changes_json)
        _merge_side_effects(self._process_state, changes)
        self._standby_source = changes.get("source")
        if "cwd" in changes:
            try:
                os.chdir(changes["cwd"])
            except OSError as e:
                # The replica's log: fd 2 is captured and would reach the user's output.
                _nbos.log_warning(f"nbos: cannot change to {changes['cwd']} on this replica: {e}")
        os.environ.update(changes.get("env_set", {}))
        for k in changes.get("env_unset", []):
            os.environ.pop(k, None)
        if "sys_path" in changes:
            sys.path[:] = changes["sys_path"]
        if changes.get("replay"):
            from IPython.utils.capture import capture_output

            with capture_output():  # a standby publishes nothing
                for statement in changes["replay"]:
                    self.shell.run_cell(statement, store_history=False, silent=True)

    def finish_standby(self, meta_json):
        """After the executor's delta: the execution count and input history it left."""
        meta = json.loads(meta_json)
        count = meta.get("execution_count") or 0
        self._standby_source, source = None, self._standby_source
        if meta.get("store_history") and count:
            code = meta.get("code", "")
            shell = self.shell
            hm = shell.history_manager
            # A standby's inputs wait in IPython's cache: the history thread writes them when
            # this replica next runs a cell, when a history request or the end of the session
            # reads them, or once _STANDBY_HISTORY_BATCH have gathered.
            each_cell = hm.db_cache_size
            try:
                hm.db_cache_size = max(each_cell, _STANDBY_HISTORY_BATCH)
                _forget_history_from(hm, count)
                hm.store_inputs(count, code, code)
                # The cell's source under the name the executor compiled it with, so that
                # tracebacks and inspect.getsource of the functions it defined read as there.
                # (Transforming it here cost each standby a fifth of a millisecond per cell.)
                shell.compile.cache(source or _as_compiled(code), count, raw_code=code)
            except Exception:
                pass
            finally:
                hm.db_cache_size = each_cell
            shell.user_ns["_i%d" % count] = code
            shell.execution_count = count + 1

    def checkpoint(self):
        """The namespace, and what all side effects so far add up to (cwd, environment,
        sys.path, package installs): a replica restored from it gets both."""
        snapshot = self.sync.snapshot()
        if not self._process_state:
            return snapshot
        state = json.dumps(self._process_state).encode()
        return _CHECKPOINT_MAGIC + struct.pack("<I", len(state)) + state + snapshot

    def restore(self, checkpoint, records):
        """Rebuilds the namespace: a checkpoint, then ("delta"|"side_effect", bytes) records.
        Returns divergence()."""
        self._process_state = {}
        if checkpoint[:4] == _CHECKPOINT_MAGIC:
            (length,) = struct.unpack_from("<I", checkpoint, 4)
            # First: the namespace may need the cwd, sys.path or packages to unpickle.
            self.apply_side_effects(checkpoint[8:8 + length].decode())
            checkpoint = checkpoint[8 + length:]
        if checkpoint:
            with _warnings_to_log():
                self._report_unrebuilt(self.sync.restore(checkpoint))
        else:
            # No checkpoint yet: the state is the journal alone, replayed on an empty namespace
            # (this one may hold names the log does not, e.g. of a cell that could not commit).
            self.sync.reset()
        for kind, payload in records:
            if kind == "delta":
                self.apply_delta(payload, replaying=True)
            else:
                self.apply_side_effects(payload.decode())
        self._standby_source = None  # of a replayed cell, which no Done follows here
        return self.divergence()

    def complete(self, msg):
        from IPython.core.completer import provisionalcompleter, rectify_completions

        code = msg["content"].get("code", "")
        cursor_pos = msg["content"].get("cursor_pos")
        if cursor_pos is None:
            cursor_pos = len(code)
        with provisionalcompleter():
            raw = self.shell.Completer.completions(code, cursor_pos)
            completions = list(rectify_completions(code, raw))
        types = [
            {"start": c.start, "end": c.end, "text": c.text, "type": c.type,
             "signature": c.signature}
            for c in completions
        ]
        start = completions[0].start if completions else cursor_pos
        end = completions[0].end if completions else cursor_pos
        return {
            "status": "ok",
            "matches": [c.text for c in completions],
            "cursor_start": start,
            "cursor_end": end,
            "metadata": {"_jupyter_types_experimental": types},
        }

    def inspect(self, msg):
        from IPython.utils.tokenutil import token_at_cursor

        content = msg["content"]
        code = content.get("code", "")
        cursor_pos = content.get("cursor_pos", len(code))
        name = token_at_cursor(code, cursor_pos)
        reply = {"status": "ok", "found": False, "data": {}, "metadata": {}}
        try:
            reply["data"] = self.shell.object_inspect_mime(
                name, detail_level=content.get("detail_level", 0))
            reply["found"] = True
        except KeyError:
            pass
        return reply

    def is_complete(self, msg):
        status, indent = self.shell.input_transformer_manager.check_complete(
            msg["content"].get("code", ""))
        reply = {"status": status}
        if status == "incomplete":
            reply["indent"] = " " * (indent or 0)
        return reply

    def history(self, msg):
        c = msg["content"]
        hm = self.shell.history_manager
        raw, output = c.get("raw", True), c.get("output", False)
        kind = c.get("hist_access_type", "tail")
        if kind == "tail":
            hist = hm.get_tail(c.get("n", 10), raw=raw, output=output, include_latest=True)
        elif kind == "range":
            hist = hm.get_range(c.get("session", 0), c.get("start", 1), c.get("stop"),
                                raw=raw, output=output)
        elif kind == "search":
            hist = hm.search(c.get("pattern", "*"), raw=raw, output=output, n=c.get("n"),
                             unique=c.get("unique", False))
        else:
            hist = []
        return {"status": "ok", "history": list(hist)}

    def comm_info(self, msg):
        return {"status": "ok", "comms": comm_manager.comm_info(msg["content"].get("target_name"))}

    def comm_open(self, msg):
        comm_manager.comm_open(msg)

    def comm_msg(self, msg):
        comm_manager.comm_msg(msg)

    def comm_close(self, msg):
        comm_manager.comm_close(msg)

    def shutdown(self):
        try:
            self.shell.atexit_operations()
        except Exception:
            pass
