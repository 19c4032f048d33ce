"""A battery of malformed REST and WebSocket input, from an authenticated client, sent to one
kernel while another kernel keeps executing: every bad request gets a clear error (an HTTP 4xx
with a JSON message, a Jupyter error reply, or a WebSocket close with 1007/1009), counters in
/metrics move, the gateway process stays the same, and the other kernel's state and output
stream are untouched."""

import json
import re
import threading
import urllib.request

import websocket

from cluster import KernelSocket


def gateway_pid(cluster):
    pids = [pid for pid, cmd in cluster.nbos_processes() if " gateway " in cmd]
    assert len(pids) == 1, pids
    return pids[0]


def metric_values(cluster, name):
    req = urllib.request.Request(cluster.url + "/metrics",
                                 headers={"Authorization": f"token {cluster.token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    values = {}
    for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        values[m.group(1) or ""] = float(m.group(2))
    return values


class Steady:
    """Kernel B: cells that print a counter in steps, one after another, on their own socket."""

    def __init__(self, cluster, kernel_id):
        self.ks = KernelSocket(cluster.url, kernel_id, cluster.token)
        reply, _ = self.ks.execute("state = {'kept': 41}")
        assert reply["content"]["status"] == "ok"
        self.outputs, self.replies, self.error = [], [], None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)
        self.thread.start()

    def run(self):
        try:
            cell = 0
            while not self.stop.is_set() or cell < 2:
                code = (f"import time\nfor i in range(20):\n    print('{cell}:%d' % i, flush=True)\n"
                        "    time.sleep(0.02)")
                reply, iopub = self.ks.execute(code)
                self.replies.append(reply["content"]["status"])
                text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
                self.outputs.append((cell, text))
                cell += 1
        except Exception as e:  # reported by finish()
            self.error = e

    def finish(self):
        self.stop.set()
        self.thread.join(timeout=300)
        assert not self.thread.is_alive()
        assert self.error is None, self.error
        assert self.replies and set(self.replies) == {"ok"}, self.replies
        for cell, text in self.outputs:
            assert text == "".join(f"{cell}:{i}\n" for i in range(20)), (cell, text)
        reply, iopub = self.ks.execute("state['kept'] += 1\nprint(state)")
        assert reply["content"]["status"] == "ok"
        assert [m["content"]["text"] for m in iopub if m["msg_type"] == "stream"] == [
            "{'kept': 42}\n"]
        self.ks.close()


def close_code(ws):
    """Reads until the server's close frame; its code."""
    while True:
        opcode, data = ws.recv_data(control_frame=True)
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            return int.from_bytes(data[:2], "big")


def raw_close_code(sock):
    """The close code among the frames left on a socket the client can no longer write to (the
    client library would answer the close frame and fail)."""
    data = b""
    sock.settimeout(30)
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, OSError):
            chunk = b""
        if not chunk:
            break
        data += chunk
    pos = 0
    while pos + 2 <= len(data):
        opcode, length = data[pos] & 0x0F, data[pos + 1] & 0x7F
        pos += 2
        if length == 126:
            length, pos = int.from_bytes(data[pos:pos + 2], "big"), pos + 2
        elif length == 127:
            length, pos = int.from_bytes(data[pos:pos + 8], "big"), pos + 8
        if opcode == 0x8:
            return int.from_bytes(data[pos:pos + 2], "big")
        pos += length
    return None


