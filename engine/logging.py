"""Progress bar and log lines (rank 0 only)."""
from __future__ import annotations

import sys
import time


class ProgressLog:
    """verbose=0 silent; 1 a progress bar; 2 a log line every ``log_freq`` steps."""

    def __init__(self, verbose: int, log_freq: int, total: int | None, prefix: str,
                 enabled: bool = True):
        self.verbose = verbose if enabled else 0
        self.log_freq = max(1, log_freq)
        self.total = total
        self.prefix = prefix
        self.start = time.perf_counter()

    def step(self, step: int, values: dict[str, float]) -> None:
        shown = " ".join(f"{k}: {v:.4f}" for k, v in values.items())
        elapsed = time.perf_counter() - self.start
        if self.verbose == 1:
            total = self.total or "?"
            width = 30
            done = int(width * step / self.total) if self.total else 0
            bar = "=" * done + "." * (width - done)
            sys.stdout.write(f"\r{self.prefix} {step}/{total} [{bar}] {shown} {elapsed:.1f}s")
            sys.stdout.flush()
        elif self.verbose >= 2 and (step % self.log_freq == 0 or step == self.total):
            rate = step / elapsed if elapsed > 0 else float("nan")
            print(f"{self.prefix} step {step}/{self.total or '?'} {shown} ({rate:.2f} steps/s)",
                  flush=True)

    def close(self) -> None:
        if self.verbose == 1:
            sys.stdout.write("\n")
            sys.stdout.flush()
