"""Behaviour of `nbos kernel` that users and Jupyter clients rely on beyond the message catalogue:
interrupts, shutdown, stdin, stop_on_error, comms, output capture, and what happens to bad input.

Each test starts a real `nbos kernel` process on a fresh connection file and talks to it with
jupyter_client, the library every Jupyter frontend is built on.
"""

import ast
import contextlib
import json
import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import zmq
from jupyter_client import BlockingKernelClient
from jupyter_client.connect import write_connection_file
from jupyter_client.session import Session

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from conftest import nbos_bin  # noqa: E402

TIMEOUT = 30


class Kernel:
    """A kernel process we own, with its stderr captured for log assertions."""

    def __init__(self, extra_env=None):
        self.dir = tempfile.mkdtemp(prefix="nbos-kernel-test-")
        self.connection_file = os.path.join(self.dir, "kernel.json")
        self.key = uuid.uuid4().hex
        write_connection_file(self.connection_file, key=self.key.encode())
        self.stderr_path = os.path.join(self.dir, "stderr.log")
        env = dict(os.environ)
        env.update(extra_env or {})
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [nbos_bin(), "kernel", "-f", self.connection_file, "--log-level", "info"],
                stderr=err, stdout=subprocess.DEVNULL, cwd=self.dir, env=env)
        self.client = BlockingKernelClient(connection_file=self.connection_file)
        self.client.load_connection_file()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=TIMEOUT)

    def stderr(self):
        return pathlib.Path(self.stderr_path).read_text(errors="replace")

    def execute(self, code, **kwargs):
        """Runs code, returns (reply content, list of iopub messages for it)."""
        outputs = []
        reply = self.client.execute_interactive(code, output_hook=outputs.append,
                                                timeout=TIMEOUT, **kwargs)
        return reply["content"], outputs

    def control_request(self, msg_type, content=None):
        msg = self.client.session.msg(msg_type, content or {})
        self.client.control_channel.send(msg)
        return msg["header"]["msg_id"]

    def get_control_reply(self, msg_id, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self.client.get_control_msg(timeout=deadline - time.monotonic())
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply
        raise TimeoutError(msg_id)

    def wait_exit(self, timeout=TIMEOUT):
        return self.proc.wait(timeout=timeout)

    def close(self):
        self.client.stop_channels()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def kernel():
    k = Kernel()
    yield k
    k.close()


def stream_text(outputs, name="stdout"):
    return "".join(m["content"]["text"] for m in outputs
                   if m["msg_type"] == "stream" and m["content"]["name"] == name)


def wait_reply(client, msg_id, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        reply = client.get_shell_msg(timeout=max(0.01, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply


def test_execute_result_and_stream(kernel):
    reply, outputs = kernel.execute("print('hi'); 6*7")
    assert reply["status"] == "ok"
    assert stream_text(outputs) == "hi\n"
    results = [m for m in outputs if m["msg_type"] == "execute_result"]
    assert len(results) == 1 and results[0]["content"]["data"]["text/plain"] == "42"
    types = [m["msg_type"] for m in outputs]
    assert types[0] == "status" and types[-1] == "status"


def test_interrupt_request_on_control_interrupts_running_cell(kernel):
    msg_id = kernel.client.execute("import time\ntime.sleep(60)")
    time.sleep(1.0)
    started = time.monotonic()
    ctl = kernel.control_request("interrupt_request")
    assert kernel.get_control_reply(ctl)["content"]["status"] == "ok"
    reply = wait_reply(kernel.client, msg_id)
    assert time.monotonic() - started < 10
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    reply, outputs = kernel.execute("1 + 1")
    assert reply["status"] == "ok"


def test_sigint_interrupts_running_cell_and_is_ignored_when_idle(kernel):
    kernel.proc.send_signal(signal.SIGINT)  # idle: must not poison the next cell
    time.sleep(0.3)
    reply, _ = kernel.execute("x = 5")
    assert reply["status"] == "ok"
    msg_id = kernel.client.execute("import time\nfor _ in range(600): time.sleep(0.1)")
    time.sleep(1.0)
    kernel.proc.send_signal(signal.SIGINT)
    reply = wait_reply(kernel.client, msg_id)
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    reply, outputs = kernel.execute("x")
    assert reply["status"] == "ok"


def test_control_answers_while_a_cell_runs(kernel):
    msg_id = kernel.client.execute("import time\ntime.sleep(5)")
    time.sleep(0.5)
    started = time.monotonic()
    ctl = kernel.control_request("kernel_info_request")
    info = kernel.get_control_reply(ctl, timeout=4)
    assert time.monotonic() - started < 4
    assert info["content"]["language_info"]["name"] == "python"
    assert wait_reply(kernel.client, msg_id)["content"]["status"] == "ok"


@pytest.mark.parametrize("restart", [False, True])
def test_shutdown_request_exits_cleanly(kernel, restart):
    ctl = kernel.control_request("shutdown_request", {"restart": restart})
    reply = kernel.get_control_reply(ctl)
    assert reply["content"] == {"status": "ok", "restart": restart}
    assert kernel.wait_exit() == 0


def test_shutdown_while_cell_runs(kernel):
    kernel.client.execute("import time\ntime.sleep(60)")
    time.sleep(0.5)
    ctl = kernel.control_request("shutdown_request", {"restart": False})
    assert kernel.get_control_reply(ctl)["content"]["status"] == "ok"
    assert kernel.wait_exit(timeout=15) == 0


def test_kernel_exits_when_parent_dies():
    parent = subprocess.Popen(["sleep", "1"])
    k = Kernel(extra_env={"JPY_PARENT_PID": str(parent.pid)})
    try:
        parent.wait()
        assert k.wait_exit(timeout=15) == 0
    finally:
        k.close()


def raw_shell_socket(kernel):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{kernel.client.shell_port}")
    return sock


def test_wrongly_signed_and_unsigned_messages_are_dropped_and_counted(kernel):
    marker = os.path.join(kernel.dir, "should-not-exist")
    code = f"open({marker!r}, 'w').write('x')"
    sock = raw_shell_socket(kernel)
    try:
        for key in (b"wrong-key", b""):
            session = Session(key=key)
            session.send(sock, "execute_request",
                         {"code": code, "silent": False, "store_history": True,
                          "user_expressions": {}, "allow_stdin": False})
        assert sock.poll(1500) == 0, "a reply came back for a forged request"
    finally:
        sock.close()
    assert not os.path.exists(marker)
    reply, _ = kernel.execute("2 + 2")
    assert reply["status"] == "ok"
    assert "invalid signature (total 2)" in kernel.stderr()


def test_malformed_messages_do_not_crash_the_kernel(kernel):
    sock = raw_shell_socket(kernel)
    try:
        sock.send_multipart([b"no delimiter at all"])
        sock.send_multipart([b"<IDS|MSG>", b"sig", b"{}"])
        sock.send_multipart([b"<IDS|MSG>", b"", b"not json", b"{}", b"{}", b"{}"])
        sock.send_multipart([b"<IDS|MSG>", b"", b"\xff\xfe", b"{}", b"{}", b"{}"])
        time.sleep(0.5)
    finally:
        sock.close()
    reply, _ = kernel.execute("'still alive'")
    assert reply["status"] == "ok"
    assert kernel.proc.poll() is None
    assert "malformed shell message" in kernel.stderr()


def test_unknown_request_gets_an_error_reply(kernel):
    msg = kernel.client.session.msg("frobnicate_request", {})
    kernel.client.shell_channel.send(msg)
    reply = wait_reply(kernel.client, msg["header"]["msg_id"])
    assert reply["msg_type"] == "frobnicate_reply"
    assert reply["content"]["status"] == "error"


def test_input_and_getpass_round_trip_over_stdin(kernel):
    code = "import getpass\nname = input('name? ')\npw = getpass.getpass('pw: ')\nprint(name, pw)"
    msg_id = kernel.client.execute(code, allow_stdin=True)
    prompts = []
    for answer in ("ada", "secret"):
        req = kernel.client.get_stdin_msg(timeout=TIMEOUT)
        assert req["msg_type"] == "input_request"
        assert req["parent_header"]["msg_id"] == msg_id
        prompts.append((req["content"]["prompt"], req["content"]["password"]))
        kernel.client.input(answer)
    assert prompts == [("name? ", False), ("pw: ", True)]
    assert wait_reply(kernel.client, msg_id)["content"]["status"] == "ok"
    reply, outputs = kernel.execute("name, pw")
    result = [m for m in outputs if m["msg_type"] == "execute_result"][0]
    assert result["content"]["data"]["text/plain"] == "('ada', 'secret')"


def test_input_without_allow_stdin_raises(kernel):
    reply, _ = kernel.execute("input('x')", allow_stdin=False)
    assert reply["status"] == "error"
    assert reply["ename"] == "StdinNotImplementedError"


def test_interrupt_while_waiting_for_input(kernel):
    msg_id = kernel.client.execute("input('waiting')", allow_stdin=True)
    kernel.client.get_stdin_msg(timeout=TIMEOUT)
    ctl = kernel.control_request("interrupt_request")
    kernel.get_control_reply(ctl)
    reply = wait_reply(kernel.client, msg_id)
    assert reply["content"]["ename"] == "KeyboardInterrupt"


def test_stop_on_error_aborts_queued_executions(kernel):
    first = kernel.client.execute("import time; time.sleep(0.5); 1/0")
    second = kernel.client.execute("print('must not run')")
    third = kernel.client.execute("print('runs')", stop_on_error=False)
    assert wait_reply(kernel.client, first)["content"]["status"] == "error"
    assert wait_reply(kernel.client, second)["content"]["status"] == "aborted"
    assert wait_reply(kernel.client, third)["content"]["status"] == "aborted"
    reply, outputs = kernel.execute("print('after')")
    assert reply["status"] == "ok" and stream_text(outputs) == "after\n"


def test_errors_without_stop_on_error_do_not_abort(kernel):
    first = kernel.client.execute("1/0", stop_on_error=False)
    second = kernel.client.execute("print('runs')")
    assert wait_reply(kernel.client, first)["content"]["status"] == "error"
    assert wait_reply(kernel.client, second)["content"]["status"] == "ok"


def test_stream_output_is_coalesced(kernel):
    reply, outputs = kernel.execute("for i in range(200):\n    print(i)")
    streams = [m for m in outputs if m["msg_type"] == "stream"]
    assert stream_text(outputs) == "".join(f"{i}\n" for i in range(200))
    assert len(streams) <= 2


def test_output_written_to_file_descriptors_is_captured(kernel):
    code = ("import os, ctypes\n"
            "os.write(1, b'fd-one\\n')\n"
            "os.write(2, b'fd-two\\n')\n"
            "ctypes.CDLL(None).puts(b'from-libc')\n"
            "os.system('echo from-child')\n"
            "!echo from-bang")
    reply, outputs = kernel.execute(code)
    assert reply["status"] == "ok"
    out = stream_text(outputs)
    for text in ("fd-one\n", "from-libc\n", "from-child\n", "from-bang"):
        assert text in out
    assert stream_text(outputs, "stderr") == "fd-two\n"


def test_multibyte_output_survives_pipe_chunking(kernel):
    reply, outputs = kernel.execute("import os\nos.write(1, ('€' * 50000).encode())")
    assert stream_text(outputs) == "€" * 50000


def test_comms(kernel):
    setup = (
        "def _target(comm, msg):\n"
        "    comm.send({'opened': msg['content']['data']})\n"
        "    @comm.on_msg\n"
        "    def _echo(m):\n"
        "        comm.send({'echo': m['content']['data']})\n"
        "get_ipython().kernel.comm_manager.register_target('echo', _target)\n")
    assert kernel.execute(setup)[0]["status"] == "ok"
    client = kernel.client
    client.iopub_channel.get_msgs()

    def iopub_of(msg_type, parent_id):
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            m = client.get_iopub_msg(timeout=deadline - time.monotonic())
            if m["msg_type"] == msg_type and m["parent_header"].get("msg_id") == parent_id:
                return m
        raise TimeoutError(msg_type)

    open_msg = client.session.msg("comm_open", {"comm_id": "c1", "target_name": "echo",
                                                "data": {"hello": 1}})
    client.shell_channel.send(open_msg)
    assert iopub_of("comm_msg", open_msg["header"]["msg_id"])["content"]["data"] == {
        "opened": {"hello": 1}}
    msg = client.session.msg("comm_msg", {"comm_id": "c1", "data": {"x": 2}})
    client.shell_channel.send(msg)
    assert iopub_of("comm_msg", msg["header"]["msg_id"])["content"]["data"] == {"echo": {"x": 2}}

    info = client.comm_info(target_name="echo", reply=True, timeout=TIMEOUT)
    assert info["content"]["comms"] == {"c1": {"target_name": "echo"}}

    unknown = client.session.msg("comm_open", {"comm_id": "c2", "target_name": "nope",
                                               "data": {}})
    client.shell_channel.send(unknown)
    closed = iopub_of("comm_close", unknown["header"]["msg_id"])
    assert closed["content"]["comm_id"] == "c2"


def test_display_update_and_clear(kernel):
    code = ("from IPython.display import display, clear_output\n"
            "h = display('first', display_id='d1')\n"
            "h.update('second')\n"
            "clear_output(wait=True)\n")
    reply, outputs = kernel.execute(code)
    types = [m["msg_type"] for m in outputs if m["msg_type"] != "status"]
    assert types == ["execute_input", "display_data", "update_display_data", "clear_output"]
    assert outputs[2]["content"]["transient"] == {"display_id": "d1"}


def test_magics_and_history_cache(kernel):
    reply, outputs = kernel.execute("%cd /tmp")
    assert reply["status"] == "ok"
    reply, outputs = kernel.execute("import os; os.getcwd()")
    assert [m for m in outputs if m["msg_type"] == "execute_result"][0]["content"]["data"][
        "text/plain"] == "'/tmp'"
    kernel.execute("40 + 2")
    reply, outputs = kernel.execute("Out[3], _3, In[3]")
    result = [m for m in outputs if m["msg_type"] == "execute_result"][0]
    assert result["content"]["data"]["text/plain"] == "(42, 42, '40 + 2')"
    hist = kernel.client.history(hist_access_type="tail", n=2, output=False, raw=True,
                                 reply=True, timeout=TIMEOUT)
    assert [h[2] for h in hist["content"]["history"]] == ["40 + 2", "Out[3], _3, In[3]"]


def test_each_cell_reaches_the_history_database_without_a_disk_sync(kernel):
    marker = f"history_marker_{uuid.uuid4().hex}"
    reply, outputs = kernel.execute(
        f"{marker} = 1\nhm = get_ipython().history_manager\n"
        "str(hm.hist_file), hm.db.execute('PRAGMA synchronous').fetchone()[0]")
    result = [m for m in outputs if m["msg_type"] == "execute_result"][0]
    hist_file, synchronous = ast.literal_eval(result["content"]["data"]["text/plain"])
    assert synchronous == 0  # OFF: commits do not wait for the disk
    # Still written cell by cell (not batched), by IPython's saving thread.
    deadline = time.monotonic() + TIMEOUT
    while True:
        with contextlib.closing(sqlite3.connect(hist_file)) as db:
            rows = db.execute("SELECT source_raw FROM history WHERE source_raw LIKE ?",
                              (f"{marker} = 1%",)).fetchall()
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert rows, f"no history row for the cell in {hist_file}"


def test_silent_execution_keeps_count_and_publishes_nothing(kernel):
    kernel.execute("1")
    reply, outputs = kernel.execute("2", silent=True)
    assert reply["execution_count"] == 1
    assert [m["msg_type"] for m in outputs] == ["status", "status"]
    reply, _ = kernel.execute("3")
    assert reply["execution_count"] == 2


def test_user_expressions_and_payloads(kernel):
    reply, _ = kernel.execute("a = 6", user_expressions={"double": "a * 2", "bad": "nope"})
    exprs = reply["user_expressions"]
    assert exprs["double"]["data"]["text/plain"] == "12"
    assert exprs["bad"]["status"] == "error" and exprs["bad"]["ename"] == "NameError"
    reply, _ = kernel.execute("get_ipython().set_next_input('next cell')")
    assert reply["payload"] == [{"source": "set_next_input", "text": "next cell",
                                 "replace": False}]


def test_shutdown_does_not_wait_for_user_threads(kernel):
    code = ("import threading, time\n"
            "threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()")
    assert kernel.execute(code)[0]["status"] == "ok"
    ctl = kernel.control_request("shutdown_request", {"restart": False})
    kernel.get_control_reply(ctl)
    assert kernel.wait_exit(timeout=15) == 0



def test_restart_through_kernel_manager_gives_a_fresh_kernel(kernelspec_dir):
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="nbos")
    km.start_kernel()
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=TIMEOUT)
        kc.execute_interactive("x = 1", timeout=TIMEOUT)
        first = kc.kernel_info(reply=True, timeout=TIMEOUT)["header"]["session"]
        old_pid = km.provisioner.process.pid
        km.restart_kernel(now=False)
        kc.wait_for_ready(timeout=TIMEOUT)
        assert km.provisioner.process.pid != old_pid
        info = kc.kernel_info(reply=True, timeout=TIMEOUT)
        assert info["header"]["session"] != first
        reply = kc.execute_interactive("'x' in dir()", timeout=TIMEOUT)
        assert reply["content"]["execution_count"] == 1
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=False)
    assert not km.is_alive()


def test_kernelspec_install_locations(tmp_path):
    env = dict(os.environ, JUPYTER_DATA_DIR=str(tmp_path / "data"))
    subprocess.run([nbos_bin(), "kernelspec", "install", "--user", "--name", "nbos-test"],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    spec = json.loads((tmp_path / "data/kernels/nbos-test/kernel.json").read_text())
    assert spec["argv"][1:] == ["kernel", "-f", "{connection_file}"]
    assert os.path.samefile(spec["argv"][0], nbos_bin())
    assert spec["language"] == "python"
    subprocess.run([nbos_bin(), "kernelspec", "install", "--prefix", str(tmp_path / "p")],
                   check=True, stdout=subprocess.DEVNULL)
    assert (tmp_path / "p/share/jupyter/kernels/nbos/kernel.json").exists()
    bad = subprocess.run([nbos_bin(), "kernelspec", "install", "--prefix", str(tmp_path),
                          "--name", "../escape"], capture_output=True, text=True)
    assert bad.returncode != 0 and "kernelspec name" in bad.stderr


def test_bad_connection_files_are_clear_errors(tmp_path):
    missing = subprocess.run([nbos_bin(), "kernel", "-f", str(tmp_path / "nope.json")],
                             capture_output=True, text=True, timeout=TIMEOUT)
    assert missing.returncode == 2 and "cannot read connection file" in missing.stderr
    broken = tmp_path / "broken.json"
    broken.write_text('{"shell_port": 1}')
    result = subprocess.run([nbos_bin(), "kernel", "-f", str(broken)], capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 2 and "iopub_port" in result.stderr
