"""Four random-weight tiny diffusers pipelines, built locally (presets with source "random:<name>").

They draw noise (the embedded default, tiny-shapes, is a trained model committed in models/), but they
let the whole app (UI, engine, compile, tensor parallel, tests) run offline on a CPU with the same loading
code as a real Hub model, for four pipeline families: each preset is built from configs, saved with
`save_pretrained` (safetensors) and loaded back with `DiffusionPipeline.from_pretrained(path)`.

- Every component is created right after `torch.manual_seed(...)` and every tokenizer is trained on the
  fixed corpus of engine/models/tiny_tokenizers.py, so a rebuild is bit-identical (same safetensors bytes).
  The components and pipelines are in engine/models/tiny_builders.py; this module builds and caches them.
- The VAEs have 4 blocks, so `vae_scale_factor == 8` like the real models; any multiple of 16 pixels is a
  valid height/width for all four (Flux packs 2x2 latents, SD3 has patch size 2, the SDXL UNet halves once).
- Attention head counts are even: tensor parallel over 2 ranks shards heads.
- Everything is a few MB; a 64x64 image in 4 steps takes tens of milliseconds on a CPU.
- Text lengths follow the real models (CLIP 77 tokens, T5 512, Qwen 512) so each pipeline's own defaults
  (`max_sequence_length`, `text_encoder_out_layers`) work unchanged and long prompts are truncated.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from engine import settings
from engine.errors import InvalidRequest, ModelLoadError
from engine.models.tiny_builders import BUILDERS as IMAGE_BUILDERS
from engine.models.tiny_builders import TINY_PRESETS
from engine.models.tiny_video import VIDEO_BUILDERS, VIDEO_PRESETS
from engine.settings import REPO_ROOT

logger = logging.getLogger(__name__)

BUILDERS = {**IMAGE_BUILDERS, **VIDEO_BUILDERS}

# Written last (inside the temporary folder, before the atomic rename): a folder without it is not a
# finished build. It records the recipe version so a stale cache can be recognised.
COMPLETE_MARKER = ".complete"
# Bump when a recipe in tiny_builders.py or tiny_tokenizers.py changes; an older cached build then logs a
# warning (delete it to rebuild).
RECIPE_VERSION = 1


def _check_name(name: str) -> None:
    if name not in BUILDERS:
        raise InvalidRequest(f"Unknown tiny pipeline {name!r}; choose one of: {', '.join(TINY_PRESETS + VIDEO_PRESETS)}.")


def build_tiny_pipeline(name: str, out_dir: Path) -> None:
    """Build the tiny pipeline `name` with fixed seeds and `save_pretrained` it into `out_dir`.

    Inside a torch.distributed process group transformers writes weights on global rank 0 only, so a
    sidecar rank builds in a fresh process with no group (`python -m engine.models.tiny`)."""
    _check_name(name)
    if _in_distributed_context():
        _build_in_subprocess(name, Path(out_dir))
        return
    started = time.perf_counter()
    # The builders reseed torch before every component; fork_rng keeps the caller's RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        pipe = BUILDERS[name]()
    import transformers.utils.logging as transformers_logging

    transformers_logging.disable_progress_bar()  # no "Writing model shards" bar among a first start's console lines
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    logger.info("built %s in %.1fs into %s", name, time.perf_counter() - started, out_dir)


# What makes a process part of a torchrun group (its own or one it may join).
_DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")
BUILD_TIMEOUT_S = 900


def _in_distributed_context() -> bool:
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized()) or settings.torchrun_rank() is not None


def _build_in_subprocess(name: str, out_dir: Path) -> None:
    import subprocess
    import sys


    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "engine.models.tiny", name, str(out_dir)], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except BaseException:
        proc.kill()  # a rank told to stop takes its builder with it
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = out.decode(errors="replace").strip().splitlines()[-5:]
        raise ModelLoadError(f"building the tiny pipeline {name} failed (exit {proc.returncode}): "
                             + " / ".join(tail))


def check_pipeline_folder(path: Path) -> str | None:
    """Why the pipeline folder `path` cannot be trusted, or None: every component that has a config.json (a
    model, not a tokenizer or scheduler) needs weight files whose safetensors headers parse and fit."""
    from engine.models.weights import CorruptWeights, read_header

    path = Path(path)
    try:
        index = json.loads((path / "model_index.json").read_text())
    except (OSError, ValueError) as exc:
        return f"model_index.json is missing or unreadable ({type(exc).__name__})"
    for component, spec in index.items():
        if component.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        folder = path / component
        if not folder.is_dir():
            return f"component {component} is missing"
        if not (folder / "config.json").is_file():
            continue  # a tokenizer or a scheduler: configs only
        weights = sorted(folder.glob("*.safetensors"))
        if not weights:
            return f"component {component} has no weight files"
        for index_file in folder.glob("*.safetensors.index.json"):
            try:
                shards = set(json.loads(index_file.read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, AttributeError):
                return f"component {component}: {index_file.name} is unreadable"
            missing = sorted(shards - {w.name for w in weights})
            if missing:
                return f"component {component} lacks {', '.join(missing)}"
        for weight in weights:
            try:
                read_header(weight)
            except CorruptWeights as exc:
                return str(exc)
    return None


def _is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file() and check_pipeline_folder(path) is None


def _warn_if_stale(path: Path) -> None:
    try:
        version = json.loads((path / COMPLETE_MARKER).read_text()).get("recipe_version")
    except (OSError, ValueError, AttributeError):
        version = None
    if version != RECIPE_VERSION:
        logger.warning(
            "%s was built by tiny recipe %s, this code has %s; delete the folder to rebuild it.",
            path,
            version,
            RECIPE_VERSION,
        )


def _fallback_models_root() -> Path:
    """Where tiny models are built when the cache's models folder cannot be written: a folder of this user's
    own under the temporary directory (made 0700; one owned by anybody else is never used)."""
    root = Path(tempfile.gettempdir()) / f"diffusion-showcase-{os.getuid()}"
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        info = root.lstat()
        if info.st_uid == os.getuid() and not info.st_mode & 0o022 and root.is_dir() and not root.is_symlink():
            return root / "models"
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="diffusion-showcase-")) / "models"


def ensure_tiny_pipeline(name: str, models_root: Path) -> Path:
    """Return `models_root/name`, building it first if it is missing or fails the check.

    Safe across processes: one builder at a time under an fcntl lock, the build goes into a temporary
    folder beside the target (same file system) and is renamed into place only once complete, with the
    marker file already inside. Readers therefore never see a half-written model. A folder counts as
    complete only when its marker is there and every component's weights are (check_pipeline_folder); one
    that fails is rebuilt once, with a warning. A models folder that cannot be written (read-only, full)
    falls back to a private temporary one, with a warning.
    """

    _check_name(name)
    models_root = Path(models_root)
    target = models_root / name
    if (target / COMPLETE_MARKER).is_file():  # fast path, no lock
        problem = check_pipeline_folder(target)
        if problem is None:
            _warn_if_stale(target)
            return target
        logger.warning("the tiny pipeline %s is marked complete but %s; rebuilding it", name, problem)
    try:
        return _build_locked(name, models_root)
    except OSError as exc:
        if exc.errno not in _UNWRITABLE:
            raise
        fallback = _fallback_models_root()
        logger.warning("cannot build the tiny pipeline %s in the cache's models folder (%s); building it in a "
                       "temporary folder instead: fix the cache folder or pass --cache-dir", name,
                       exc.strerror or exc)
        try:
            return _build_locked(name, fallback)
        except OSError as again:
            raise ModelLoadError(f"cannot build the tiny pipeline {name}: its cache folder is not writable "
                                 f"({exc.strerror or exc}) and neither is a temporary folder "
                                 f"({again.strerror or again}); fix the cache folder's permissions or free "
                                 "space, or pass --cache-dir") from None


_UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT}


def _build_locked(name: str, models_root: Path) -> Path:
    target = models_root / name
    if _is_complete(target):
        return target
    models_root.mkdir(parents=True, exist_ok=True)
    with open(models_root / f".{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed (also if this process dies)
        try:
            if _is_complete(target):  # another process built it while we waited
                return target
            # Leftovers of a builder that died: we hold the lock, so nobody is writing them now.
            for stale in models_root.glob(f".{name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if target.exists():  # a folder that fails the check is not trustworthy
                logger.warning("removing incomplete %s", target)
                shutil.rmtree(target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models_root))
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the renamed model folder should not be
            try:
                build_tiny_pipeline(name, tmp)
                problem = check_pipeline_folder(tmp)
                if problem is not None:  # never mark an incomplete build complete
                    raise ModelLoadError(f"building the tiny pipeline {name} left an incomplete folder: {problem}")
                (tmp / COMPLETE_MARKER).write_text(
                    json.dumps({"name": name, "recipe_version": RECIPE_VERSION})
                )
                os.replace(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    logger.info("tiny pipeline %s ready at %s", name, target)
    return target


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.models.tiny NAME OUT_DIR`: build one tiny pipeline into OUT_DIR (what a sidecar rank runs)."""
    import sys
    import threading

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m engine.models.tiny NAME OUT_DIR", file=sys.stderr)
        return 2
    parent = os.getppid()

    def orphaned() -> None:  # the rank that asked is gone: stop building for nobody
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_tiny_pipeline(args[0], Path(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
