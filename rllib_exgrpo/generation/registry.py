"""Generation backends by name (``generation_backend``).

A backend is built by a factory ``(settings, module, tokenizer) -> GenerationBackend``
(``generation/base.py``): ``settings`` the env runner's settings (read as
``settings.<field>``), ``module`` its ``LLMTorchRLModule`` (the weights to sample from),
``tokenizer`` the policy's. A user package adds one with the same decorator the built-ins
use::

    from rllib_exgrpo.generation.registry import register_generation_backend

    @register_generation_backend("my_server")
    def my_server_backend(settings, module, tokenizer):
        return MyServerBackend(url=..., tokenizer=tokenizer)

The factories import their backend when called, so naming a backend that needs vLLM does
not import vLLM anywhere else.
"""

from __future__ import annotations

from rllib_exgrpo.core.registry import Registry
from rllib_exgrpo.generation.hf import HFGenerationBackend
from rllib_exgrpo.generation.vllm import VLLMGenerationBackend

__all__ = ["GENERATION_BACKEND", "register_generation_backend", "make_backend"]

#: ``generation_backend`` values -> factories (the built-ins: ``hf``, ``vllm``).
GENERATION_BACKEND: Registry = Registry("generation_backend")
register_generation_backend = GENERATION_BACKEND.register


@register_generation_backend("hf")
def hf_backend(settings, module, tokenizer):
    """transformers in the runner's own process, on its module's weights."""
    return HFGenerationBackend(
        module.model,
        pad_token_id=tokenizer.pad_token_id,
        batch_size=settings.generation_batch_size,
        logprobs_from_generation=settings.behaviour_logprobs == "engine",
        decoder=settings.hf_decoder,
    )


@register_generation_backend("vllm")
def vllm_backend(settings, module, tokenizer):
    """A vLLM engine in the runner's process (``generation/vllm.py``; vLLM imported on build)."""
    return VLLMGenerationBackend(settings, module, tokenizer)


def make_backend(name: str, settings, module, tokenizer):
    """The backend registered as ``name``; an unknown name raises naming the registered ones."""
    return GENERATION_BACKEND.get(name)(settings, module, tokenizer)
