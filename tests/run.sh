#!/usr/bin/env bash
# The test command (README "Run it", .ci/run): for each torch the package is
# proven on, a virtual environment with that torch, a build of the extension
# against it, and the whole test suite. Prints one closing line for all of them.
#
#   bash tests/run.sh                      # torch 2.13.0 (CPU wheel) and 2.14.1 (CUDA build)
#   GROUPCOMM_TORCHES=2.14.1 bash tests/run.sh -k shm   # one torch; extra args go to pytest
set -uo pipefail
cd "$(dirname "$0")/.."
torches=${GROUPCOMM_TORCHES:-"2.13.0 2.14.1"}
reports=()
status=0
for version in $torches; do
  venv=".venv-torch$version"
  echo "=== torch $version: $venv"
  # A CUDA build of torch brings its NCCL wheel; with a CPU build, the extra
  # [cu13] adds one for the NCCL binding's tests (they need no GPU). ninja lets
  # torch's build compile the sources in parallel (README: installing).
  if ! { python3 -m venv "$venv" &&
         "$venv/bin/pip" install -q -U pip &&
         "$venv/bin/pip" install -q "torch==$version" numpy "setuptools>=77" ninja pytest expecttest &&
         extra=$("$venv/bin/python" -c "import torch; print('' if torch.version.cuda else '[cu13]')") &&
         "$venv/bin/pip" install -q --no-build-isolation -e ".$extra"; } 2> >(grep -v "^WARNING: Location" >&2); then
    echo "=== torch $version: install or build failed"
    status=1
    continue
  fi
  report="$venv/pytest-report.xml"
  "$venv/bin/python" -m pytest -q tests --junitxml="$report" "$@" || status=1
  reports+=("$version=$report")
done
python3 - "${reports[@]}" <<'PY'
import sys
import xml.etree.ElementTree as ET

totals = {"passed": 0, "failed": 0, "skipped": 0}
for arg in sys.argv[1:]:
    version, path = arg.split("=", 1)
    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    print(f"torch {version}: {tests - failed - skipped} passed, {failed} failed, {skipped} skipped")
    totals["passed"] += tests - failed - skipped
    totals["failed"] += failed
    totals["skipped"] += skipped
print(f"all: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
PY
exit $status
