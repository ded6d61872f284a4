"""What changed between two plans: ``python -m autopar diff DUMP_A DUMP_B``.

Two dump directories (``debug.dump_dir``: ``rank<r>/<NN>_<pass>.txt`` per rank) of the same
model under two strategies, two versions of autopar, or two settings, compared pass by pass.
Passes are matched by name, not number, so a pass added or disabled in one plan does not
shift the others; a prefix (``eval_``, ``predict_``, ``accumulate_``) is part of the name.
Per rank: one line per pass (unchanged / changed (+a -b lines) / only in A / only in B),
then a unified diff of each changed pass, cut to a screenful. Lines are matched with their
value names (``%12``) masked: the dump names values by position, so one op inserted early
would otherwise show every later line as changed. A pass whose difference is the one the
pass before it had (it changed nothing the two plans disagree on) says so and is not
diffed again.

Only the numbered dumps are compared: the timings (which differ on every run) and other
files are not.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PassDiff", "RankDiff", "diff_dumps", "format_dump_diff", "keyed_diff"]

_NAME = re.compile(r"%\d+")
_DUMP = re.compile(r"(?P<prefix>(?:[a-z]+_)*?)(?P<number>\d{2})_(?P<name>.+)\.txt")
_PREFIXES = ("", "accumulate_", "eval_", "predict_")     # the order plans are listed in


@dataclass(frozen=True)
class PassDiff:
    """One pass (or lowering dump) of one rank in the two plans."""

    name: str                 # prefix + pass name, e.g. ``completion``, ``eval_reshard``
    status: str               # "unchanged" | "changed" | "only in A" | "only in B"
    added: int = 0
    removed: int = 0
    diff: tuple[str, ...] = ()
    same_as: str = ""         # the pass before it, when its difference is that one's

    def summary(self) -> str:
        if self.status != "changed":
            return self.status
        if not self.diff and not self.same_as:
            return "changed (value names only)"
        text = f"changed (+{self.added} -{self.removed} lines)"
        return f"{text}, same as after {self.same_as}" if self.same_as else text


@dataclass(frozen=True)
class RankDiff:
    rank: str                 # ``rank0``
    passes: tuple[PassDiff, ...]

    @property
    def differs(self) -> bool:
        return any(p.status != "unchanged" for p in self.passes)


def diff_dumps(a: str | Path, b: str | Path, context: int = 2) -> list[RankDiff]:
    """Every rank of the two dump directories, pass by pass (ranks in either)."""
    ranks_a, ranks_b = _ranks(Path(a), "A"), _ranks(Path(b), "B")
    result = []
    for rank in sorted(set(ranks_a) | set(ranks_b), key=_rank_number):
        files_a, files_b = _files(ranks_a.get(rank)), _files(ranks_b.get(rank))
        names = sorted(set(files_a) | set(files_b),
                       key=lambda n: _order(n, files_a.get(n) or files_b[n]))
        passes = [_pass_diff(n, files_a.get(n), files_b.get(n), context) for n in names]
        result.append(RankDiff(rank, tuple(_fold_repeats(passes))))
    return result


def keyed_diff(old: list[str], new: list[str], old_keys: list[str] | tuple[str, ...],
               new_keys: list[str] | tuple[str, ...], old_name: str, new_name: str,
               context: int = 2) -> tuple[int, int, list[str]]:
    """(+lines, -lines, unified diff) of two texts whose lines are matched by their keys
    (the lines with names made comparable) but shown as they are."""
    matcher = difflib.SequenceMatcher(None, list(old_keys), list(new_keys), autojunk=False)
    diff, added, removed = [f"--- {old_name}", f"+++ {new_name}"], 0, 0
    for group in matcher.get_grouped_opcodes(context):
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        diff.append(f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                diff += [f" {line}" for line in new[b1:b2]]
                continue
            diff += [f"-{line}" for line in old[a1:a2]] + [f"+{line}" for line in new[b1:b2]]
            removed, added = removed + a2 - a1, added + b2 - b1
    return added, removed, diff if len(diff) > 2 else []


def _fold_repeats(passes: list[PassDiff]) -> list[PassDiff]:
    """A changed program whose diff is the previous program's (but for the file names)
    names the pass that first had it instead of repeating the diff (reports such as
    ``completion.explain`` sit between programs and are not compared with them)."""
    folded: list[PassDiff] = []
    previous: PassDiff | None = None        # the previous program's, as folded
    previous_diff: tuple[str, ...] = ()
    for p in passes:
        if "." in p.name:
            folded.append(p)
            continue
        if (p.status == "changed" and previous is not None and previous.status == "changed"
                and p.diff and p.diff[2:] == previous_diff[2:]):
            p_folded = PassDiff(p.name, p.status, p.added, p.removed, (),
                                previous.same_as or previous.name)
        else:
            p_folded = p
        folded.append(p_folded)
        previous, previous_diff = p_folded, p.diff
    return folded


def format_dump_diff(a: str | Path, b: str | Path, ranks: list[int] | None = None,
                     max_lines: int = 60, context: int = 2,
                     summary_only: bool = False) -> tuple[str, bool]:
    """(the report, whether the plans differ): per rank (``ranks``: only these) a line per
    pass, then each changed pass's diff cut to ``max_lines`` lines."""
    compared = diff_dumps(a, b, context)
    if ranks is not None:
        missing = sorted(set(ranks) - {_rank_number(r.rank) for r in compared})
        if missing:
            raise ValueError(f"autopar diff: no rank {missing} in {a} or {b}; ranks there: "
                             f"{[r.rank for r in compared]}")
        compared = [r for r in compared if _rank_number(r.rank) in ranks]
    lines = [f"autopar diff: A = {a}, B = {b} (passes matched by name)"]
    for rank in compared:
        lines += _format_rank(rank, max_lines, summary_only)
    return "\n".join(lines) + "\n", any(r.differs for r in compared)


