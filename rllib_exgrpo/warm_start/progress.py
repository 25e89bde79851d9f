"""The warm start's progress: a tqdm bar on a terminal, a line per tenth of the steps elsewhere."""

from __future__ import annotations


def progress_bar(total: int, enabled: bool):
    """A tqdm bar on a terminal; elsewhere (a Ray actor's forwarded log, a file) one line
    per tenth of the steps, since every bar refresh would become a line of its own."""
    import sys

    from tqdm.auto import tqdm

    if enabled and not sys.stderr.isatty():
        return LineProgress(total, "warm-starting tiny model")
    return tqdm(total=total, desc="warm-starting tiny model", unit="step", disable=not enabled, dynamic_ncols=True)


class LineProgress:
    """The subset of tqdm's interface the warm start uses, printing a line every 10%."""

    def __init__(self, total: int, desc: str):
        import time

        self.total, self.desc, self.n, self.postfix = total, desc, 0, {}
        self._every = max(1, total // 10)
        self._start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self._every == 0 or self.n == self.total:
            self._print()

    def set_postfix(self, postfix=None, **kwargs) -> None:
        self.postfix = dict(postfix or {}, **kwargs)

    def print_line(self) -> None:
        self._print()

    def _print(self) -> None:
        import sys
        import time

        extra = ", ".join(f"{k}={v}" for k, v in self.postfix.items())
        print(
            f"{self.desc}: {self.n}/{self.total} steps, {time.perf_counter() - self._start:.0f} s" + (f" ({extra})" if extra else ""),
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.n % self._every:
            self._print()
