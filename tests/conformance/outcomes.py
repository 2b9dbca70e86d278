"""Run torch's suite (torch_suite.py) in a child pytest and read each case's outcome."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable

HERE = os.path.dirname(os.path.abspath(__file__))


def run_suite(
    backend: str, world_size: int, cases: Iterable[str] | None = None, timeout: float = 3600.0
) -> tuple[dict[str, str], str]:
    """Run the suite's cases (all when ``cases`` is None) with their groups on
    ``backend`` at ``world_size``; return ({case: "passed" | "failed" | "skipped"}, output)."""
    env = {**os.environ, "BACKEND": "gloo", "WORLD_SIZE": str(world_size), "GROUPCOMM_SUITE_BACKEND": backend}
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        suite = os.path.join(HERE, "torch_suite.py")
        targets = [suite] if cases is None else [f"{suite}::TorchSuite::{case}" for case in cases]
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *targets]
        done = subprocess.run(command, env=env, cwd=HERE, capture_output=True, text=True, timeout=timeout)
        output = done.stdout + done.stderr
        if not os.path.exists(report):
            raise RuntimeError(f"torch's suite did not run (exit {done.returncode}):\n{output[-4000:]}")
        return _outcomes(report), output


def _outcomes(report: str) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            outcome = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        else:
            outcome = "passed"
        outcomes[case.get("name")] = outcome
    return outcomes