def _format_rank(rank: RankDiff, max_lines: int, summary_only: bool) -> list[str]:
    counts = {s: sum(p.status == s for p in rank.passes)
              for s in ("unchanged", "changed", "only in A", "only in B")}
    lines = ["", f"{rank.rank}: " + ", ".join(f"{n} {s}" for s, n in counts.items())]
    width = max((len(p.name) for p in rank.passes), default=0) + 2
    lines += [f"  {p.name:<{width}}{p.summary()}" for p in rank.passes]
    if summary_only:
        return lines
    for p in rank.passes:
        if p.diff and not p.same_as:
            lines += ["", *p.diff[:max_lines]]
            if len(p.diff) > max_lines:
                lines.append(f"... {len(p.diff) - max_lines} more diff lines of {p.name} "
                             f"(--max-lines {len(p.diff)} shows all)")
    return lines


def _pass_diff(name: str, a: Path | None, b: Path | None, context: int) -> PassDiff:
    if a is None or b is None:
        return PassDiff(name, "only in A" if b is None else "only in B")
    text_a, text_b = a.read_text(), b.read_text()
    if text_a == text_b:
        return PassDiff(name, "unchanged")
    lines_a, lines_b = text_a.splitlines(), text_b.splitlines()
    added, removed, diff = keyed_diff(
        lines_a, lines_b, [_NAME.sub("%", ln) for ln in lines_a],
        [_NAME.sub("%", ln) for ln in lines_b], f"A/{a.parent.name}/{a.name}",
        f"B/{b.parent.name}/{b.name}", context)
    return PassDiff(name, "changed", added, removed, tuple(diff))


def _ranks(where: Path, side: str) -> dict[str, Path]:
    """``rank<r>`` -> its folder; a folder of dump files itself counts as ``rank0``."""
    if not where.is_dir():
        raise FileNotFoundError(f"autopar diff: {side} = {where} is not a directory; give a "
                                "dump directory (debug.dump_dir / --dump-dir)")
    ranks = {p.name: p for p in where.iterdir()
             if p.is_dir() and re.fullmatch(r"rank\d+", p.name)}
    if not ranks and _files(where):
        return {"rank0": where}
    if not ranks:
        raise FileNotFoundError(f"autopar diff: {side} = {where} holds no rank<r>/ folders "
                                "of NN_<pass>.txt dumps; give a directory written by "
                                "debug.dump_dir (or one rank's folder)")
    return ranks


def _files(folder: Path | None) -> dict[str, Path]:
    """A rank's numbered dumps by name (prefix + pass name)."""
    if folder is None:
        return {}
    found = {}
    for path in folder.glob("*.txt"):
        match = _DUMP.fullmatch(path.name)
        if match:
            found[match["prefix"] + match["name"]] = path
    return found


def _order(name: str, path: Path) -> tuple:
    match = _DUMP.fullmatch(path.name)
    prefix = match["prefix"]
    rank = _PREFIXES.index(prefix) if prefix in _PREFIXES else len(_PREFIXES)
    return rank, prefix, int(match["number"]), name


def _rank_number(rank: str) -> int:
    return int(rank.removeprefix("rank"))
