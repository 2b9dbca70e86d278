"""The benchmark CLI runs end to end and reports both backends (no timing
is asserted: tests check behaviour, benchmarks measure)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_cli_reports_both_backends(tmp_path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch_groupcomm.bench",
            "--world",
            "2",
            "--ops",
            "all_reduce,send_recv,barrier,broadcast_object",
            "--min-bytes",
            "8",
            "--max-bytes",
            "512",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "memcpy bandwidth" in run.stdout and "speedup" in run.stdout and "gloo us" in run.stdout
    assert "world 2 [" in run.stderr  # the progress bar
    data = json.loads(out.read_text())
    ops = {(r["op"], r["bytes"]) for r in data["records"]}
    assert ops == {
        ("all_reduce", 8),
        ("all_reduce", 64),
        ("all_reduce", 512),
        ("send_recv", 8),
        ("send_recv", 64),
        ("send_recv", 512),
        ("barrier", 0),
        ("broadcast_object", 8),
        ("broadcast_object", 64),
        ("broadcast_object", 512),
    }, ops
    for r in data["records"]:
        assert r["groupcomm_us"] > 0 and r["baseline_us"] > 0 and r["world"] == 2 and r["baseline"] == "gloo"


def test_bench_cli_rejects_unknown_op() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "torch_groupcomm.bench", "--ops", "all_reduce,teleport"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "teleport" in run.stderr


def test_bench_async_rows_and_training_workloads(tmp_path) -> None:
    rows = tmp_path / "async.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch_groupcomm.bench",
            "--world",
            "2",
            "--ops",
            "all_reduce,send_recv",
            "--max-bytes",
            "8",
            "--rounds",
            "1",
            "--async",
            "--peer",
            "fake",
            "--json",
            str(rows),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "all_reduce async" in run.stdout and "vs fake" in run.stdout
    records = json.loads(rows.read_text())["records"]
    # send_recv always waits on posted work: it has no second row
    assert {(r["op"], r["async"]) for r in records} == {
        ("all_reduce", False),
        ("all_reduce", True),
        ("send_recv", False),
    }
    assert all(r["groupcomm_us"] > 0 and r["baseline_us"] > 0 for r in records)
    # a peer is timed on the synchronous all_reduce rows only
    assert [(r["op"], r["async"]) for r in records if r["peers_us"]] == [("all_reduce", False)]
    assert all(us > 0 for r in records for us in r["peers_us"].values())

    steps = tmp_path / "steps.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch_groupcomm.bench",
            "--workload",
            "ddp,fsdp2",
            "--world",
            "2",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--json",
            str(steps),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "groupcomm - floor" in run.stdout and "groupcomm - fake" in run.stdout
    records = json.loads(steps.read_text())["records"]
    assert [(r["workload"], r["model"], r["world"]) for r in records] == [("ddp", "mlp", 2), ("fsdp2", "mlp", 2)]
    for r in records:
        assert r["floor_ms"] > 0 and r["gloo_ms"] > 0 and r["groupcomm_ms"] > 0, r
        assert r["fake_ms"] > 0, r  # torch's no-op backend ships with every torch we build for
    # DDP's own buckets all-reduced alone, and the speedup bound made of them
    assert records[0]["comm_ms"] > 0 and "comm" not in {k[:-3] for k in records[1]}
    assert records[0]["hook_comm_ms"] > 0 and "hook_comm_ms" not in records[1]  # the same, read in place
    assert "hook comm" in run.stdout
    assert "bound" in run.stdout
    # once more with the opt-in that puts the buffers in shared memory: DDP with
    # our comm hook, FSDP2 with its backend-allocated buffers
    assert records[0]["hook_ms"] > 0 and "alloc_ms" not in records[0]
    assert records[1]["alloc_ms"] > 0 and "hook_ms" not in records[1]
    assert "opt-in ms" in run.stdout