def bad_rest_requests(cluster, kernel_id):
    cases = [
        ("POST", "/api/kernels", {"name": 5}, None, 400, "name"),
        ("POST", "/api/kernels", {"name": {"a": 1}}, None, 400, "name"),
        ("POST", "/api/kernels", {"env": "KERNEL_GPUS=1"}, None, 400, "env"),
        ("POST", "/api/kernels", {"env": {"KERNEL_GPUS": 1}}, None, 400, "KERNEL_GPUS"),
        ("POST", "/api/kernels", {"env": {"KERNEL_MEMORY": "lots"}}, None, 400, "KERNEL_MEMORY"),
        ("POST", "/api/kernels", {"env": {"KERNEL_CPUS": "-1"}}, None, 400, "KERNEL_CPUS"),
        ("POST", "/api/kernels", None, b"[1, 2]", 400, "object"),
        ("POST", "/api/kernels", None, b"null", 400, "object"),
        ("POST", "/api/kernels", None, b"[" * 5000 + b"]" * 5000, 400, "nested"),
        ("POST", "/api/kernels", None, b"\xff\xfe{", 400, "JSON"),
        ("POST", "/api/kernels", {"name": "x" * 10000}, None, 404, "kernelspec"),
        ("GET", "/api/kernels/%00%ff..%2F", None, None, 404, "no kernel"),
        ("DELETE", "/api/kernels/" + "z" * 3000, None, None, 404, "no kernel"),
        ("POST", f"/api/kernels/{kernel_id}x/restart", {"x": [1]}, None, 404, "no kernel"),
        ("POST", "/api/kernels/nope/interrupt", None, b"garbage", 404, "no kernel"),
        ("GET", "/api/kernelspecs/%E2%98%83", None, None, 404, "kernelspec"),
    ]
    for method, path, body, raw, status, words in cases:
        got, answer = cluster.request(method, path, body=body, raw=raw)
        assert got == status, (method, path, got, answer)
        assert isinstance(answer, dict) and words in answer["message"], (path, answer)
    # A kernel's own routes accept junk bodies they do not read.
    got, _ = cluster.request("POST", f"/api/kernels/{kernel_id}/interrupt", raw=b"{{{{")
    assert got == 204
    return sum(1 for c in cases if 400 <= c[4] < 500)


def frame(channel, msg_type, msg_id, content, metadata=None, header_extra=None):
    header = {"msg_id": msg_id, "msg_type": msg_type, "session": "bad-client",
              "username": "test", "version": "5.3", "date": "2024-01-01T00:00:00.000000Z"}
    header.update(header_extra or {})
    m = {"header": header, "parent_header": {}, "metadata": metadata or {},
         "content": content, "buffers": []}
    if channel is not None:
        m["channel"] = channel
    return json.dumps(m)


# (frame, channel of the expected reply, reply type, ename), each answered without closing.
ANSWERED = [
    (frame("shell", "execute_request", "a1", {"code": "1", "stop_on_error": "yes"}),
     "shell", "execute_reply", "InvalidRequest"),
    (frame("control", "shutdown_request", "a2", {"restart": "no"}),
     "control", "shutdown_reply", "InvalidRequest"),
    (frame("shell", "execute_request", "a3", {"code": 5}), "shell", "execute_reply",
     "InvalidRequest"),
    (frame("shell", "execute_request", "a4", {}), "shell", "execute_reply", "InvalidRequest"),
    (frame("shell", "complete_request", "a5", {"code": "x", "cursor_pos": "end"}),
     "shell", "complete_reply", "InvalidRequest"),
    (frame("shell", "history_request", "a6", {"hist_access_type": 3}),
     "shell", "history_reply", "InvalidRequest"),
    (frame("bogus", "execute_request", "a7", {"code": "1"}), "shell", "execute_reply",
     "InvalidRequest"),
    (frame("shell", "frobnicate_request", "a8", {}), "shell", "frobnicate_reply",
     "UnsupportedRequest"),
    (frame("control", "nbos_membership_request", "a9", {"op": "remove", "replica_id": 1}),
     "control", "nbos_membership_reply", "UnsupportedRequest"),
    (frame("control", "nbos_cancel_request", "a10", {"exec_id": "x"}),
     "control", "nbos_cancel_reply", "UnsupportedRequest"),
    (frame("shell", "execute_request", "a11", {"code": "1"}, {"nbos": {"gpus": 10 ** 9}}),
     "shell", "execute_reply", "ResourceError"),
    (frame("shell", "execute_request", "a12", {"code": "1"}, {"nbos": {"gpus": 64}}),
     "shell", "execute_reply", "ResourceError"),
    (frame("shell", "execute_request", "a13", {"code": "1"}, {"nbos": {"target_replica": -2}}),
     "shell", "execute_reply", "InvalidRequest"),
    (frame("shell", "execute_request", "a14", "print(1)"), "shell", "execute_reply",
     "InvalidRequest"),
    (frame("shell", "kernel_info_request", "a15", {}, header_extra={"session": 12}),
     "shell", "kernel_info_reply", "InvalidRequest"),
    (frame("shell", "inspect_request", "a16", {"code": "x", "cursor_pos": -4}),
     "shell", "inspect_reply", "InvalidRequest"),
]

