"""The one prompt + completion token layout (core/tokens.py), on hand-made rows."""

import torch

from rllib_exgrpo.core.tokens import (
    left_pad,
    position_ids_from_mask,
    prompt_completion_batch,
    prompt_completion_from_padded,
    right_pad,
)

PROMPTS = [[5, 6, 7], [8], [9, 10]]
COMPLETIONS = [[1, 2], [3, 4, 4], []]


def test_prompt_left_padded_completion_right_padded():
    ids, mask, resp = prompt_completion_batch(PROMPTS, COMPLETIONS, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 4], [0, 9, 10, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]]
    assert resp.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    assert position_ids_from_mask(mask).tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3], [0, 0, 1, 1, 1, 1]]


def test_pad_primitives():
    ids, mask = left_pad([[1], [2, 3]], pad_id=9)
    assert ids.tolist() == [[9, 1], [2, 3]] and mask.tolist() == [[0, 1], [1, 1]]
    ids, mask = right_pad([[1], [2, 3]], pad_id=9)
    assert ids.tolist() == [[1, 9], [2, 3]] and mask.tolist() == [[1, 0], [1, 1]]
    ids, mask = right_pad([[], []], pad_id=9, min_width=1)
    assert ids.tolist() == [[9], [9]] and mask.tolist() == [[0], [0]]


def test_from_padded_columns_equals_the_row_builder():
    """PPO's connector hands over padded columns; the layout must be the same."""
    p, r = 3, 3
    obs = left_pad(PROMPTS, 0)[0]
    act = right_pad(COMPLETIONS, 0, min_width=r)[0]
    obs_len = torch.tensor([len(x) for x in PROMPTS])
    act_len = torch.tensor([len(x) for x in COMPLETIONS])
    ids, mask, token_mask = prompt_completion_from_padded(obs, obs_len, act, act_len, p, r)
    want_ids, want_mask, want_resp = prompt_completion_batch(PROMPTS, COMPLETIONS, pad_id=0)
    assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask) and torch.equal(token_mask.long(), want_resp)
