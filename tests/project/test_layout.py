"""Packaging: every package folder is listed, so an installed autopar imports fully."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed_in_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    found = {"autopar"} | {
        "autopar." + ".".join(p.parent.relative_to(ROOT).parts)
        for p in ROOT.rglob("__init__.py")
        if p.parent != ROOT and not any(part.startswith(".") or part in ("tests", "build")
                                        for part in p.relative_to(ROOT).parts)}
    # autopar.configs holds the strategy YAMLs only: a data package without __init__.py
    assert found | {"autopar.configs"} == listed


def test_readme_opens_with_the_two_commands():
    lines = [line for line in (ROOT / "README.md").read_text().splitlines()
             if line.strip().startswith("make ")]
    assert lines[:2] == ["make demo", "make test"]
