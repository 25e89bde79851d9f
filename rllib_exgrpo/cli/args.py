"""argparse value types shared by the ``rllib`` subcommands (errors name the bad text)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def non_negative_float(text: str) -> float:
    """A number >= 0 (NaN rejected)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return x
