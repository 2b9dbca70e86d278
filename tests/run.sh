#!/usr/bin/env bash
# The test command (README "Quick start", .ci/run), in four parts:
#   1. lint: ruff on the Python, clang-format on csrc/ (tests/lint.sh);
#   2. docs: the documentation site built in strict mode (a broken link or
#      API reference fails);
#   3. for each torch the package is proven on, a virtual environment with
#      that torch, a build of the extension against it, and the whole suite;
#   4. the wheel: built against the first torch, installed into a fresh
#      environment and smoke-tested from outside the checkout.
# Prints one closing line for all of it.
#
#   bash tests/run.sh                      # torch 2.13.0 (CPU wheel) and 2.14.1 (CUDA build)
#   GROUPCOMM_TORCHES=2.14.1 bash tests/run.sh -k shm   # one torch; extra args go to pytest
#   GROUPCOMM_STEPS="tests" bash tests/run.sh           # some parts only (lint docs tests wheel)
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
cd "$(dirname "$0")/.."
torches=${GROUPCOMM_TORCHES:-"2.13.0 2.14.1"}
steps=${GROUPCOMM_STEPS:-"lint docs tests wheel"}
reports=()
outcomes=()
status=0

wants() { [[ " $steps " == *" $1 "* ]]; }
quiet_pip() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }
outcome() {  # outcome NAME EXIT_CODE: records a part's result for the closing lines
  if [ "$2" -eq 0 ]; then outcomes+=("$1=passed"); else outcomes+=("$1=failed"); status=1; fi
}

# The venv for torch $1, with the package built against it (editable).
make_venv() {
  local version=$1 venv=".venv-torch$1" extra
  echo "=== torch $version: $venv"
  # A CUDA build of torch brings its NCCL wheel; with a CPU build, the extra
  # [cu13] adds one for the NCCL binding's tests (they need no GPU). ninja lets
  # torch's build compile the sources in parallel.
  python3 -m venv "$venv" &&
    quiet_pip "$venv/bin/pip" install -q -U pip &&
    quiet_pip "$venv/bin/pip" install -q "torch==$version" numpy "setuptools>=77" wheel ninja pytest expecttest &&
    extra=$("$venv/bin/python" -c "import torch; print('' if torch.version.cuda else '[cu13]')") &&
    quiet_pip "$venv/bin/pip" install -q --no-build-isolation -e ".$extra"
}

if wants lint; then
  echo "=== lint"
  bash tests/lint.sh
  outcome lint $?
fi

if wants docs; then
  echo "=== docs"
  { python3 -m venv .venv-docs &&
      quiet_pip .venv-docs/bin/pip install -q -U pip &&
      quiet_pip .venv-docs/bin/pip install -q -r docs/requirements.txt &&
      .venv-docs/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"; }
  code=$?
  [ $code -eq 0 ] && echo "docs: built (strict)"
  outcome docs $code
fi

if wants tests; then
  for version in $torches; do
    if ! make_venv "$version"; then
      echo "=== torch $version: install or build failed"
      outcome "torch$version-build" 1
      continue
    fi
    report=".venv-torch$version/pytest-report.xml"
    ".venv-torch$version/bin/python" -m pytest -q tests --junitxml="$report" "$@" || status=1
    reports+=("$version=$report")
  done
fi

if wants wheel; then
  version=${torches%% *}
  echo "=== wheel against torch $version, installed into .venv-wheel"
  scratch=$(mktemp -d)
  { { [ -x ".venv-torch$version/bin/python" ] || make_venv "$version"; } &&
      rm -rf dist && quiet_pip ".venv-torch$version/bin/pip" wheel -q --no-build-isolation --no-deps -w dist . &&
      rm -rf .venv-wheel && python3 -m venv .venv-wheel &&
      quiet_pip .venv-wheel/bin/pip install -q -U pip &&
      quiet_pip .venv-wheel/bin/pip install -q "torch==$version" numpy dist/torch_groupcomm-*.whl &&
      ls dist && (cd "$scratch" && "$OLDPWD/.venv-wheel/bin/python" "$OLDPWD/tests/wheel_smoke.py"); }
  outcome wheel $?
  rm -rf "$scratch"
fi

python3 - "${reports[@]}" -- "${outcomes[@]}" <<'PY'
import sys
import xml.etree.ElementTree as ET

args = sys.argv[1:]
cut = args.index("--")
totals = {"passed": 0, "failed": 0, "skipped": 0}
for arg in args[:cut]:
    version, path = arg.split("=", 1)
    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    print(f"torch {version}: {tests - failed - skipped} passed, {failed} failed, {skipped} skipped")
    totals["passed"] += tests - failed - skipped
    totals["failed"] += failed
    totals["skipped"] += skipped
for arg in args[cut + 1:]:  # lint, docs, wheel and builds: one check each
    name, result = arg.split("=", 1)
    print(f"{name}: {result}")
    totals[result] += 1
print(f"all: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
PY
exit $status
