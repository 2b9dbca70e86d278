#!/usr/bin/env bash
# Lint and format checks: ruff (Python, ruff.toml) and clang-format (csrc/,
# .clang-format), at the versions pinned in tests/lint-requirements.txt.
# Run from anywhere as `bash tests/lint.sh`; it makes .venv-lint at the
# repository root on first use (or when the pins change) and fixes nothing:
# `ruff check --fix . && ruff format .` and `clang-format -i` do that.
set -uo pipefail
cd "$(dirname "$0")/.."

venv=.venv-lint
reqs=tests/lint-requirements.txt
stamp=$venv/.requirements
if ! cmp -s "$reqs" "$stamp" 2>/dev/null; then
    echo "lint: installing $(grep -v '^#' "$reqs" | xargs) into $venv"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" || { echo "lint: FAILED (could not create $venv)"; exit 2; }
    fi
    if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$reqs"; then
        echo "lint: FAILED (could not install $reqs)"
        exit 2
    fi
    cp "$reqs" "$stamp"
fi

failed=()
echo "== ruff check"
"$venv/bin/ruff" check . || failed+=("ruff check")
echo "== ruff format --check"
"$venv/bin/ruff" format --check . || failed+=("ruff format")
echo "== clang-format --dry-run --Werror"
mapfile -t cxx < <(git ls-files 'csrc/*.h' 'csrc/*.cpp')
if [ "${#cxx[@]}" -eq 0 ]; then
    echo "no csrc files tracked (not a git checkout?)"
    failed+=("clang-format (no files)")
elif "$venv/bin/clang-format" --dry-run --Werror "${cxx[@]}"; then
    echo "${#cxx[@]} files formatted"
else
    failed+=("clang-format")
fi

if [ "${#failed[@]}" -eq 0 ]; then
    echo "lint: clean"
    exit 0
fi
echo "lint: FAILED ($(IFS=,; echo "${failed[*]}" | sed 's/,/, /g'))"
exit 1
