"""The Python that pyproject.toml's ``requires-python`` admits can run autopar: its floor is
at least the newest version whose features the code uses (``BaseException.add_note`` and
``tomllib`` are 3.11's: on 3.10 every named refusal raised in a pass would become an
AttributeError), and this interpreter is within it."""
from __future__ import annotations

import os
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".venv", ".git", "build", "dist", "site", "dumps", "__pycache__"}
# the standard library's and the language's newer features, by the version that brought them
FEATURES = {
    (3, 11): {"BaseException.add_note": r"\.add_note\(",
              "tomllib": r"^\s*(?:import tomllib|from tomllib import)",
              "ExceptionGroup / except*": r"\bExceptionGroup\b|^\s*except\s*\*",
              "asyncio.TaskGroup": r"\bTaskGroup\b",
              "enum.StrEnum": r"\bStrEnum\b",
              "datetime.UTC": r"\bdatetime\.UTC\b|from datetime import [^\n]*\bUTC\b"},
    (3, 12): {"itertools.batched": r"\bbatched\(",
              "typing.override": r"from typing import [^\n]*\boverride\b|\btyping\.override\b",
              "a type statement": r"^type \w+(?:\[[^\]]*\])? ="},
}


def _floor() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    found = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert found, f"requires-python {spec!r}: expected '>=3.N'"
    return 3, int(found[1])


def _uses() -> dict[tuple[int, int], set[str]]:
    """The features of FEATURES found in the checkout's Python files (this one aside), by
    the version that brought them: {version: {'feature (file)', ...}}."""
    found: dict[tuple[int, int], set[str]] = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP]
        for path in (Path(folder) / name for name in files if name.endswith(".py")):
            if path == Path(__file__).resolve():
                continue
            text = path.read_text()
            for version, named in FEATURES.items():
                found.setdefault(version, set()).update(
                    f"{name} ({path.relative_to(ROOT)})" for name, pattern in named.items()
                    if re.search(pattern, text, re.M))
    return {version: names for version, names in found.items() if names}


def test_requires_python_admits_no_python_older_than_the_features_used():
    floor, uses = _floor(), _uses()
    too_new = {v: sorted(names) for v, names in uses.items() if v > floor}
    assert not too_new, f"requires-python >={floor[0]}.{floor[1]}, but the code uses {too_new}"
    assert sys.version_info[:2] >= floor
