"""`nbos run NB.ipynb --gateway URL`: the executed notebook (nbclient's output assembly), the
exit codes, and that the gateway kernel is deleted whatever happens."""

import os
import signal
import subprocess
import time

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from conftest import nbos_bin


def write(tmp_path, name, cells):
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    path = tmp_path / name
    nbformat.write(nb, str(path))
    return path


def run(cluster, *args, token=None, timeout=300):
    return subprocess.run(
        [nbos_bin(), "run", *map(str, args), "--gateway", cluster.url,
         "--token", cluster.token if token is None else token],
        capture_output=True, text=True, timeout=timeout)


def outputs(cell):
    return [dict(o) for o in cell.outputs]


@pytest.fixture(autouse=True)
def kernels_are_deleted(cluster):
    yield
    status, kernels = cluster.request("GET", "/api/kernels")
    assert status == 200 and kernels == [], kernels


def test_outputs_like_nbclient(cluster, tmp_path):
    skip = new_code_cell("raise Exception('must not run')")
    skip.metadata["tags"] = ["skip-execution"]
    raises = new_code_cell("1 / 0")
    raises.metadata["tags"] = ["raises-exception"]
    path = write(tmp_path, "outputs.ipynb", [
        new_markdown_cell("# title"),
        new_code_cell("print('a')\nprint('b', end='')\nprint('c')"),
        new_code_cell("from IPython.display import display, update_display\n"
                      "h = display('v1', display_id='d1')"),
        new_code_cell("update_display('v2', display_id='d1')"),
        new_code_cell("from IPython.display import clear_output\n"
                      "print('old')\nclear_output(wait=True)\nprint('new')"),
        new_code_cell("40 + 2"),
        new_code_cell("   \n"),
        skip,
        raises,
        new_code_cell("print('after')"),
    ])
    proc = run(cluster, path)
    assert proc.returncode == 0, proc.stderr
    out_path = tmp_path / "outputs.nbos.ipynb"
    assert proc.stdout.strip() == str(out_path)
    assert "ZeroDivisionError" in proc.stderr  # reported, but allowed by the tag

    nb = nbformat.read(str(out_path), as_version=4)
    nbformat.validate(nb)
    c = nb.cells
    assert c[0].cell_type == "markdown" and c[0].source == "# title"
    assert outputs(c[1]) == [{"output_type": "stream", "name": "stdout", "text": "a\nbc\n"}]
    assert c[1].execution_count == 1
    assert [o["data"]["text/plain"] for o in outputs(c[2])] == ["'v2'"]
    assert outputs(c[3]) == []
    assert outputs(c[4]) == [{"output_type": "stream", "name": "stdout", "text": "new\n"}]
    assert outputs(c[5]) == [{"output_type": "execute_result", "data": {"text/plain": "42"},
                              "metadata": {}, "execution_count": 5}]
    assert c[5].execution_count == 5
    assert c[6].execution_count is None and outputs(c[6]) == []
    assert c[7].execution_count is None and outputs(c[7]) == []
    assert c[8].outputs[0]["output_type"] == "error"
    assert c[8].outputs[0]["ename"] == "ZeroDivisionError"
    assert outputs(c[9]) == [{"output_type": "stream", "name": "stdout", "text": "after\n"}]
    assert c[9].execution_count == 7


def error_notebook(tmp_path):
    return write(tmp_path, "errors.ipynb", [
        new_code_cell("print('one')"),
        new_code_cell("raise ValueError('boom')"),
        new_code_cell("print('three')"),
    ])


def test_an_error_stops_the_run_with_exit_code_1(cluster, tmp_path):
    path = error_notebook(tmp_path)
    out = tmp_path / "out.ipynb"
    proc = run(cluster, path, "--output", out)
    assert proc.returncode == 1, proc.stderr
    assert "ValueError: boom" in proc.stderr
    nb = nbformat.read(str(out), as_version=4)
    nbformat.validate(nb)
    assert nb.cells[0].outputs[0]["text"] == "one\n"
    assert nb.cells[1].outputs[0]["ename"] == "ValueError"
    assert nb.cells[1].execution_count == 2
    assert nb.cells[2].outputs == [] and nb.cells[2].execution_count is None


