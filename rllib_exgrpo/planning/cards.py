"""What one GPU offers the memory plan: a table of cards, by the names a user types and by
nominal size.

A card sold as "80 GB" does not give torch 80 GiB: CUDA reports a total of about 79.2 GiB on
an A100 or H100 80 GB (``torch.cuda.get_device_properties(0).total_memory``, the total
``cudaMemGetInfo`` gives, which is also the total vLLM multiplies by
``gpu_memory_utilization``). The plan checks every actor against that figure, the card's
*usable* memory, found here (``docs/memory_plan.md``, "The card table"):

* ``gpu_memory_gb`` (or the size NVML / ``nvidia-smi`` / torch report for the smallest
  visible GPU) equal to a card's nominal size (24, 80, 141) -> that card's usable memory;
* a size within a card's range (from 3 GiB below its usable memory to 1 GiB above its nominal
  size: what NVML reports for it, 79.6 GiB for an H100 80 GB, 22.5 GiB for an A10) -> the
  smaller of that size and the card's usable memory;
* any other size -> :data:`UNKNOWN_CARD_FRACTION` of it (97%: the reserve the plan applied to
  every card before this table);
* a card name (:func:`card_by_name`: "H100", "A10", "L4", "RTX 4090", ... case and spaces as
  a user types them) -> that card.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Tuple

GIB = float(1 << 30)
#: What the plan uses of a size the table does not know.
UNKNOWN_CARD_FRACTION = 0.97
#: A size counts as a card's when it lies in [usable - 3 GiB, nominal + 1 GiB].
_BELOW_USABLE_GIB = 3.0
_ABOVE_NOMINAL_GIB = 1.0


@dataclass(frozen=True)
class Card:
    """One row of the table: ``nominal_gb`` is the size on the box (and what ``gpu_memory_gb``
    says), ``usable_gib`` what CUDA gives torch on it (GiB = 2**30 bytes)."""

    label: str
    nominal_gb: float
    usable_gib: float
    names: Tuple[str, ...]

    @property
    def usable_bytes(self) -> int:
        return int(self.usable_gib * GIB)

    def holds(self, gib: float) -> bool:
        return self.usable_gib - _BELOW_USABLE_GIB <= gib <= self.nominal_gb + _ABOVE_NOMINAL_GIB


#: The cards the shipped recipes name (their headers: "1 GPU of 24 GB (RTX 4090 / A10 / L4 /
#: RTX 3090)", "80 GB (A100-80GB / H100 / H200)"). A "24 GB" card gives 22.5 GiB (the A10 and
#: L4 report 22.5 GiB, the RTX 4090 / 3090 a little more: the smallest counts); an A100 or H100
#: 80 GB 79.2 GiB; an H200 (141 GB) 139.8 GiB.
CARDS: Tuple[Card, ...] = (
    Card("24 GB (A10, L4, RTX 4090 / 3090)", 24, 22.5, ("A10", "A10G", "L4", "RTX 4090", "RTX 3090", "RTX 3090 TI", "24GB", "24 GB")),
    Card(
        "A100 / H100 80 GB",
        80,
        79.2,
        (
            "A100",
            "A100-80GB",
            "A100 80GB",
            "A100-SXM4-80GB",
            "A100 80GB PCIE",
            "H100",
            "H100-80GB",
            "H100 80GB",
            "H100 80GB HBM3",
            "H100 SXM",
            "H100 PCIE",
            "H800",
            "80GB",
            "80 GB",
        ),
    ),
    Card("H200 141 GB", 141, 139.8, ("H200", "H200-141GB", "H200 141GB", "141GB", "141 GB")),
)


def _normal(name: str) -> str:
    text = re.sub(r"^(NVIDIA\s+)?(GEFORCE\s+)?", "", str(name).strip().upper())
    return re.sub(r"\s+", " ", text.replace("_", " "))


def card_by_name(name: str) -> Optional[Card]:
    """The card a user's name means ("H100", "nvidia a10", "RTX 4090", "A100-80GB"), or None."""
    key = _normal(name)
    for card in CARDS:
        if key in card.names or key.replace(" ", "-") in card.names or key.replace("-", " ") in card.names:
            return card
    return None


def card_for_size(total_bytes: float) -> Optional[Card]:
    """The card of a nominal or reported size (bytes), or None when no card's range holds it."""
    gib = float(total_bytes) / GIB
    for card in CARDS:
        if abs(gib - card.nominal_gb) < 1e-6:
            return card
    for card in CARDS:
        if card.holds(gib):
            return card
    return None


def usable_bytes(total_bytes: float) -> int:
    """What the plan lets one GPU's actors use, of a card of ``total_bytes`` (its nominal size
    or the size a tool reports): the table's figure (module doc), else
    :data:`UNKNOWN_CARD_FRACTION` of it."""
    card = card_for_size(total_bytes)
    if card is None:
        return int(float(total_bytes) * UNKNOWN_CARD_FRACTION)
    if abs(float(total_bytes) / GIB - card.nominal_gb) < 1e-6:
        return card.usable_bytes
    return int(min(float(total_bytes), card.usable_bytes))


def describe(total_bytes: float) -> str:
    """How :func:`usable_bytes` read ``total_bytes``, for the printed plan."""
    card = card_for_size(total_bytes)
    if card is None:
        return f"no card of this size in the card table: {UNKNOWN_CARD_FRACTION:.0%} of it"
    return f"card table: {card.label}, {card.usable_gib:g} GiB usable"


__all__ = ["CARDS", "Card", "UNKNOWN_CARD_FRACTION", "card_by_name", "card_for_size", "describe", "usable_bytes"]
