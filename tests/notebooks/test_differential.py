"""Differential notebook tests: every notebook here runs on nbos and on ipykernel, and the
outputs must agree cell by cell. nbos runs twice: as the standalone kernel (`nbos kernel`), and
as a replicated kernel on `nbos up` (through the relay kernelspec) with the executor rotating
every cell (metadata nbos.target_replica 1, 2, 3, 1, ...), so that each cell runs on another
replica than the cell before, as after a migration or a failover.

The kernels execute the same notebook through nbclient at the same time (each in its own
temporary working directory; the replicated kernel's lies in the cluster's workspace). The comparison covers each code cell's final outputs (after
nbclient applied clear_output and update_display_data), its execution_count, and the parts of the
execute_reply a frontend acts on (status, ename, evalue, execution_count, payload).

Normalisation removes only what legitimately differs between two runs or two processes:
  * the kernel's working directory (a different temporary directory per kernel);
  * memory addresses (0x7f...);
  * durations printed by %time / %timeit;
  * the file name a kernel compiles cell code under (ipykernel: /tmp/ipykernel_<pid>/<hash>.py,
    IPython: <ipython-input-N-hash>), as seen in SyntaxError messages and warnings;
  * a traceback entry for a frame inside the kernel's own code (ipykernel's kernelbase.py, the
    nbos engine), e.g. where input() raises StdinNotImplementedError; the entry must still be
    there, in the same place;
  * PNG bytes, reduced to the image's width x height (the encoder output is not compared);
  * in a traceback, the background colour with which IPython (stack_data) marks the expression
    a frame was evaluating, where it can tell which one: whether it can for a library's frame
    called by a class rebuilt on another replica differs, the frame's text does not;
  * the order of stdout and stderr *within one run of consecutive stream outputs*: ipykernel
    flushes each stream on its own 200 ms timer and stdout first at the end of a cell, so the
    interleaving of the two streams is not defined by the reference kernel. The text of each
    stream, and the position of stream text relative to every other output, is compared exactly.
Consecutive stream outputs of one name are merged, since kernels may split text differently.

The replicated run may differ from ipykernel only in cells tagged for the documented
unreplicable objects (make_notebooks.py): `nbos-unreplicable` cells may add the executor's
"nbos: cannot replicate ..." lines on stderr; `nbos-not-replicated` cells must fail with
NotReplicatedError.

Set NBOS_DIFF_DUMP=DIR to write the executed notebooks of every kernel there for inspection.
"""

import asyncio
import base64
import copy
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile

import nbformat
import pytest
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "gateway"))
from cluster import Cluster  # noqa: E402

NOTEBOOKS = sorted(HERE.glob("*.ipynb"))
# python3 is ipykernel's system-wide kernelspec: the reference.
KERNELS = ("nbos", "nbos-replicated", "python3")
REPLICATED = "nbos-replicated"
CELL_TIMEOUT = 120
RAISES = "raises-exception"
UNREPLICABLE = "nbos-unreplicable"
NOT_REPLICATED = "nbos-not-replicated"


# ---------------------------------------------------------------------------------------------
# Execution


class RecordingClient(NotebookClient):
    """Keeps each code cell's execute_reply content; with `rotate`, sends each cell to the
    replica after the one that ran the cell before (nbos.target_replica)."""

    def __init__(self, *args, rotate=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.replies = {}
        self.on_cell_executed = self._record_reply
        if rotate:
            self.on_cell_execute = self._choose_replica

    def _record_reply(self, cell, cell_index, execute_reply):
        self.replies[cell_index] = execute_reply["content"]

    def _choose_replica(self, cell, cell_index):
        self._target = cell_index % 3 + 1
        channel = self.kc.shell_channel
        if getattr(channel, "_nbos_send", None) is None:
            channel._nbos_send = channel.send

            def send(msg):
                if msg["header"]["msg_type"] == "execute_request":
                    msg["metadata"].setdefault("nbos", {})["target_replica"] = self._target
                return channel._nbos_send(msg)

            channel.send = send


@pytest.fixture(scope="module")
def replicated_kernelspec():
    """`nbos up` and the relay kernelspec REPLICATED for it (the kernel runs in the notebook's
    directory, which lies in the cluster's workspace)."""
    cluster = Cluster(hosts=3, gpus_per_host=1)
    prefix = tempfile.mkdtemp(prefix="nbos-relay-kernelspec-")
    try:
        subprocess.run([os.environ.get("NBOS_BIN", "nbos"), "kernelspec", "install", "--prefix",
                        prefix, "--name", REPLICATED, "--gateway", cluster.url, "--token",
                        cluster.token, "--send-working-dir"], check=True,
                       stdout=subprocess.DEVNULL)
        share = os.path.join(prefix, "share", "jupyter")
        old_path = os.environ.get("JUPYTER_PATH", "")
        os.environ["JUPYTER_PATH"] = share + os.pathsep + old_path
        yield cluster.workspace
        os.environ["JUPYTER_PATH"] = old_path
    finally:
        assert cluster.stop() == 0
        shutil.rmtree(prefix, ignore_errors=True)


async def _run_one(path, kernel_name, workspace):
    nb = nbformat.read(str(path), as_version=4)
    workdir = os.path.realpath(tempfile.mkdtemp(
        prefix=f"nbdiff-{kernel_name}-", dir=workspace if kernel_name == REPLICATED else None))
    # allow_errors: every cell runs even if one fails unexpectedly; the status of each
    # execute_reply is compared, and the reference must fail only in tagged cells.
    client = RecordingClient(nb, kernel_name=kernel_name, timeout=CELL_TIMEOUT,
                             startup_timeout=60, allow_errors=True,
                             resources={"metadata": {"path": workdir}},
                             rotate=kernel_name == REPLICATED)
    error = None
    try:
        await client.async_execute()
    except Exception as e:  # kernel died, timeout, ...
        error = f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"nb": nb, "replies": client.replies, "workdir": workdir, "error": error}


