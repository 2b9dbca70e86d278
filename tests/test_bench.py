"""The benchmark CLI runs end to end and reports both backends (no timing
is asserted: tests check behaviour, benchmarks measure)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _harness import run_ranks

from torch_groupcomm.bench import netns


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
            "--peer",
            "coordinator",
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
    assert all(set(r["peers_us"]) == {"fake", "coordinator"} for r in records if r["peers_us"])

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


def _bench_namespaces(pid: int) -> list[str]:
    """The network namespaces the bench process ``pid`` made (its SimulatedHosts: gc<pid>-...)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"gc{pid}-")]


def _bench_on_two_hosts(argv: list[str], out) -> str:
    """Run the bench with ``argv`` on 2 simulated hosts of 1 rank behind
    1gbit links, its records to ``out``; its stdout, once it succeeded and
    left no namespace behind."""
    argv = [sys.executable, "-m", "torch_groupcomm.bench", "--hosts", "2x1", "--link", "1gbit", *argv]
    bench = subprocess.Popen([*argv, "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = bench.communicate(timeout=300)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    assert bench.returncode == 0, stderr
    assert _bench_namespaces(bench.pid) == []
    return stdout


def test_bench_across_simulated_hosts(tmp_path) -> None:
    """--hosts 2x1: the ranks run in namespaces behind 1gbit links; the table
    has the link bound columns, --peer twin a second gloo group's time on
    every row, and nothing is left afterwards."""
    try:
        netns.check_prerequisites()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    out = tmp_path / "hosts.json"
    argv = ["--ops", "all_reduce,all_gather", "--min-bytes", "64K", "--max-bytes", "64K", "--rounds", "1"]
    stdout = _bench_on_two_hosts([*argv, "--peer", "twin", "--repeat", "2"], out)
    assert "hosts: 2 (1+1 ranks), link 125 MB/s" in stdout, stdout
    assert "2 runs, each on fresh ranks" in stdout, stdout
    header = next(line for line in stdout.splitlines() if line.lstrip().startswith("world"))
    columns = ("groupcomm us", "gloo us", "speedup", "twin us", "vs twin", "bound us", "groupcomm/bound", "gloo/bound")
    columns += ("steal", "runs")
    for column in columns:
        assert column in header, header
    records = json.loads(out.read_text())["records"]
    assert all(set(r["peers_us"]) == {"twin"} and r["peers_us"]["twin"] > 0 for r in records), records
    assert all(0.0 <= r["cpu_steal"] <= 1.0 for r in records), records
    assert all(len(r["run_speedups"]) == 2 and min(r["run_speedups"]) > 0 for r in records), records
    assert [(r["op"], r["bytes"], r["world"], r["hosts"]) for r in records] == [
        ("all_reduce", 65536, 2, [1, 1]),
        ("all_gather", 65536, 2, [1, 1]),
    ]
    # 2 hosts: all_reduce moves N = 64 KiB over each link one way, all_gather N/2
    assert [r["link_bytes"] for r in records] == [65536, 32768]
    assert " 524.3 " in stdout and " 262.1 " in stdout, stdout  # the bounds in us at 125 MB/s


def _refused(argv: list[str]) -> str:
    """The bench's complaint about ``argv``, once it exited with argparse's usage error (2)."""
    run = subprocess.run(
        [sys.executable, "-m", "torch_groupcomm.bench", *argv], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2, (argv, run.stderr)
    return run.stderr


def test_repeated_runs_merge_to_medians() -> None:
    """--repeat: a row's times are the medians of the runs' times, its speedup
    the median of the runs' speedups, its steal the most any run saw; the
    table lists each run's speedup."""
    from torch_groupcomm.bench.collectives import format_table, merge_runs

    def row(ours: float, theirs: float, twin: float, stolen: float) -> dict:
        return {
            "world": 2,
            "op": "all_reduce",
            "bytes": 1 << 20,
            "baseline": "gloo",
            "groupcomm_us": ours,
            "baseline_us": theirs,
            "speedup": theirs / ours,
            "peers_us": {"twin": twin},
            "cpu_steal": stolen,
            "hosts": [1, 1],
            "link_bytes": 1 << 20,
        }

    runs = [[row(100.0, 90.0, 95.0, 0.0)], [row(200.0, 300.0, 310.0, 0.3)], [row(120.0, 150.0, 140.0, 0.05)]]
    [merged] = merge_runs(runs)
    assert (merged["groupcomm_us"], merged["baseline_us"], merged["peers_us"]) == (120.0, 150.0, {"twin": 140.0})
    assert merged["speedup"] == 1.25 and merged["run_speedups"] == [0.9, 1.5, 1.25]
    assert merged["cpu_steal"] == 0.3
    assert merged["groupcomm_busbw"] == (1 << 20) / 120.0 / 1e3  # all_reduce between two: bus factor 1
    table = format_table([merged], 5.0, 125e6)
    assert "3 runs, each on fresh ranks" in table, table
    assert table.splitlines()[-1].split()[-4:] == ["30%", "0.90", "1.50", "1.25"], table
    assert "--repeat repeats the collectives' plan" in _refused(["--workload", "ddp", "--repeat", "2"])


def test_training_steps_across_hosts_and_under_torchrun(tmp_path) -> None:
    """--workload ddp with --hosts 2x1 trains on namespaced hosts and leaves
    nothing behind; under torchrun each rank trains and rank 0 prints the
    table once; tp-decode refuses both."""
    steps = ["--workload", "ddp", "--steps", "1", "--rounds", "1"]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "torch_groupcomm.bench", *steps],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if " ddp " in line]
    assert len(rows) == 1 and rows[0][:3] == ["2", "ddp", "mlp"], run.stdout
    assert "tp-decode runs on one host" in _refused(["--workload", "tp-decode", "--hosts", "2x1"])
    try:
        netns.check_prerequisites()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    out = tmp_path / "steps.json"
    stdout = _bench_on_two_hosts(steps, out)
    assert "hosts 1+1 ranks, links 1gbit" in stdout, stdout
    records = json.loads(out.read_text())["records"]
    assert [(r["workload"], r["model"], r["world"]) for r in records] == [("ddp", "mlp", 2)]
    assert all(records[0][f"{name}_ms"] > 0 for name in ("floor", "gloo", "groupcomm", "hook", "comm")), records


def test_bench_under_torchrun() -> None:
    """Started by torchrun, each rank runs the plan itself and rank 0 prints
    the table once; one host, so no link bound ('-')."""
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "torch_groupcomm.bench", "--ops", "all_reduce", "--min-bytes", "8", "--max-bytes", "8"]
        + ["--rounds", "1", "--link-rate", "100gbit"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("memcpy bandwidth") == 1, run.stdout
    rows = [line.split() for line in run.stdout.splitlines() if "all_reduce" in line]
    assert len(rows) == 1 and rows[0][:4] == ["2", "all_reduce", "8", "B"], run.stdout
    # the bound columns, then the row's CPU steal (Linux)
    assert rows[0][-4:-1] == ["-", "-", "-"] and rows[0][-1].endswith("%"), run.stdout
    assert "gloo/bound" in run.stdout


def test_link_bound_formulas() -> None:
    """The bytes the busiest host's link carries one way, per op and layout
    (N = 1200 bytes as the bench sizes the op; host_of: each rank's host)."""
    from torch_groupcomm.bench.collectives import link_bytes

    two_by_two, three_one, one_host = [0, 0, 1, 1], [0, 0, 0, 1], [0, 0]
    expected = {
        # op: (2x2, 3+1)
        "all_reduce": (1200, 1200),  # 2(H-1)/H N
        "all_gather": (600, 900),  # max_h N(W-L_h)/W: the lone rank's host receives 3/4
        "reduce_scatter": (600, 900),  # the same, sent: the lone rank's contributions to 3 ranks
        "broadcast": (1200, 1200),
        "reduce": (1200, 1200),
        "gather": (600, 300),  # rank 0's host receives the other host's pieces
        "scatter": (600, 300),
        "all_to_all": (1200, 900),  # max_h L_h N (W-L_h)/W
        "send_recv": (0, 1200),  # pairs (0,1),(2,3): only 3+1's (2,3) crosses
        "all_gather_list": (600, 900),
        "all_to_all_uneven": (1200, 900),
    }
    for op, (a, b) in expected.items():
        assert (link_bytes(op, 1200, two_by_two), link_bytes(op, 1200, three_one)) == (a, b), op
        assert link_bytes(op, 1200, one_host) == 0, op
    assert link_bytes("barrier", 0, two_by_two) is None


def _slowest_of_three(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from torch_groupcomm.bench.collectives import _slowest_rank

    return _slowest_rank({"groupcomm": [float(rank), -float(rank)], "gloo": [1.5, 10.0 - rank]}, dist.group.WORLD)


def test_rooted_ops_are_timed_at_the_slowest_rank() -> None:
    """A rooted op's root may return while its last bytes travel: each round
    of broadcast, reduce, gather, scatter and broadcast_object counts at the
    rank that took longest (round by round, every contender)."""
    from torch_groupcomm.bench.collectives import OPS

    assert {op for op, shape in OPS.items() if shape.rooted} == {
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "broadcast_object",
    }
    for result in run_ranks(_slowest_of_three, 3, backend="gloo"):
        assert result == {"groupcomm": [2.0, 0.0], "gloo": [1.5, 10.0]}, result


def test_bench_tp_decode(tmp_path) -> None:
    """--workload tp-decode: a tiny decoder compiled with fullgraph=True on
    groupcomm, gloo and with no communication (floor); the communicating
    backends generate the same tokens, and the table says so."""
    out = tmp_path / "decode.json"
    run = subprocess.run(
        [sys.executable, "-m", "torch_groupcomm.bench", "--workload", "tp-decode", "--decoder", "tiny"]
        + ["--batch", "1", "3", "--tokens", "4", "--rounds", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert "torch.compile(fullgraph=True)" in run.stdout, run.stdout
    assert "# tokens identical on groupcomm, gloo, on every rank and round: yes" in run.stdout, run.stdout
    rows = [line.split() for line in run.stdout.splitlines() if line.lstrip()[:1].isdigit()]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("2", str(batch), name) for batch in (1, 3) for name in ("groupcomm", "gloo", "floor")
    ], run.stdout
    records = json.loads(out.read_text())["records"]
    assert [(r["workload"], r["world"], r["batch"], r["tokens"], r["compiled"]) for r in records] == [
        ("tp-decode", 2, 1, 4, True),
        ("tp-decode", 2, 3, 4, True),
    ]
    for r in records:
        assert r["equal"] and r["digests"]["groupcomm"] == r["digests"]["gloo"], r
        assert all(rate > 0 for rate in r["tokens_per_s"].values()), r


def test_bench_tp_decode_rejects_what_it_cannot_run() -> None:
    for argv, fragment in [
        (["--peer", "fake"], "--peer deepspeed only"),
        (["--world", "3"], "does not split evenly over 3 ranks"),
        (["--dtype", "int32"], "not a floating-point dtype"),
    ]:
        run = subprocess.run(
            [sys.executable, "-m", "torch_groupcomm.bench", "--workload", "tp-decode", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2 and fragment in run.stderr, (argv, run.stderr)


def test_cpu_steal_share(tmp_path, monkeypatch) -> None:
    """The steal column's arithmetic on /proc/stat's first line: stolen ticks
    over all ticks between two readings; nothing where the field is absent."""
    from torch_groupcomm.bench import steal

    stat = tmp_path / "stat"
    monkeypatch.setattr(steal, "_STAT", stat)
    stat.write_text("cpu  100 0 50 800 0 0 10 40 0 0\ncpu0 1 2 3\n")
    before = steal.cpu_ticks()
    assert before == (40, 1000)
    stat.write_text("cpu  150 0 60 850 0 0 10 70 5 0\n")  # guest time (5) is inside user already
    assert steal.share(before, steal.cpu_ticks()) == 30 / 140
    assert steal.share(before, before) is None and steal.share(None, before) is None
    stat.write_text("cpu  1 2 3 4\n")  # a kernel too old to count steal
    assert steal.cpu_ticks() is None
    assert steal.share((0, 0), steal.cpu_ticks()) is None
