"""The process environment a device needs: compile-cache folders, mode variables, the eager-mode switch.

Two kinds of variables, both read from the spec's data (`cache_env`, `mode_env`):

* compile caches in the persistent cache folder: a folder the user exported wins, torch's own default
  never does. `import torch._dynamo` (diffusers imports it) writes torch's default folder
  (`<temp>/torchinductor_<user>`) into the environment of the process that imports it; a web process that
  had imported diffusers handed that folder to every worker it started later, so their compiles left the
  cache folder (and were shared with whatever else runs there);
* mode variables, forced: some runtimes read a variable once, when they are loaded (torch_tpu's
  TORCH_TPU_DEFER_AND_FUSE, at `import torch` through backend autoload), so a worker process must be
  *started* with it, and a worker for another mode must be started without it.

`apply_environment` changes os.environ: the engine runs one device per worker process, so it is applied
once, in that worker, before any model is built.

Temporary files stay inside the cache folder too: TMPDIR is `<cache>/tmp` for every worker (forced: the
compilers' scratch files and inductor's precompiled headers, which inductor places under the temporary
directory whatever its cache folder, would otherwise land in /tmp).
"""

from __future__ import annotations

import getpass
import importlib.abc
import importlib.util
import logging
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from engine import settings

if TYPE_CHECKING:
    from engine.devices.spec import DeviceSpec

logger = logging.getLogger(__name__)


def worker_environment(
    spec: DeviceSpec, cache_dir: Path, mode: str | None = None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The complete environment for a worker process serving `spec` in `mode`.

    `base` (default os.environ) + the device's defaults where unset + the mode's forced variables. A mode
    variable of this device that `mode` does not set is removed, so e.g. "eager" on tpu is really strict
    eager even when the parent exported TORCH_TPU_DEFER_AND_FUSE.
    """
    env = dict(os.environ if base is None else base)
    for key, value in spec.environment(cache_dir).items():
        if not user_choice(key, env.get(key)):
            env[key] = value
    env[TMPDIR_VAR] = str(temp_dir(cache_dir))
    forced = spec.mode_environment(mode)
    for _, var, _ in spec.mode_env:
        if var not in forced:
            env.pop(var, None)
    env.update(forced)
    return env


TMPDIR_VAR = "TMPDIR"
PRECOMPILED_HEADERS = "precompiled headers"  # the key of inductor's header folder in folders_in_force()
# How torch names its default inductor folder (torch._inductor.runtime.cache_dir_utils.default_cache_dir).
TORCH_DEFAULT_INDUCTOR_PREFIX = "torchinductor_"


def user_choice(var: str, value: str | None) -> bool:
    """Whether the value a cache variable has in an environment is the user's own choice: set, and not
    torch's default inductor folder, which torch writes into os.environ itself (see the module's doc)."""
    from engine.devices.spec import INDUCTOR_CACHE_VAR

    if not value:
        return False
    return not (var == INDUCTOR_CACHE_VAR and Path(value).name.startswith(TORCH_DEFAULT_INDUCTOR_PREFIX))


def folders_in_force(spec: DeviceSpec) -> dict[str, str]:
    """The folders this process compiles in and writes temporary files to, as it sees them now: a worker
    reports them to the app, so /system shows where the worker really writes, not what the app computed."""
    folders = {var: settings.device_variable(var) for var, _ in spec.cache_env if settings.device_variable(var)}
    folders[TMPDIR_VAR] = tempfile.gettempdir()
    folders[PRECOMPILED_HEADERS] = precompiled_header_dir()
    return folders


def precompiled_header_dir() -> str:
    """Inductor's precompiled-header folder in this process, whether or not its codecache is imported yet:
    the folder it uses, else the one it will be given on import, else the default it will compute then. So a
    report does not depend on what happened to be imported when it was made."""
    codecache = sys.modules.get(_CODECACHE)
    if codecache is not None and getattr(codecache, "_HEADER_DIR", None):
        return str(codecache._HEADER_DIR)
    for finder in sys.meta_path:
        if isinstance(finder, _HeaderDirOnImport):
            return str(finder.folder)
    # torch's own formula (codecache: default_cache_dir()/precompiled_headers), without importing inductor
    return str(torch_default_inductor_folder() / "precompiled_headers")


def torch_default_inductor_folder() -> Path:
    """torch's default inductor folder (runtime/cache_dir_utils.py default_cache_dir), computed alike."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return Path(tempfile.gettempdir()) / f"{TORCH_DEFAULT_INDUCTOR_PREFIX}{user}"


