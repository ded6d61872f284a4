"""Progress bar and log lines (rank 0 only)."""
from __future__ import annotations

import sys
import time
from collections.abc import Mapping


class ProgressLog:
    """verbose=0 silent; 1 a progress bar; 2 a log line every ``log_freq`` steps."""

    def __init__(self, verbose: int, log_freq: int, total: int | None, prefix: str,
                 enabled: bool = True):
        self.verbose = verbose if enabled else 0
        self.log_freq = max(1, log_freq)
        self.total = total
        self.prefix = prefix
        self.start = time.perf_counter()
        self.shown: str | None = None      # the values of the last log step, as shown

    def step(self, step: int, values: Mapping[str, float]) -> None:
        """Show step ``step``; its values are read (on a GPU: waited for) only at a log step
        (every ``log_freq``-th, the last; the bar's first): the bar moves on every step with
        the last values read."""
        if self.verbose == 0:
            return
        if self.verbose >= 2 and "plan_s" in values:     # a new batch shape: rare, said
            print(f"{self.prefix} step {step}: planned a new program for this batch's shapes "
                  f"in {values['plan_s']:.2f} s", flush=True)
        logs = step % self.log_freq == 0 or step == self.total
        if logs or (self.verbose == 1 and self.shown is None):
            self.shown = " ".join(f"{k}: {v:.4f}" for k, v in values.items()
                                  if k != "plan_s")      # said on its own line
        shown = self.shown
        elapsed = time.perf_counter() - self.start
        if self.verbose == 1:
            total = self.total or "?"
            width = 30
            done = int(width * step / self.total) if self.total else 0
            bar = "=" * done + "." * (width - done)
            sys.stdout.write(f"\r{self.prefix} {step}/{total} [{bar}] {shown} {elapsed:.1f}s")
            sys.stdout.flush()
        elif self.verbose >= 2 and logs:
            rate = step / elapsed if elapsed > 0 else float("nan")
            print(f"{self.prefix} step {step}/{self.total or '?'} {shown} ({rate:.2f} steps/s)",
                  flush=True)

    def close(self) -> None:
        if self.verbose == 1:
            sys.stdout.write("\n")
            sys.stdout.flush()
