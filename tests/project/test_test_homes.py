"""The tests mirror the house: every package of autopar has a test folder of its own
(``tests/<package>/``), every pass of the pipeline is named by a test file of its own
(``tests/passes/test_pass_<name>.py``) or by name in the tests, and the ``slow`` marker is
registered (``pytest -m "not slow"`` is the quick loop; ``make test`` runs everything)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from autopar import passes

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# packages without a test folder of their own, and why
NO_FOLDER = {
    "configs": "data only: every packaged YAML is loaded by tests/strategy and tests/project",
    "models": "our GPT and MLP: the models every parity test trains",
}
# test folders of no package: parity through the whole stack, the repository's own rules
NOT_PACKAGES = {"end_to_end", "project"}


def _packages() -> set[str]:
    return {d.name for d in ROOT.iterdir() if (d / "__init__.py").is_file()
            and d.name not in ("tests", "bench", "build")} | {"configs"}


def _test_folders() -> set[str]:
    return {d.name for d in TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py"))}


def test_every_package_has_a_test_folder_and_every_folder_a_package():
    packages, folders = _packages(), _test_folders()
    assert packages - folders == set(NO_FOLDER), sorted(packages - folders - set(NO_FOLDER))
    assert folders - packages == NOT_PACKAGES, sorted(folders - packages - NOT_PACKAGES)
    assert not list(TESTS.glob("test_*.py")), "a test file outside a package's folder"


def test_every_pass_is_named_in_a_test():
    texts = "\n".join(p.read_text() for p in TESTS.rglob("test_*.py"))
    unnamed = [p.name for p in passes.PIPELINE
               if not (TESTS / "passes" / f"test_pass_{p.name}.py").exists()
               and not re.search(rf"\b{p.name}\b", texts)]
    assert not unnamed, f"passes no test names: {unnamed}"


def test_the_slow_marker_is_registered_and_markers_are_strict():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]
    assert "--strict-markers" in options["addopts"]
    assert any(m.startswith("slow:") for m in options["markers"])