async def _run_all(path, workspace):
    results = await asyncio.gather(*(_run_one(path, k, workspace) for k in KERNELS))
    return dict(zip(KERNELS, results))


# ---------------------------------------------------------------------------------------------
# Normalisation

_TEXT_RULES = [
    (re.compile(r"0x[0-9a-fA-F]{8,}"), "0x<ADDR>"),
    # %time
    (re.compile(r"CPU times: user [^,\n]+, sys: [^,\n]+, total: [^\n]+"), "CPU times: <TIMES>"),
    (re.compile(r"Wall time: [0-9.]+ ?\S+"), "Wall time: <TIME>"),
    # %timeit
    (re.compile(r"[0-9.]+ ?\S+ ± [0-9.]+ ?\S+ per loop"), "<TIME> ± <TIME> per loop"),
    # The file name a kernel compiles a cell under (seen in SyntaxError messages and warnings)
    # is an implementation detail: ipykernel uses /tmp/ipykernel_<pid>/<hash>.py (or just
    # <hash>.py), plain IPython <ipython-input-<n>-<hash>>.
    (re.compile(r"/tmp/ipykernel_\d+/\d+\.py"), "<CELL-FILE>"),
    (re.compile(r"(?<![\w/.])\d+\.py\b"), "<CELL-FILE>"),
    (re.compile(r"<ipython-input-\d+-[0-9a-f]+>"), "<CELL-FILE>"),
]

# A traceback entry for a frame inside the kernel's own code (e.g. where input() raises
# StdinNotImplementedError): its file, line and source necessarily differ between kernels.
_KERNEL_FRAME = re.compile(r'^\s*File (\x1b\[[0-9;]*m)?"?(\S*/ipykernel/|<nbos_engine>)')


# The background colour (ANSI 43 on, 49 off) of an expression a traceback frame marks, alone or
# after a foreground colour (`\x1b[38;5;28;43m`): the text stays, as do the foreground colours.
_EXPRESSION_MARK = re.compile(r"\x1b\[4[39]m|;4[39](?=[;m])")


def _normalise_text(text, workdir):
    if isinstance(text, list):
        text = "".join(text)
    text = text.replace(workdir, "<CWD>")
    for pattern, repl in _TEXT_RULES:
        text = pattern.sub(repl, text)
    return text


def _png_summary(data):
    raw = base64.b64decode(data)
    if raw[:8] != b"\x89PNG\r\n\x1a\n" or raw[12:16] != b"IHDR":
        return "<PNG invalid>"
    width, height = struct.unpack(">II", raw[16:24])
    return f"<PNG {width}x{height}>"


def _normalise_bundle(data, workdir):
    out = {}
    for mime, value in data.items():
        if mime == "image/png":
            out[mime] = _png_summary(value)
        elif isinstance(value, (str, list)) and not mime.endswith("json"):
            out[mime] = _normalise_text(value, workdir)
        else:
            out[mime] = json.loads(_normalise_text(json.dumps(value), workdir))
    return out


def _normalise_outputs(outputs, workdir):
    result = []
    streams = []  # the current run of consecutive stream outputs

    def end_stream_run():
        for name in ("stdout", "stderr"):
            text = "".join(s["text"] for s in streams if s["name"] == name)
            if text:
                result.append({"output_type": "stream", "name": name,
                               "text": _normalise_text(text, workdir)})
        streams.clear()

    for output in outputs:
        output = copy.deepcopy(dict(output))
        kind = output["output_type"]
        if kind == "stream":
            streams.append({"name": output["name"], "text": "".join(output["text"])})
            continue
        end_stream_run()
        if kind in ("display_data", "execute_result"):
            output["data"] = _normalise_bundle(output.get("data", {}), workdir)
            output["metadata"] = json.loads(
                _normalise_text(json.dumps(output.get("metadata", {})), workdir))
        elif kind == "error":
            output["evalue"] = _normalise_text(output["evalue"], workdir)
            output["traceback"] = [
                "<KERNEL FRAME>" if _KERNEL_FRAME.match(t) else
                _EXPRESSION_MARK.sub("", _normalise_text(t, workdir))
                for t in output["traceback"]]
        result.append(output)
    end_stream_run()
    return result


