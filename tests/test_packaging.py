"""The wheel holds a startable app: every package (the engine, the UI, and the bench and training code the
UI's Compare and Advisor tabs run), the presets, the embedded model and the console command.

Built from a copy of the checkout (so no build/ or egg-info lands in it) and installed with
`pip install --target` into a folder run from outside the checkout, so neither the checkout nor the
project's editable install can stand in for what the wheel forgot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

# What the copy leaves out: caches, virtual environments and build output are not sources.
_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__",
                                      "artifacts", ".pytest_cache", ".ruff_cache", ".whl", ".gl", "_data")


def _copy_sources(dest: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True)
    if listed.returncode != 0:  # not a git checkout (an unpacked sdist, a Space): copy the tree
        shutil.copytree(REPO, dest, ignore=_NOT_SOURCES)
        return
    for name in listed.stdout.splitlines():
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    _copy_sources(root / "src")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
                           "-w", str(root / "dist"), "-q"], cwd=root / "src", capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = (root / "dist").glob("diffusion_showcase-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
                           "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _shipped(folder: str, pattern: str = "*") -> set[str]:
    return {p.relative_to(REPO).as_posix() for p in (REPO / folder).rglob(pattern) if p.is_file()}


def test_the_wheel_holds_every_package_the_data_and_the_command(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {p.parent.relative_to(REPO).as_posix() for top in ("engine", "bench", "training", "ui")
                for p in (REPO / top).rglob("__init__.py") if "__pycache__" not in p.parts}
    assert {"engine", "engine/tp", "bench", "training", "training/shapes", "ui"} <= packages
    for package in packages:
        sources = {p.relative_to(REPO).as_posix() for p in (REPO / package).glob("*.py")}
        assert sources <= names, f"{package}: {sorted(sources - names)} not in the wheel"
    assert "app.py" in names
    data = (_shipped("presets", "*.toml") | _shipped("models/tiny-shapes") | _shipped("models/tiny-shapes-edit")
            | _shipped("models/tiny-shapes-loras"))
    assert any(n.endswith(".safetensors") for n in data) and "presets/models.toml" in data
    missing = {f"engine/_data/{n}" for n in data} - names
    assert not missing, f"data not in the wheel: {sorted(missing)}"
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "diffusion-showcase = app:main" in text


def _run_installed(target: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """Python with only the installed folder in front: -P keeps the script's folder and cwd off sys.path,
    and the cwd is outside the checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-P", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_installed_app_starts_outside_the_checkout(installed, tmp_path):
    probe = (
        "import json, sys\n"
        "import app, engine\n"
        "from engine import settings\n"
        "try:\n"
        "    app.main(['--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "model = settings.data_path('models/tiny-shapes')\n"
        "print(json.dumps({'app': app.__file__, 'engine': engine.__file__, 'model': str(model),\n"
        "                  'presets': str(settings.PRESETS_DIR), 'torch': 'torch' in sys.modules}))\n"
    )
    proc = _run_installed(installed, tmp_path, "-c", probe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("app", "engine", "model", "presets"):
        assert Path(seen[key]).is_relative_to(installed), f"{key} came from {seen[key]}, not the wheel"
    assert not seen["torch"], "--help imported torch"
    model = Path(seen["model"])
    assert (model / "model_index.json").is_file()
    assert list(model.glob("*/*.safetensors")), "the embedded model has no weights"

    command = _run_installed(installed, tmp_path, str(installed / "bin" / "diffusion-showcase"), "--help")
    assert command.returncode == 0, command.stderr[-3000:]
    assert "usage: diffusion-showcase" in command.stdout and "--preset" in command.stdout

    presets = _run_installed(installed, tmp_path, "-m", "engine", "presets", "--json")
    assert presets.returncode == 0, presets.stderr[-3000:]
    names = {p["name"] for p in json.loads(presets.stdout)}
    assert {"tiny-shapes", "tiny-flux"} <= names

    # The Advisor tab runs `python -m bench advise`: the measuring commands ship with the app.
    measuring = _run_installed(installed, tmp_path, "-m", "bench", "--help")
    assert measuring.returncode == 0, measuring.stderr[-3000:]
    assert "usage: python -m bench" in measuring.stdout and "advise" in measuring.stdout


def test_an_editable_install_builds_without_a_warning(tmp_path):
    """`make setup` installs the checkout editable: setuptools printed a 10-line "Editable installation"
    warning (its import-finder strategy) before the app's URL; a plain .pth file needs none."""
    _copy_sources(tmp_path / "src")
    build = ("import sys, setuptools.build_meta as b; "
             "print(b.build_editable(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-W", "default", "-c", build, str(tmp_path / "dist")],
                          cwd=tmp_path / "src", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr and "Editable installation" not in proc.stderr, proc.stderr[-3000:]
    (built,) = (tmp_path / "dist").glob("diffusion_showcase-*.whl")
    names = zipfile.ZipFile(built).namelist()
    pth = next(n for n in names if n.endswith(".pth"))
    assert zipfile.ZipFile(built).read(pth).decode().strip() == str((tmp_path / "src").resolve())
