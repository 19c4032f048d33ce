"""`nbos sim` end to end: the real binary on a small trace, its table/JSON output, determinism
across runs, the report's files, and `nbos sim replay` on a journal the simulator wrote (which
must match) and on a corrupted copy (which must fail, naming the record)."""

import json
import os
import pathlib
import subprocess

from conftest import nbos_bin

CSV = ("job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n"
       "0,8,0,0,m,30,0\n1,8,40,0,m,20,0\n2,4,100,0,m,10,0\n"
       "3,1,5,0,m,3,0\n4,8,10,0,m,25,0\n5,8,50,0,m,30,0\n"
       "6,8,2,0,m,60,0\n7,4,70,0,m,5,0\n"
       "8,8,1,0,m,45,0\n9,8,60,0,m,15,0\n")


def run(*args, check=True):
    return subprocess.run([nbos_bin(), "sim", *args], capture_output=True, text=True,
                          check=check, timeout=120)


def test_table_json_and_determinism(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(CSV)
    table = run("--trace", str(trace), "--policy", "notebookos", "--hosts", "3").stdout
    assert "notebookos" in table and "GPU-h prov" in table
    outs = [run("--trace", str(trace), "--policy", p, "--hosts", "3", "--seed", "5",
                "--json").stdout for p in ("reservation", "notebookos", "notebookos")]
    assert outs[1] == outs[2], "same seed must give byte-identical output"
    res, nbos = json.loads(outs[0]), json.loads(outs[1])
    assert res["cells"] == nbos["cells"] == 10 and nbos["cells_failed"] == 0
    assert res["gpu_hours_oracle"] == nbos["gpu_hours_oracle"]
    # Reservation holds each session's GPUs from open to close, so it commits more.
    assert res["gpu_hours_committed"] > nbos["gpu_hours_committed"]


def test_generate_then_simulate_template(tmp_path):
    tpl = tmp_path / "g.json"
    run("generate", "--out", str(tpl), "--hours", "4", "--sessions-per-hour", "5",
        "--seed", "9")
    again = run("generate", "--hours", "4", "--sessions-per-hour", "5", "--seed", "9").stdout
    assert json.loads(tpl.read_text()) == json.loads(again)
    out = json.loads(run("--trace", str(tpl), "--policy", "batch", "--json").stdout)
    assert out["cells"] > 0 and out["pct_executor_reuse"] == 0


def test_report_writes_plots_and_markdown(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(CSV)
    out = tmp_path / "report"
    run("report", "--trace", str(trace), "--out", str(out), "--hosts", "3")
    for name in ("report.md", "delay_cdf.svg", "tct_cdf.svg", "servers.svg", "results.json"):
        assert (out / name).stat().st_size > 0, name
    md = (out / "report.md").read_text()
    for policy in ("reservation", "batch", "notebookos", "notebookos-lcp"):
        assert f"| {policy} |" in md
    assert len(json.loads((out / "results.json").read_text())) == 8


def test_replay_own_journal_and_reject_corrupted(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(CSV)
    journal = tmp_path / "j.jsonl"
    run("--trace", str(trace), "--policy", "notebookos", "--hosts", "3", "--journal",
        str(journal))
    ok = run("replay", "--journal", str(journal))
    assert "all match" in ok.stdout

    lines = journal.read_text().splitlines()
    # Corrupt the first executor decision that chose candidates: swap its first candidate.
    for i, line in enumerate(lines[1:], start=1):
        rec = json.loads(line)
        if rec["event"] == "executor" and rec["outcome"]["decision"]["candidates"]:
            rec["outcome"]["decision"]["candidates"][0] += 100
            lines[i] = json.dumps(rec)
            seq = rec["seq"]
            break
    else:
        raise AssertionError("no executor decision in the journal")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    fail = run("replay", "--journal", str(bad), check=False)
    assert fail.returncode == 1
    assert f"record seq {seq}" in fail.stderr and "executor" in fail.stderr

    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n")
    assert run("replay", "--journal", str(garbage), check=False).returncode == 2


def test_fixed_hosts_never_scales(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(CSV)
    out = json.loads(run("--trace", str(trace), "--policy", "notebookos", "--fixed-hosts", "3",
                         "--json").stdout)
    assert out["hosts_added"] == 0 and out["hosts_released"] == 0
    assert out["peak_servers"] == 3 and out["cells_failed"] == 0
    late = out["not_immediate"]
    assert sum(late[k] for k in ("migrated_at_once", "migration_wait", "placement_wait",
                                 "rebalance_wait", "other")) == round(
                                     out["cells"] * (1 - out["pct_immediate"] / 100))