def temp_dir(cache_dir: Path) -> Path:
    """`<cache>/tmp`, created when it can be (otherwise tempfile skips it and uses the system's)."""
    folder = Path(cache_dir) / "tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        logger.warning("could not create %s for temporary files", folder)
    return folder


_CODECACHE = "torch._inductor.codecache"


def set_precompiled_header_dir(folder: Path) -> None:
    """Where inductor writes its precompiled C++ headers (over 100 MB). Inductor fixes the folder at import
    from the temporary directory, not from its cache folder: point it into the cache. A process that has not
    imported the codecache yet gets the folder when it does, so an eager run never imports the compiler's
    code cache for this alone."""
    codecache = sys.modules.get(_CODECACHE)
    if codecache is not None:
        _point_headers(codecache, folder)
        return
    for finder in sys.meta_path:
        if isinstance(finder, _HeaderDirOnImport):
            finder.folder = folder
            return
    sys.meta_path.insert(0, _HeaderDirOnImport(folder))


def _point_headers(codecache, folder: Path) -> None:
    codecache._HEADER_DIR = str(folder)
    codecache._HEADER_LOCK_DIR = str(Path(folder) / "locks")


class _HeaderDirOnImport(importlib.abc.MetaPathFinder):
    """Sets the header folder right after inductor's codecache module runs, then steps aside."""

    def __init__(self, folder: Path):
        self.folder = folder

    def find_spec(self, name, path, target=None):
        if name != _CODECACHE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, folder = spec.loader.exec_module, self.folder

        def exec_then_point(module):
            exec_module(module)
            _point_headers(module, folder)

        spec.loader.exec_module = exec_then_point
        return spec


def remove_empty_default_inductor_folder() -> bool:
    """`import torch._dynamo` creates torch's default inductor folder (`<temp>/torchinductor_<user>`) even in a
    process that never compiles (the web server): left empty in the system temp. Removed when empty (a
    process that compiles there creates it again); True when it was."""
    folder = torch_default_inductor_folder()
    try:
        folder.rmdir()
    except OSError:  # absent, or not empty: someone uses it
        return False
    return True


def contain_temporary_files(cache_dir: Path, inductor_cache: str | None) -> None:
    """This process's temporary files and inductor's precompiled headers go inside the cache folder."""
    folder = temp_dir(cache_dir)
    if os.access(folder, os.W_OK):
        os.environ[TMPDIR_VAR] = str(folder)
        tempfile.tempdir = None  # computed again from TMPDIR on next use
    if inductor_cache:
        set_precompiled_header_dir(Path(inductor_cache) / "precompiled_headers")


def apply_environment(spec: DeviceSpec, cache_dir: Path, mode: str | None = None) -> dict[str, str]:
    """spec.environment() into os.environ where the user chose no folder (torch's default is no choice:
    see the module's doc); create the cache folders; return what is in force.

    Call before the first compile (inductor and Neuron read their cache dirs lazily). A mode variable set
    here only helps a process whose runtime has not read it yet: in a running process use
    enter_eager_mode().
    """
    wanted = spec.environment(cache_dir, mode=mode)
    in_force: dict[str, str] = {}
    for key, value in wanted.items():
        if not user_choice(key, settings.device_variable(key)):
            os.environ[key] = value
        in_force[key] = settings.device_variable(key) or value
        if key.endswith("_DIR"):
            try:
                Path(in_force[key]).mkdir(parents=True, exist_ok=True)
            except OSError:
                logger.warning("could not create %s=%s", key, in_force[key])
    from engine.devices.spec import INDUCTOR_CACHE_VAR

    contain_temporary_files(cache_dir, in_force.get(INDUCTOR_CACHE_VAR))
    return in_force


def enter_eager_mode(spec: DeviceSpec, mode: str) -> str | None:
    """Switch the device runtime's eager mode for this process to what `mode` needs (TorchTPU: strict
    eager for "eager", deferred-and-fused for "defer-and-fuse"). Returns the runtime mode set; None
    (no-op) on devices without such a switch and for modes it does not concern.
    """
    return spec.eager_mode_fn(mode) if spec.eager_mode_fn else None
