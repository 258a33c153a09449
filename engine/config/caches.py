"""The persistent cache folder: tiny models, inductor and NEFF caches (`--cache-dir`).

An unwritable or corrupt cache must never stop the app: it warns and runs without it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

# Inductor's own switches for its on-disk caches (read when a compile starts).
CACHE_OFF_ENV = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}


@dataclass(frozen=True)
class CacheDir:
    path: Path
    persistent: bool  # False: a temporary fallback, compiled graphs will not survive a restart
    notices: tuple[str, ...] = field(default=())

    def worker_env(self) -> dict[str, str]:
        return {} if self.persistent else dict(CACHE_OFF_ENV)


def prepare_cache_dir(path: Path) -> CacheDir:
    """Create the folder and prove it is writable; otherwise fall back to a temporary one."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
        return CacheDir(path, True)
    except OSError as exc:
        fallback = Path(tempfile.mkdtemp(prefix="diffusion-showcase-"))
        notice = (f"cache folder {path} is not writable ({exc.strerror or exc}); running without a persistent "
                  f"cache in {fallback}: compiled graphs will not survive a restart. Fix it or pass --cache-dir")
        log.warning(notice)
        return CacheDir(fallback, False, (notice,))


def disable_compile_caches() -> None:
    """Turn inductor's on-disk caches off in this process (after a corrupt cache broke a compile)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False


_ARTIFACT = re.compile(r"(/[^\s:'\"]+\.(?:so|pt2|pkl|json))")
_ELF_MAGIC = b"\x7fELF"


def _chain(exc: BaseException | None) -> list[BaseException]:
    found, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def _broken_library(path: Path) -> bool:
    """A compiled module that cannot be a shared library: empty, cut short, or not ELF."""
    try:
        with open(path, "rb") as f:
            return f.read(4) != _ELF_MAGIC
    except OSError:
        return False


def remove_corrupt_artifacts(exc: BaseException, cache_root: Path | str | None = None) -> list[str]:
    """Delete the compile-cache files a failure names (e.g. "ImportError: <cache>/ab/x.main.so: file too
    short", left by a process killed mid-write), and every compiled module under the cache that is not a
    shared library at all (a failure's message does not always name the file, and turning the FX graph cache
    off is not enough: inductor's C++ code cache finds the same file by its hash and loads it again). Only
    files under the inductor cache folder are touched. Returns what was removed."""
    folder = cache_root or os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder or not Path(folder).is_dir():  # no known cache folder: touch nothing (not the cwd)
        return []
    root = Path(folder).resolve()
    texts = [str(e) for e in _chain(exc)]
    named = {Path(m) for text in texts for m in _ARTIFACT.findall(text)}
    broken = {path for path in root.rglob("*.so") if path.is_file() and _broken_library(path)}
    removed = []
    for path in sorted(named | broken):
        try:
            if path.resolve().is_relative_to(root) and path.is_file():
                path.unlink()
                removed.append(str(path))
        except OSError as err:
            log.warning("could not remove the corrupt cache file %s: %s", path, err)
    return removed


# What a cache that cannot take more files raises: read-only, full, over quota, no permission.
UNWRITABLE_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM})


def unwritable_cause(exc: BaseException) -> OSError | None:
    """The OSError in `exc`'s chain that says the cache cannot be written, if any."""
    return next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno in UNWRITABLE_ERRNOS), None)


def switch_to_temporary_compile_cache(reason: OSError) -> tuple[Path, str]:
    """The compile cache cannot be written any more: compile in a fresh temporary folder instead (for the
    rest of this process), with inductor's on-disk caches and precompiled headers off. Returns the folder
    and the notice to show."""
    import torch._inductor.config as inductor_config

    from engine.devices.environment import set_precompiled_header_dir

    candidates = [os.environ.get("TMPDIR"), "/dev/shm", None]  # None: the system default
    folder = None
    for base in candidates:
        try:
            folder = Path(tempfile.mkdtemp(prefix="showcase-inductor-", dir=base))
            break
        except OSError:
            continue
    if folder is None:
        raise reason
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    disable_compile_caches()
    inductor_config.cpp_cache_precompile_headers = False
    inductor_config.aot_inductor.precompile_headers = False
    set_precompiled_header_dir(folder / "precompiled_headers")
    notice = (f"the compile cache cannot be written ({reason.strerror or reason}); compiling in a temporary "
              "cache instead: compiled graphs will not survive a restart. Free space or fix the cache folder")
    log.warning(notice)
    return folder, notice


def compile_caches_enabled() -> bool:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return bool(inductor_config.fx_graph_cache or functorch_config.enable_autograd_cache)


def folder_sizes(root: Path) -> dict[str, int]:
    """Bytes under each top-level folder of the cache (for the System panel)."""
    sizes = {}
    root = Path(root)
    if not root.is_dir():
        return sizes
    for child in sorted(root.iterdir()):
        if child.is_dir():
            sizes[child.name] = sum(f.stat().st_size for f in child.rglob("*") if f.is_file() and not f.is_symlink())
    return sizes