def _normalise_reply(reply, workdir):
    if reply is None:
        return None
    keep = {k: reply.get(k) for k in ("status", "execution_count", "ename", "evalue")
            if k in reply}
    if "evalue" in keep:
        keep["evalue"] = _normalise_text(keep["evalue"], workdir)
    payload = []
    for p in reply.get("payload") or []:
        p = dict(p)
        if "data" in p:
            p["data"] = _normalise_bundle(p["data"], workdir)
        payload.append(p)
    keep["payload"] = payload
    return keep


def _cells(result):
    cells = []
    for index, cell in enumerate(result["nb"].cells):
        if cell.cell_type != "code":
            continue
        cells.append({
            "index": index,
            "source": cell.source,
            "execution_count": cell.get("execution_count"),
            "outputs": _normalise_outputs(cell.get("outputs", []), result["workdir"]),
            "reply": _normalise_reply(result["replies"].get(index), result["workdir"]),
        })
    return cells


# ---------------------------------------------------------------------------------------------
# Reporting


def _show(value):
    return json.dumps(value, indent=1, ensure_ascii=False)


def _dump(path, results):
    target = os.environ.get("NBOS_DIFF_DUMP")
    if not target:
        return
    os.makedirs(target, exist_ok=True)
    for kernel, result in results.items():
        with open(os.path.join(target, f"{path.stem}.{kernel}.ipynb"), "w") as f:
            nbformat.write(result["nb"], f)
        with open(os.path.join(target, f"{path.stem}.{kernel}.normalised.json"), "w") as f:
            f.write(_show(_cells(result)))


def _documented(got, tags, problems):
    """The replicated run's cell with what a documented unreplicable object legitimately adds
    taken out (tags: make_notebooks.py); None when it had to fail with NotReplicatedError and
    did, so that nothing else is compared. A cell that should have shown either and did not is
    a problem."""
    reply = got["reply"] or {}
    if NOT_REPLICATED in tags:
        if reply.get("ename") == "NotReplicatedError" and "replica" in reply.get("evalue", ""):
            return None
        problems.append(f"--- cell {got['index']}: should fail with NotReplicatedError on "
                        f"another replica, got {_show(reply)}\n{got['source']}")
        return None
    if UNREPLICABLE not in tags:
        return got
    outputs, reported = [], False
    for o in got["outputs"]:
        if o["output_type"] == "stream" and o["name"] == "stderr":
            lines = o["text"].splitlines(keepends=True)
            kept = [line for line in lines if not line.startswith("nbos: cannot replicate")]
            reported = reported or len(kept) < len(lines)
            if not kept:
                continue
            o = dict(o, text="".join(kept))
        outputs.append(o)
    if not reported:
        problems.append(f"--- cell {got['index']}: the executor did not report the object it "
                        f"cannot replicate\n{got['source']}")
    return dict(got, outputs=outputs)


def _differences(kernel, result, ref):
    problems = []
    if result["error"] is not None:
        problems.append(f"{kernel} stopped the notebook:\n{result['error']}")
    for got, want in zip(_cells(result), _cells(ref)):
        if kernel == REPLICATED:
            got = _documented(got, ref["nb"].cells[got["index"]].metadata.get("tags", []),
                              problems)
            if got is None:
                continue
        fields = [f for f in ("execution_count", "outputs", "reply") if got[f] != want[f]]
        if fields:
            problems.append(
                f"--- cell {got['index']}: {', '.join(fields)} differ\n{got['source']}\n"
                + "".join(f"  [{f}] {kernel}:\n{_show(got[f])}\n  [{f}] ipykernel:\n"
                          f"{_show(want[f])}\n" for f in fields))
    return [f"[{kernel}] {p}" for p in problems]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_matches_ipykernel(path, kernelspec_dir, replicated_kernelspec, monkeypatch):
    # ipykernel does not capture fds 1 and 2 (C code, subprocesses) when it sees this variable.
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    results = asyncio.run(_run_all(path, replicated_kernelspec))
    _dump(path, results)
    ref = results["python3"]

    assert ref["error"] is None, f"the reference kernel (ipykernel) failed:\n{ref['error']}"
    for cell in _cells(ref):
        tagged = RAISES in ref["nb"].cells[cell["index"]].metadata.get("tags", [])
        failed = (cell["reply"] or {}).get("status") == "error"
        assert failed == tagged, (
            f"{path.name} cell {cell['index']}: on ipykernel it {'fails' if failed else 'succeeds'}"
            f" but is {'' if tagged else 'not '}tagged {RAISES}:\n{cell['source']}")
    problems = _differences("nbos", results["nbos"], ref)
    problems += _differences(REPLICATED, results[REPLICATED], ref)
    assert not problems, (f"{path.name}: {len(problems)} cell(s) differ from ipykernel\n\n"
                          + "\n".join(problems))
