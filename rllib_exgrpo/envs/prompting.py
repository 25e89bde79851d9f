"""How a question becomes the text a policy reads.

One function renders every prompt in the project (training env, evaluation, the tiny
model's supervised warm start), so that what a model was warm-started on is exactly what
it later sees.
"""

from __future__ import annotations

from typing import Any, Optional

#: The answer-format instruction of the official Qwen2.5-Math / ExGRPO prompts.
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

#: Used when no tokenizer (hence no chat template) is given; ``{user}`` is the question
#: followed by the instruction lines.
PLAIN_TEMPLATE = "{system}Question: {user}\nAnswer:"


def render_prompt(
    question: str,
    *,
    tokenizer: Any = None,
    system_prompt: Optional[str] = None,
    instruction: Optional[str] = DEFAULT_INSTRUCTION,
    think_format: bool = False,
) -> str:
    """Render ``question`` as the policy's prompt text.

    Args:
        question: The bare question.
        tokenizer: A HF tokenizer. When it has a chat template, the prompt is the
            template applied to ``[system?, user]`` with the generation prompt appended.
        system_prompt: Optional system message.
        instruction: Appended to the user message on a new line (``None`` or ``""``: none).
        think_format: When True, ask for ``<think>...</think>`` reasoning before the answer
            (the official ExGRPO reward only reads the text after ``</think>``).
    """
    user = question.strip()
    if instruction:
        user = f"{user}\n{instruction}"
    if think_format:
        user = f"{user}\nThink inside <think> </think> first, then give the final answer."
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        messages = []
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": user})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    system = f"{system_prompt.strip()}\n\n" if system_prompt else ""
    return PLAIN_TEMPLATE.format(system=system, user=user)
