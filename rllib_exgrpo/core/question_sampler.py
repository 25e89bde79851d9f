"""Which fresh questions a training step gets: epoch-wise shuffled passes over the data set.

The sampler is part of the algorithm's checkpoint, so a resumed run continues the same
pass over the data instead of starting a new epoch.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence

import numpy as np


class QuestionSampler:
    """Draw question ids without replacement within an epoch; reshuffle each epoch.

    ``exclude`` (e.g. ExGRPO's retired questions) is skipped when drawing.
    """

    def __init__(self, question_ids: Sequence[str], *, seed: int = 0):
        if not question_ids:
            raise ValueError("the training data set holds no questions")
        self.question_ids = list(question_ids)
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.question_ids))

    def next_batch(self, n: int, exclude: Iterable[str] = ()) -> List[str]:
        excluded = set(exclude)
        available = len(self.question_ids) - len(excluded.intersection(self.question_ids))
        if available <= 0:
            raise ValueError("every question of the data set is excluded (all retired?)")
        out: List[str] = []
        chosen = set()
        scanned = 0
        while len(out) < min(n, available):
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            qid = self.question_ids[self._order[self.position]]
            self.position += 1
            scanned += 1
            if qid not in excluded and qid not in chosen:
                out.append(qid)
                chosen.add(qid)
            if scanned > 2 * len(self.question_ids) + n:
                break
        return out

    def get_state(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "num_questions": len(self.question_ids)}

    def set_state(self, state: dict) -> None:
        if state["num_questions"] != len(self.question_ids):
            raise ValueError(
                f"checkpoint was taken on a data set of {state['num_questions']} questions, this run has {len(self.question_ids)}"
            )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
