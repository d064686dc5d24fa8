"""A dependency-free progress bar for rank 0: redraws in place on a terminal, prints lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``update(n, **postfix)``; ``close()``. Disabled bars (other ranks) do nothing."""

    def __init__(self, total: int, desc: str = "", enabled: bool = True, initial: int = 0,
                 stream: TextIO | None = None, min_interval_s: float = 0.2,
                 line_interval_s: float = 15.0) -> None:
        self.total = max(total, 1)
        self.n = initial
        self.desc = desc
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.postfix: dict[str, object] = {}
        self._start = time.perf_counter()
        self._start_n = initial
        self._last_draw = 0.0
        # Without a terminal (CI logs, files) a redrawn bar is noise: print a line now and then.
        self._interval = min_interval_s if self.tty else line_interval_s

    def update(self, n: int = 1, **postfix: object) -> None:
        self.n += n
        self.postfix.update(postfix)
        now = time.perf_counter()
        if self.enabled and (now - self._last_draw >= self._interval or self.n >= self.total):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.n / self.total, 1.0)
        elapsed = now - self._start
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.n) / rate if rate > 0 else 0.0
        bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
        post = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in self.postfix.items())
        text = (f"{self.desc} [{bar}] {self.n}/{self.total} {frac:4.0%} "
                f"{elapsed:5.0f}s<{eta:4.0f}s {post}")
        if self.tty:
            self.stream.write("\r" + text[:160].ljust(100))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
