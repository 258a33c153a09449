"""The persistent cache folder: tiny models, inductor and NEFF caches (`--cache-dir`).

An unwritable or corrupt cache must never stop the app: it warns and runs without it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from engine import settings
from engine.processes import pid_alive

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

    def remove_if_temporary(self) -> None:
        """At shutdown: a temporary fallback (and what the workers compiled into it) goes with this process."""
        if not self.persistent:
            shutil.rmtree(self.path, ignore_errors=True)


# Temporary folders this project makes in the system's temporary folders are named <prefix><pid>-<random>, so
# the ones a killed process left can be told from a running one's and removed (remove_orphaned_folders).
TEMP_CACHE_PREFIX = "showcase-cache-"  # the cache folder's fallback when --cache-dir cannot be written
TEMP_COMPILE_PREFIX = "showcase-inductor-"  # a worker's compile cache after its cache disk failed


def owned_prefix(prefix: str) -> str:
    return f"{prefix}{os.getpid()}-"


def remove_orphaned_folders(prefixes: tuple[str, ...] = (TEMP_CACHE_PREFIX, TEMP_COMPILE_PREFIX),
                            bases: tuple[str, ...] | None = None) -> list[str]:
    """Remove the temporary folders named by `prefixes` whose process is gone (a worker that was killed, an
    app that was); returns what was removed. A running process's folders are left alone."""
    removed = []
    for base in bases or (tempfile.gettempdir(), *TEMPORARY_BASES):
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            prefix = next((p for p in prefixes if name.startswith(p)), None)
            pid = name[len(prefix):].split("-", 1)[0] if prefix else ""
            if not pid.isdigit() or pid_alive(int(pid)):
                continue
            folder = os.path.join(base, name)
            if folder not in removed and os.path.isdir(folder) and not os.path.islink(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


def prepare_cache_dir(path: Path) -> CacheDir:
    """Create the folder and prove it is writable; otherwise fall back to a temporary one (removed at shutdown,
    or by the next start when this process is killed)."""
    path = Path(path).expanduser()
    remove_orphaned_folders()  # what a killed process left
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
        return CacheDir(path, True)
    except OSError as exc:
        fallback = Path(tempfile.mkdtemp(prefix=owned_prefix(TEMP_CACHE_PREFIX)))
        # The notice is shown in the app (no path there); the log names both folders.
        notice = (f"the cache folder is not writable ({exc.strerror or type(exc).__name__}); running without a "
                  "persistent cache: compiled graphs will not survive a restart. Fix it or pass --cache-dir")
        log.warning("cache folder %s is not writable (%s); running without a persistent cache in %s",
                    path, exc, fallback)
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
    folder = cache_root or settings.inductor_cache_dir()
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


# What a cache that cannot take more files raises (read-only, full, over quota, no permission), by condition.
FULL, READ_ONLY, NO_PERMISSION = "full", "read-only", "not writable"
_CONDITIONS = {errno.ENOSPC: FULL, errno.EDQUOT: FULL, errno.EROFS: READ_ONLY, errno.EACCES: NO_PERMISSION,
               errno.EPERM: NO_PERMISSION}
# The same conditions as a tool prints them: g++ failing to write its precompiled header says "No space
# left on device" and exits, so only its output, never an errno, reaches Python.
_PRINTED = {os.strerror(code): _CONDITIONS[code] for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)}
# Free space under which a failed compile is put down to a full disk, whatever it raised: one precompiled
# header alone is over 100 MB, and a tool deletes what it could not finish, so the space left after the
# failure is no proof that there was enough.
MIN_FREE_BYTES = 256 * 2**20
# Where a temporary compile cache may go, the first with room first (the worker's own temporary folder is
# inside the cache folder, on the disk that just failed).
TEMPORARY_BASES: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass(frozen=True)
class Unwritable:
    """Why the compile cache cannot take more files: the condition a visitor may read, the detail for the log."""

    condition: str  # FULL, READ_ONLY or NO_PERMISSION
    detail: str

    @property
    def what(self) -> str:
        if self.condition == NO_PERMISSION:
            return "the compile cache folder cannot be written (no permission)"
        return f"the compile cache disk is {self.condition}"

    @property
    def notice(self) -> str:
        return (f"{self.what}: compiling in a temporary cache, so compiled graphs will not survive a restart; "
                "the host can free space on the cache disk or fix the cache folder")


