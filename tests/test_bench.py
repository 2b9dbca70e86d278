"""The benchmark CLI runs end to end and reports both backends (no timing
is asserted: tests check behaviour, benchmarks measure)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_cli_reports_both_backends(tmp_path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "torch_groupcomm.bench", "--world", "2", "--ops", "all_reduce,send_recv,barrier,broadcast_object",
         "--min-bytes", "8", "--max-bytes", "512", "--rounds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "memcpy bandwidth" in run.stdout and "speedup" in run.stdout and "gloo us" in run.stdout
    assert "world 2 [" in run.stderr  # the progress bar
    data = json.loads(out.read_text())
    ops = {(r["op"], r["bytes"]) for r in data["records"]}
    assert ops == {("all_reduce", 8), ("all_reduce", 64), ("all_reduce", 512), ("send_recv", 8), ("send_recv", 64),
                   ("send_recv", 512), ("barrier", 0), ("broadcast_object", 8), ("broadcast_object", 64),
                   ("broadcast_object", 512)}, ops
    for r in data["records"]:
        assert r["groupcomm_us"] > 0 and r["baseline_us"] > 0 and r["world"] == 2 and r["baseline"] == "gloo"


def test_bench_cli_rejects_unknown_op() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "torch_groupcomm.bench", "--ops", "all_reduce,teleport"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode != 0 and "teleport" in run.stderr
