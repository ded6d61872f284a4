"""autopar as a user installs it: a wheel built from the source tree, installed into a fresh
venv away from the repository, then imported, run as the ``autopar`` command and asked for
its packaged strategies by name.

The wheel is built with this venv's setuptools (``python -m build --no-isolation``: no
download) from a copy of the tree, so nothing is written into the checkout. The fresh venv
reaches this venv's torch and the other dependencies through a ``.pth`` file, and pip
installs the wheel with ``--no-index``: the wheel's requirements (torch==2.13.0, ...) are
checked against those, and nothing is downloaded.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import autopar as ap

ROOT = Path(__file__).resolve().parents[2]
# The checkout's top-level folders that are not autopar (never in the wheel, never copied to
# build it) and what building leaves behind.
NOT_SHIPPED = {"tests", "bench", "dumps", "examples", "build", "dist", ".venv", ".git", "docs",
               "site"}
# The package data pyproject.toml ships besides the modules.
DATA = {"configs": "*.yaml", "cost": "reference_profile.json"}


def _source_files() -> set[str]:
    """What the wheel must hold, as ``autopar/...`` names: every module of every package of
    the tree (a folder with an ``__init__.py``, reached from the root through packages) and
    the package data."""
    files, todo = set(), [ROOT]
    while todo:
        folder = todo.pop()
        for entry in folder.iterdir():
            if entry.is_dir() and entry.name not in NOT_SHIPPED:
                if (entry / "__init__.py").exists():
                    todo.append(entry)
            elif entry.suffix == ".py":
                files.add(entry.relative_to(ROOT).as_posix())
    for folder, pattern in DATA.items():
        files |= {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).glob(pattern)}
    return {f"autopar/{name}" for name in files}


def _run(args: list, cwd: Path, env: dict[str, str], timeout: float = 120):
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
    return done


# ---- strategies by name (from this checkout's install) --------------------------------------

def test_every_packaged_config_loads_by_name():
    names = ap.Strategy.named_configs()
    assert names == tuple(sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")))
    assert "dp_tp" in names
    for name in names:
        assert ap.Strategy.from_yaml(name) == ap.Strategy.from_yaml(ROOT / f"configs/{name}.yaml")


def test_an_unknown_name_lists_the_packaged_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'dp_tpp'.*packaged strategies: .*dp_tp, "):
        ap.Strategy.from_yaml("dp_tpp")
    # a path, a file name or a Path is a file, never a packaged name
    for path in ("dp.yaml", "configs/dp", Path("dp")):
        with pytest.raises(FileNotFoundError, match="No such file"):
            ap.Strategy.from_yaml(path)


def test_an_existing_file_wins_over_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dp").write_text("seed: 7\n")
    assert ap.Strategy.from_yaml("dp") == ap.Strategy(seed=7)


# ---- the wheel, installed -------------------------------------------------------------------

@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    # build: a copy of the tree (no stale build/ folder, nothing written into the checkout)
    src, dist = tmp_path / "src", tmp_path / "dist"
    shutil.copytree(ROOT, src, ignore=lambda folder, names: [
        n for n in names if n == "__pycache__" or n.endswith(".egg-info") or n.startswith(".")
        or (Path(folder) == ROOT and n in NOT_SHIPPED)])
    built = _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist,
                  src], tmp_path, env)
    log = built.stdout + built.stderr
    assert "warning" not in log.lower(), log          # e.g. a data folder missing from packages
    (wheel,) = dist.glob("autopar-*.whl")

    # the wheel holds every module and data file of the tree, and nothing else of it
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(),
                        re.MULTILINE).group(1)          # the [project] table's
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n for n in names if not n.startswith(f"autopar-{version}.dist-info/")}
    assert shipped == _source_files()

    # install: a fresh venv reaching this venv's packages (torch) through a .pth file. The
    # checkout's editable autopar is a finder that this venv's own .pth files start, which a
    # path line does not run: the new venv imports the wheel's autopar (checked below). pip
    # sees the editable one's metadata there and leaves it ("outside environment").
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, env)
    python, autopar = venv / "bin" / "python", venv / "bin" / "autopar"
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                tmp_path, env).stdout.strip()
    Path(site, "autopar_test_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-index",
          "--disable-pip-version-check", "--no-compile", wheel], tmp_path, env)

    work = tmp_path / "work"                          # outside the checkout
    work.mkdir()
    shutil.copy(ROOT / "examples" / "train_gpt.py", work)
    for command in ([autopar, "--help"], [python, "-m", "autopar", "--help"]):
        assert "plan" in _run(command, work, env).stdout

    shown = _run([python, "-c", "import autopar as ap; print(ap.__version__); print(ap.__file__);"
                  " print(ap.Strategy.from_yaml('dp').world_size);"
                  " print(' '.join(ap.Strategy.named_configs()))"], work, env).stdout.split("\n")
    assert shown[0] == version
    assert Path(shown[1]).resolve().is_relative_to(venv.resolve()), shown[1]
    assert shown[2] == "2"
    assert shown[3].split() == list(ap.Strategy.named_configs())

    # the command plans an example whose strategy is a packaged one, by name
    planned = _run([autopar, "plan", "train_gpt.py", "--dump-dir", "dumps", "--",
                    "--strategy", "dp", "--layers", "1"], work, env).stdout
    assert "mesh: mesh[2](dp)" in planned and "all_reduce" in planned
    assert list((work / "dumps" / "rank0").glob("[0-9][0-9]_completion.txt"))
