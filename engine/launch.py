"""How this process was started, read once from the environment when an Engine is made (no
other autopar code reads it): torchrun's rank and world size, where dumps go, and whether
``python -m autopar plan`` started the script to plan it offline.

Offline planning runs the user's unmodified script as a child process whose environment
asks for it, the way torchrun's environment asks for a rank: the first step plans every
rank of the mesh, writes the dumps and the report, and ends the process.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

from ..strategy import DUMP_DIR_ENV, Strategy

__all__ = ["Launch", "OfflinePlanning", "PLAN_REPORT_ENV", "PLAN_STRATEGY_ENV",
           "PLAN_EXPLAIN_ENV", "PLAN_DEPTH_ENV", "PLAN_LOCATE_ENV", "PLAN_AUTO_ENV",
           "PLAN_WRITE_ENV"]

PLAN_REPORT_ENV = "AUTOPAR_PLAN_REPORT"      # plan offline; write the report to this file
PLAN_STRATEGY_ENV = "AUTOPAR_PLAN_STRATEGY"  # a strategy YAML that replaces the script's own
PLAN_EXPLAIN_ENV = "AUTOPAR_PLAN_EXPLAIN"    # JSON list of values to explain in the report
PLAN_DEPTH_ENV = "AUTOPAR_PLAN_EXPLAIN_DEPTH"   # how deep each explanation's chain goes
PLAN_LOCATE_ENV = "AUTOPAR_PLAN_LOCATE"      # "1": also locate the first divergence
PLAN_AUTO_ENV = "AUTOPAR_PLAN_AUTO"          # JSON auto section: let the auto search choose
PLAN_WRITE_ENV = "AUTOPAR_PLAN_WRITE_STRATEGY"   # write the planned strategy's YAML here
PLAN_RANKS_ENV = "AUTOPAR_PLAN_RANKS"        # JSON debug.dump_ranks: whose programs to dump


@dataclass(frozen=True)
class OfflinePlanning:
    """What ``python -m autopar plan`` asks of the script it runs."""

    report: str
    strategy: str | None = None
    explain: tuple[str, ...] = ()
    locate_divergence: bool = False
    auto: dict | None = None              # ``--auto``: the auto section to plan with
    write_strategy: str | None = None     # ``--write-strategy``: where the chosen YAML goes
    explain_depth: int = 0                # ``--depth``: the chain of reasons under each answer
    dump_ranks: object = "classes"        # ``--ranks``: whose lowered programs are dumped


@dataclass(frozen=True)
class Launch:
    rank: int = 0
    world_size: int = 1
    dump_override: str | None = None      # AUTOPAR_DUMP_DIR
    offline: OfflinePlanning | None = None
    local_rank: int = 0                   # LOCAL_RANK: this process's device on its node
    restarts: int = 0                     # TORCHELASTIC_RESTART_COUNT: the agent's restarts

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "Launch":
        offline = None
        if environ.get(PLAN_REPORT_ENV):
            offline = OfflinePlanning(environ[PLAN_REPORT_ENV],
                                      environ.get(PLAN_STRATEGY_ENV) or None,
                                      tuple(json.loads(environ.get(PLAN_EXPLAIN_ENV) or "[]")),
                                      environ.get(PLAN_LOCATE_ENV) == "1",
                                      json.loads(environ.get(PLAN_AUTO_ENV) or "null"),
                                      environ.get(PLAN_WRITE_ENV) or None,
                                      int(environ.get(PLAN_DEPTH_ENV) or "0"),
                                      json.loads(environ.get(PLAN_RANKS_ENV) or '"classes"'))
        return cls(int(environ.get("RANK", "0")), int(environ.get("WORLD_SIZE", "1")),
                   environ.get(DUMP_DIR_ENV) or None, offline,
                   int(environ.get("LOCAL_RANK", environ.get("RANK", "0"))),
                   int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def dump_dir(self, strategy: Strategy) -> str | None:
        """Where dumps go: the launch's AUTOPAR_DUMP_DIR, else the strategy's."""
        return strategy.resolved_dump_dir({DUMP_DIR_ENV: self.dump_override or ""})

    def several(self, simulate: bool) -> bool:
        """Whether plans run on several real processes (this one among them)."""
        return self.world_size > 1 and not simulate and self.offline is None
