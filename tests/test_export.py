"""``rllib export CHECKPOINT OUT``: a training checkpoint as a Hugging Face model folder
that ``AutoModelForCausalLM.from_pretrained`` loads with the policy's weights (logits equal
those of the learner's module restored from the checkpoint), for a DDP-style checkpoint and
a DeepSpeed ZeRO-3 one (weight shards of two learners consolidated)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from rllib_exgrpo.cli import main as cli

from test_evaluation import grpo_checkpoint  # noqa: F401  (a module-scoped fixture: one short GRPO run)

PROMPTS = ["What is 3 + 4?", "Compute 12 * 7. Answer in \\boxed{}.", "1+1="]
HF_FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"}


def _logits(model, tokenizer, text):
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def assert_same_logits(exported: Path, reference_model, tokenizer=None):
    """The exported folder, loaded by transformers alone, gives the reference's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype="float32").eval()
    tok = AutoTokenizer.from_pretrained(str(exported))
    if tokenizer is not None:
        assert tok(PROMPTS[0]).input_ids == tokenizer(PROMPTS[0]).input_ids
    reference_model = reference_model.float().eval()
    worst = 0.0
    for text in PROMPTS:
        got, want = _logits(model, tok, text), _logits(reference_model, tok, text)
        assert got.shape == want.shape
        worst = max(worst, float((got - want).abs().max()))
    assert worst <= 1e-5, f"exported logits differ from the checkpoint's by {worst:.3g}"


@pytest.mark.slow
def test_export_a_checkpoint_and_load_it_with_transformers(grpo_checkpoint, tmp_path, monkeypatch, capsys):  # noqa: F811
    from rllib_exgrpo.models.loading import load_causal_lm, load_tokenizer
    from rllib_exgrpo.rllib.module import LLMTorchRLModule

    trial, path, learner_state = grpo_checkpoint
    monkeypatch.chdir(trial.parent)  # paths relative to the working directory
    assert cli.main(["export", os.path.join(trial.name, path.name), "exported"]) == 0
    out_lines = capsys.readouterr().out
    exported = trial.parent / "exported"
    assert "GRPO checkpoint" in out_lines and str(exported) in out_lines
    assert HF_FILES <= {p.name for p in exported.iterdir()}
    assert not [p for p in trial.parent.iterdir() if p.name.startswith(".exported")]  # no temporary left

    module = LLMTorchRLModule.from_checkpoint(str(path / "learner_group" / "learner" / "rl_module" / "default_policy"))
    assert_same_logits(exported, module.model, load_tokenizer(module.model_config["model"]))
    # the trained weights, not the base model's
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(str(exported)).state_dict()
    for name, value in learner_state.items():
        assert state[name].equal(value), name
    base = load_causal_lm({"model": module.model_config["model"]}).state_dict()
    assert any(not base[n].equal(state[n]) for n in learner_state)

    # OUT exists and is not empty: one line, unless --force (the trial folder: latest checkpoint)
    capsys.readouterr()
    assert cli.main(["export", trial.name, "exported"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "exported exists and is not empty; give --force" in err
    (exported / "stale.txt").write_text("old")
    assert cli.main(["export", trial.name, "exported", "--force", "--dtype", "bfloat16"]) == 0
    assert not (exported / "stale.txt").exists()
    assert "bfloat16" in (exported / "config.json").read_text()
    # never a folder holding the checkpoint, nor the working directory
    assert cli.main(["export", trial.name, ".", "--force"]) == 2
    assert "holds the checkpoint" in capsys.readouterr().err


def _zero3_checkpoint(model: str, folder: Path):
    """An ExGRPO run on two ZeRO-3 learners after one iteration, saved to ``folder``;
    returns the full weights RLlib's learner group gives at the save."""
    from test_ddp import MODULE, two_learner_config

    training = dict(
        learner_backend="deepspeed", deepspeed_zero_stage=3, deepspeed={"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    )
    algo = two_learner_config(model, **training).build_algo()
    try:
        algo.train()
        algo.save_to_path(str(folder))
        return algo.learner_group.get_weights()[MODULE]
    finally:
        algo.stop()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.usefixtures("ray_local")
def test_export_a_zero3_checkpoint(quick_tiny_model, tmp_path, capsys):
    import torch

    from rllib_exgrpo.models.loading import load_causal_lm

    checkpoint = tmp_path / "trial" / "checkpoint_000001"
    weights = _zero3_checkpoint(quick_tiny_model, checkpoint)
    assert (checkpoint / "learner_group" / "learner" / "module_shards" / "default_policy" / "rank_1_of_2.pt").is_file()
    out = tmp_path / "exported"
    assert cli.main(["export", str(checkpoint), str(out)]) == 0
    assert "ZeRO-3 shards consolidated" in capsys.readouterr().out
    assert HF_FILES <= {p.name for p in out.iterdir()}
    # the reference: the base model with the learners' full weights at the save
    reference = load_causal_lm({"model": quick_tiny_model})
    # the module's state names: its HF model under "model."
    state = {k[len("model.") :]: torch.as_tensor(v) for k, v in weights.items()}
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)  # tied to the embeddings
    assert_same_logits(out, reference)
