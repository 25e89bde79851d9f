#!/usr/bin/env bash
# Wheels that let a lent GPU machine (Python 3.12, torch, transformers, peft; no DeepSpeed,
# no internet) run gpu_check's DeepSpeed stage:
#
#   bash benchmarks/prepare_gpu_wheels.sh [OUT_DIR]     # default benchmarks/out/gpu_wheels
#
# * deepspeed, built here from its sdist with DS_BUILD_OPS=0 (pure Python: no op compiled;
#   the learners' torch.optim.AdamW needs none), the version of the project's .venv;
# * its requirements that machine lacks (it has einops, msgpack, ninja, numpy, packaging,
#   psutil, py-cpuinfo, tqdm, typing-extensions): hjson, pydantic, pydantic-core,
#   annotated-types, typing-inspection, as CPython 3.12 manylinux wheels.
#
# The folder is build output (benchmarks/out/ is git-ignored) and stays far under the 64 MiB
# a device call may carry; its size is printed. On the GPU machine:
#
#   python3 benchmarks/gpu_check.py --wheels benchmarks/out/gpu_wheels
#
# installs them (pip --no-deps --no-index) before any stage runs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/out/gpu_wheels}"
PY="${PYTHON:-.venv/bin/python}"
PYVER="${GPU_PYTHON_VERSION:-3.12}"
DS_VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null || echo 0.19.8)"
# The versions .venv runs DeepSpeed with (pydantic-core must be the one its pydantic pins).
pin() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
DEPS=("hjson==$(pin hjson)" "pydantic==$(pin pydantic)" "pydantic-core==$(pin pydantic-core)"
      "annotated-types==$(pin annotated-types)" "typing-inspection==$(pin typing-inspection)")

rm -rf "$OUT"
mkdir -p "$OUT"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "== deepspeed $DS_VERSION from its sdist, DS_BUILD_OPS=0"
"$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" "deepspeed==$DS_VERSION"
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$OUT" "$tmp"/deepspeed-*.tar.gz

echo "== ${DEPS[*]} for CPython $PYVER"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$p"); done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platforms[@]}" -d "$OUT" "${DEPS[@]}"

ls -l "$OUT"
du -sh "$OUT"
echo "$(du -sb "$OUT" | cut -f1) bytes in $OUT"
