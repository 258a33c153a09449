"""aot packages on the Hugging Face Hub: push a package store to a model repo, pull what is missing.

The repo mirrors the store's layout (`<preset>/<kind>-<device>-<precision>-<WxH>-b<batch>/<key hash>/`
with `package.pt2` and `manifest.json`), so a pulled package is found under the same key as one built
here, and a stale one (another torch, another model revision) is never used: its key hash differs. A
pulled package is checked like any other when it loads (the manifest's sha256), and rebuilt if corrupt.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine.pipeline.aot import MANIFEST, PACKAGE

log = logging.getLogger(__name__)

PATTERNS = (f"*/*/*/{PACKAGE}", f"*/*/*/{MANIFEST}")


def _files(root: Path) -> set[str]:
    if not root.is_dir():
        return set()
    return {p.relative_to(root).as_posix() for p in root.glob("*/*/*/*") if p.name in (PACKAGE, MANIFEST)}


def _patterns(preset: str | None) -> list[str]:
    return [p.replace("*", preset, 1) for p in PATTERNS] if preset else list(PATTERNS)


def push_packages(repo_id: str, root: Path, preset: str | None = None, token: str | None = None,
                  private: bool = True) -> str:
    """Upload the store's committed packages (only package + manifest of committed keys; never a build in
    progress) to a model repo, created private if missing. Returns the commit's URL."""
    from huggingface_hub import HfApi

    root = Path(root)
    files = sorted(f for f in _files(root) if not preset or f.startswith(f"{preset}/"))
    if not files:
        raise FileNotFoundError(f"no aot packages under {root}" + (f" for {preset}" if preset else "") +
                                ": run `python -m engine export` first")
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(root),
                             allow_patterns=_patterns(preset), ignore_patterns=[".*", "*/.*", "*/*/.*"],
                             commit_message=f"aot packages ({len(files) // 2} keys)")
    return str(getattr(info, "commit_url", info))


def pull_packages(repo_id: str, root: Path, preset: str | None = None, token: str | None = None) -> list[str]:
    """Download the repo's packages (of one preset) into the store; files already here are not fetched
    again. Returns the new files (relative to `root`)."""
    from huggingface_hub import snapshot_download

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    before = _files(root)
    snapshot_download(repo_id=repo_id, repo_type="model", local_dir=str(root), allow_patterns=_patterns(preset),
                      token=token)
    return sorted(_files(root) - before)