def _existing(folder: Path | str) -> Path | None:
    path = Path(folder)
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return None


def _disk_condition(folder: Path | str) -> str | None:
    """FULL / READ_ONLY / NO_PERMISSION when the disk under `folder` cannot take a compile, else None."""
    path = _existing(folder)
    if path is None:
        return None
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return READ_ONLY
        if shutil.disk_usage(path).free < MIN_FREE_BYTES:
            return FULL
    except OSError:
        return None
    return None if os.access(path, os.W_OK) else NO_PERMISSION


def unwritable_cause(exc: BaseException, folders: tuple[Path | str, ...] = ()) -> Unwritable | None:
    """Why the compile cache cannot be written, when `exc` or the disk says so, whichever tool failed:
    an OSError with such an errno in `exc`'s chain; the condition printed in a message (a compiler's
    output); or any failure while a folder of `folders` (the compile, temporary and package folders) is on
    a disk with less than MIN_FREE_BYTES free, read-only or not writable. None: something else failed."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, OSError) and e.errno in _CONDITIONS:
            return Unwritable(_CONDITIONS[e.errno], f"{type(e).__name__}: {e}")
    for e in chain:
        text = f"{e} {getattr(e, 'output', '') or ''}"
        for printed, condition in _PRINTED.items():
            if printed in text:
                return Unwritable(condition, f"{type(e).__name__} printed {printed!r}")
    for folder in folders:
        condition = _disk_condition(folder)
        if condition is not None:
            return Unwritable(condition, f"{folder}: {condition} after {type(exc).__name__}: {str(exc)[:300]}")
    return None


def _temporary_base() -> str | None:
    """The first of TEMPORARY_BASES that can be written and has room for a compile."""
    for base in TEMPORARY_BASES:
        try:
            if os.path.isdir(base) and _disk_condition(base) is None:
                return base
        except OSError:
            continue
    return None


def switch_to_temporary_compile_cache(reason: Unwritable) -> tuple[Path, str]:
    """The compile cache cannot be written any more: compile in a fresh temporary folder on a disk with
    room instead (for the rest of this process): inductor's cache, the temporary files of the compilers it
    starts and the precompiled headers, with inductor's on-disk caches and precompiled headers off. Returns
    the folder and the notice to show (the condition, never a path or a command line: visitors read it).
    OSError when no temporary folder can be made."""
    import torch._inductor.config as inductor_config

    from engine.devices.environment import TMPDIR_VAR, set_precompiled_header_dir

    base = _temporary_base()
    if base is None:
        raise OSError(errno.ENOSPC, f"no temporary folder with room for a compile in {', '.join(TEMPORARY_BASES)}")
    folder = Path(tempfile.mkdtemp(prefix=owned_prefix(TEMP_COMPILE_PREFIX), dir=base))
    (folder / "tmp").mkdir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    os.environ[TMPDIR_VAR] = str(folder / "tmp")  # the compilers' scratch files: inherited by each one
    tempfile.tempdir = None  # computed again from TMPDIR on next use
    disable_compile_caches()
    inductor_config.cpp_cache_precompile_headers = False
    inductor_config.aot_inductor.precompile_headers = False
    set_precompiled_header_dir(folder / "inductor" / "precompiled_headers")
    log.warning("%s (%s); compiling in %s", reason.what, reason.detail, folder)
    return folder, reason.notice


def compile_caches_enabled() -> bool:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return bool(inductor_config.fx_graph_cache or functorch_config.enable_autograd_cache)
