"""Names of the columns that travel between the env runners, the algorithm and the learner.

A learner batch row is one completion. ``input_ids`` holds the prompt left-padded to the
batch's longest prompt followed by the completion right-padded to the batch's longest
completion, so the completion tokens of every row sit in the last ``R`` columns::

    [pad pad p0 p1 p2 | c0 c1 c2 pad]     attention_mask  [0 0 1 1 1 | 1 1 1 0]
                                           response_mask   [1 1 1 0]
"""

INPUT_IDS = "input_ids"  # int64 [N, P + R]
ATTENTION_MASK = "attention_mask"  # int64 [N, P + R]
RESPONSE_MASK = "response_mask"  # float32 [N, R], 1 on completion tokens
OLD_LOGP = "old_logp"  # float32 [N, R], behaviour log-probs recorded at sampling time
ADVANTAGES = "advantages"  # float32 [N], one scalar per completion
REWARDS = "rewards"  # float32 [N]
OFF_POLICY = "off_policy"  # float32 [N], 1 for off-policy rows (replayed or in-context seeded)

# Outputs of the module's train forward pass.
LOGP = "logp"  # [N, R] log-probs of the completion tokens under the current policy
ENTROPY = "entropy"  # [N, R] token entropy of the current policy

# Keys of an episode's infos / extra model outputs.
QUESTION_ID = "question_id"
ACTION_LOGP = "action_logp"  # RLlib's Columns.ACTION_LOGP: per-token behaviour log-probs

# A learner pass packed without padding (``core/packing.py``): the pass's rows laid end to
# end in one sequence, each restarting its positions at 0 (HF models then attend within a
# row only: a block-diagonal causal mask, or flash-attention's variable-length kernel).
PACKED_INPUT_IDS = "packed_input_ids"  # int64 [1, T], T = the pass's real tokens
PACKED_POSITION_IDS = "packed_position_ids"  # int64 [1, T]
PACKED_LOGIT_INDEX = "packed_logit_index"  # int64 [K]: positions whose logits predict completion tokens
PACKED_TARGET_ROW = "packed_target_row"  # int64 [K]: row of each predicted token in the [N, R] layout
PACKED_TARGET_COL = "packed_target_col"  # int64 [K]: its completion column

# A pass's scalar set by the learner: the LM-head calls (log-prob chunks) the pass makes at
# least, the same on every ZeRO-3 rank (each call gathers the head's parameters).
MIN_LOGIT_CHUNKS = "min_logit_chunks"  # int