# Frames that cannot be a Jupyter message: (payload, binary, close code).
CLOSED = [
    ("{not json", False, 1007),
    ("[1, 2, 3]", False, 1007),
    (json.dumps({"channel": "shell", "header": {}}), False, 1007),
    (json.dumps({"header": {"msg_id": 7, "msg_type": "execute_request"}}), False, 1007),
    ('{"header": {"msg_id": "d", "msg_type": "x"}, "content": ' + "[" * 100000
     + "]" * 100000 + "}", False, 1007),
    (b"\x00\x00\x00\x05garbage", True, 1007),
    (b"\x00\x00\x00\x02\x00\x00\x00\x10\xff\xff\xff\xff{}", True, 1007),
]


def test_malformed_input_changes_nothing_for_anyone_else(cluster):
    a = cluster.start_kernel()
    b = cluster.start_kernel()
    pid = gateway_pid(cluster)
    rejected_before = metric_values(cluster, "nbos_client_messages_rejected_total")
    rest_before = metric_values(cluster, "nbos_rest_requests_rejected_total").get("", 0)
    steady = Steady(cluster, b)
    try:
        rest_refused = bad_rest_requests(cluster, a)
        ks = KernelSocket(cluster.url, a, cluster.token)
        for payload, channel, reply_type, ename in ANSWERED:
            ks.ws.send(payload)
            msg_id = json.loads(payload)["header"]["msg_id"]
            reply = next_reply(ks, msg_id)
            assert reply["channel"] == channel, (payload[:80], reply)
            assert reply["msg_type"] == reply_type, (payload[:80], reply)
            assert reply["content"]["status"] == "error", reply
            assert reply["content"]["ename"] == ename, (payload[:80], reply["content"])
        # The same socket still runs cells.
        reply, _ = ks.execute("a_value = 7")
        assert reply["content"]["status"] == "ok"
        for payload, binary, code in CLOSED:
            bad = KernelSocket(cluster.url, a, cluster.token)
            if binary:
                bad.ws.send_binary(payload)
            else:
                bad.ws.send(payload)
            assert close_code(bad.ws) == code, payload[:60]
            bad.close()
        # Over the gateway's 64 MiB message limit.
        bad = KernelSocket(cluster.url, a, cluster.token)
        try:
            bad.ws.send(b"x" * ((64 << 20) + 1), opcode=websocket.ABNF.OPCODE_BINARY)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway refused it from its length, before the whole frame arrived
        assert raw_close_code(bad.ws.sock) == 1009
        bad.close()
        reply, iopub = ks.execute("print(a_value)")
        assert reply["content"]["status"] == "ok"
        assert [m["content"]["text"] for m in iopub if m["msg_type"] == "stream"] == ["7\n"]
        ks.close()
    finally:
        steady.finish()
        for k in (a, b):
            cluster.request("DELETE", f"/api/kernels/{k}")
    assert gateway_pid(cluster) == pid, "the gateway process changed"
    rejected = metric_values(cluster, "nbos_client_messages_rejected_total")
    moved = {k: rejected[k] - rejected_before.get(k, 0) for k in rejected}
    for reason, at_least in (("field", 9), ("channel", 1), ("msg_type", 3), ("resources", 1),
                             ("frame", 6), ("too_deep", 1)):
        assert moved[f'{{reason="{reason}"}}'] >= at_least, (reason, moved)
    rest_after = metric_values(cluster, "nbos_rest_requests_rejected_total").get("", 0)
    assert rest_after - rest_before >= rest_refused


def next_reply(ks, msg_id):
    """The shell or control reply to `msg_id`, skipping its iopub messages."""
    while True:
        m = ks.recv()
        if (m["channel"] in ("shell", "control")
                and m.get("parent_header", {}).get("msg_id") == msg_id):
            return m