def test_allow_errors_runs_every_cell(cluster, tmp_path):
    path = error_notebook(tmp_path)
    out = tmp_path / "out.ipynb"
    proc = run(cluster, path, "-o", out, "--allow-errors")
    assert proc.returncode == 0, proc.stderr
    nb = nbformat.read(str(out), as_version=4)
    assert nb.cells[1].outputs[0]["ename"] == "ValueError"
    assert nb.cells[2].outputs[0]["text"] == "three\n"
    assert nb.cells[2].execution_count == 3


def test_a_cell_past_the_timeout_is_interrupted(cluster, tmp_path):
    path = write(tmp_path, "slow.ipynb", [new_code_cell("import time\ntime.sleep(120)"),
                                          new_code_cell("print('never')")])
    t = time.time()
    proc = run(cluster, path, "--timeout", "3")
    assert proc.returncode == 1, proc.stderr
    assert "timed out" in proc.stderr
    assert time.time() - t < 60
    nb = nbformat.read(str(tmp_path / "slow.nbos.ipynb"), as_version=4)
    assert nb.cells[1].outputs == []


def test_bad_token_and_bad_input(cluster, tmp_path):
    path = error_notebook(tmp_path)
    proc = run(cluster, path, token="wrong-token")
    assert proc.returncode == 2
    assert "HTTP 403" in proc.stderr and "token" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "errors.nbos.ipynb")

    bad = tmp_path / "bad.ipynb"
    bad.write_text("{not json")
    proc = run(cluster, bad)
    assert proc.returncode == 2
    assert "not a notebook" in proc.stderr


def test_ctrl_c_writes_the_notebook_and_deletes_the_kernel(cluster, tmp_path):
    marker = os.path.join(cluster.shared, f"first-cell-ran-{os.getpid()}")
    path = write(tmp_path, "interrupted.ipynb", [
        new_code_cell(f"print('ran')\nopen({str(marker)!r}, 'w').close()"),
        new_code_cell("import time\ntime.sleep(120)")])
    proc = subprocess.Popen([nbos_bin(), "run", str(path), "--gateway", cluster.url, "--token",
                             cluster.token], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out = tmp_path / "interrupted.nbos.ipynb"
        deadline = time.time() + 120
        # The kernel runs on this machine (nbos up), so the first cell's file shows up here.
        while not os.path.exists(marker):
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGINT, stderr
        nb = nbformat.read(str(out), as_version=4)
        assert nb.cells[0].outputs[0]["text"] == "ran\n"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_notebook_runs_in_its_own_directory_with_send_working_dir(cluster):
    """With --send-working-dir the kernel runs where the notebook lies (inside the gateway's
    workspace): the data file beside it opens, and what a cell writes lands there."""
    project = os.path.join(cluster.workspace, "project")
    os.makedirs(project, exist_ok=True)
    with open(os.path.join(project, "data.txt"), "w") as f:
        f.write("beside the notebook")
    nb = new_notebook(cells=[new_code_cell("print(open('data.txt').read())"),
                             new_code_cell("open('result.txt', 'w').write('from the kernel')")])
    path = os.path.join(project, "nb.ipynb")
    nbformat.write(nb, path)
    done = run(cluster, path, "--send-working-dir")
    assert done.returncode == 0, done.stderr
    executed = nbformat.read(os.path.join(project, "nb.nbos.ipynb"), as_version=4)
    assert executed.cells[0].outputs[0]["text"] == "beside the notebook\n"
    with open(os.path.join(project, "result.txt")) as f:
        assert f.read() == "from the kernel"
    # Without it the kernel runs in the workspace's root, as before.
    done = run(cluster, path, "--allow-errors")
    executed = nbformat.read(os.path.join(project, "nb.nbos.ipynb"), as_version=4)
    assert executed.cells[0].outputs[0]["ename"] == "FileNotFoundError", done.stderr
