"""Mode `aot`: one AOTInductor package per bucket, loaded in seconds, every package on the engine's weights.

Why: a compiled bucket costs a warm-up in every new process (the persistent inductor cache shortens it,
but a fresh process still traces and re-links every graph; the figures: docs/benchmarks.md). flux-fast and Hugging Face's ZeroGPU Spaces instead export the denoiser ahead of time with
AOTInductor and load the compiled `.pt2` in seconds. The weights stay out of the package: each package
is loaded with `load_constants(..., user_managed=True)` pointing at the tensors the engine already holds,
so four buckets cost about what one does.

Per bucket, and per denoiser batch shape (classifier-free guidance doubles the batch, so a CFG preset
gets two packages, as the warm-up warms two compiled graphs (`WarmRequests.guidances`); a batched bucket of n images,
engine/pipeline/batching.py, has its own packages at n times those batches, and a vae.decode package at n):

1. capture: one short eager run of the pipeline at the bucket, with stand-ins that record the exact
   arguments the pipeline gives the denoiser and `vae.decode` (a package takes exactly the exported
   keywords; `return_dict=False` included);
2. export: `torch.export.export(clone, args, kwargs, strict=False)` on a structural clone (export swaps
   parameters for fakes while tracing; the clone keeps requests served meanwhile on the real module);
3. compile: `aoti_compile_and_package` with `aot_inductor.package_constants_in_so=False`;
4. load: the package's loader (`open_package`) + `load_constants(the engine's tensors, user_managed=True)`.

Packages live under `<cache>/aot/<preset>/<slot>/<key hash>/`, keyed by everything that makes one
invalid (`package_key`: model folder content or Hub revision, precision, device and what a package is
bound to there, torch/diffusers/libstdc++ versions, graph-changing options, text length, size, batch).
A manifest next to the package holds the key and a checksum. A package whose key differs is stale and
never loaded; one whose checksum, load or constants fail is corrupt. Both are reported (the bucket's
`origin` on the board) and rebuilt.

The VAE decoder gets a package too when `compile_vae` is on (the default, as in compile mode): it
decodes faster than eager too (docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import settings
from engine.errors import scrub_paths
from engine.pipeline import recipes
from engine.pipeline.faults import COMPILE_FAILURE
from engine.pipeline.variants import pipeline_over, vae_decoding_with
from engine.processes import pid_alive
from engine.protocol import BucketKey, Mode, Size

log = logging.getLogger(__name__)

AOT_FORMAT = 1  # bump when what a package holds or how it is called changes
PACKAGE = "package.pt2"
MANIFEST = "manifest.json"
KEEP_PER_SLOT = 3  # key versions kept per (kind, device, precision, size, batch): older ones are pruned
ORIGIN_LOADED = "loaded from package"
ORIGIN_BUILT = "built now"
DENOISER, VAE = "denoiser", "vae"


class PackageError(Exception):
    """A package that must not be used: `kind` is "corrupt" or "stale"."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind} package: {detail}")
        self.kind = kind
        self.detail = detail


# --- what a package is bound to ------------------------------------------------------------------
def _libstdcxx() -> str:
    """The libstdc++ this process runs with: a package's .so links it, and an older one cannot load it."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libstdc++" in line:
                    return os.path.basename(os.path.realpath(line.split()[-1]))
    except OSError:
        pass
    return "unknown"


def runtime_fingerprint() -> dict:
    import diffusers

    libc, version = platform.libc_ver()
    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "libstdc++": _libstdcxx(),
            "libc": f"{libc} {version}".strip() or platform.system()}


def folder_fingerprint(folder: Path) -> str:
    """Content identity of a model folder, cheap for multi-GB weights: small files are hashed whole; a large
    one by size, mtime and its first MiB (a safetensors header: every tensor's name, dtype and shape); a
    symlink by its target's name (the Hub cache names blobs by their content hash)."""
    h = hashlib.sha256()
    folder = Path(folder)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        if path.is_symlink():
            h.update(os.path.basename(os.path.realpath(path)).encode())
            continue
        st = path.stat()
        if st.st_size <= 1 << 20:
            h.update(path.read_bytes())
        else:
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
            with open(path, "rb") as f:
                h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def model_fingerprint(source: str, component: str) -> str:
    """The model a package was built from: a local folder's content hash, or a Hub snapshot's revision."""
    root = Path(source)
    if root.is_dir():
        folder = root / component
        return "folder:" + folder_fingerprint(folder if folder.is_dir() else root)
    try:
        from huggingface_hub import snapshot_download

        snapshot = snapshot_download(source, allow_patterns=[f"{component}/*"], local_files_only=True)
        return f"hub:{source}@{Path(snapshot).name}"
    except Exception:  # not in the local Hub cache as a snapshot: the id alone
        return f"hub:{source}"


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def describe_change(old: dict, new: dict, limit: int = 3) -> str:
    """What differs between two keys, as 'torch 2.12.0 -> 2.13.0, ...'."""
    a, b = _flat(old), _flat(new)
    changes = [f"{k} {a.get(k)} -> {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    more = f", and {len(changes) - limit} more" if len(changes) > limit else ""
    return ", ".join(changes[:limit]) + more if changes else "built with another key"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "model"


# --- the store -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lookup:
    state: str  # "present", "absent" or "stale" (only packages with other keys in the slot)
    folder: Path  # where this key's package is (or goes)
    detail: str = ""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class PackageStore:
    """Packages on disk: <root>/<preset>/<kind>-<device>-<precision>-<WxH>-b<batch>/<key hash>/."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.clean_interrupted()

    def clean_interrupted(self) -> list[Path]:
        """Remove staging folders whose builder is gone (killed or stopped mid-build): their name carries
        the builder's pid. A live builder's folder, even another process's, is left alone."""
        removed = []
        if not self.root.is_dir():
            return removed
        for staging in self.root.glob("*/*/.*.building-*"):
            try:
                pid = int(staging.name.rsplit(".building-", 1)[1].split("-")[0])
            except (IndexError, ValueError):
                pid = None
            if pid is None or not pid_alive(pid):
                shutil.rmtree(staging, ignore_errors=True)
                removed.append(staging)
        if removed:
            log.info("removed %d interrupted aot build(s)", len(removed))
        return removed

    def slot(self, key: dict) -> Path:
        name = f"{key['kind']}-{key['device']}-{key['precision']}-{key['size']}-b{key['batch']}"
        return self.root / _slug(key["preset"]) / name

    def folder(self, key: dict) -> Path:
        return self.slot(key) / key_hash(key)

    def find(self, key: dict) -> Lookup:
        folder = self.folder(key)
        if (folder / MANIFEST).is_file():
            return Lookup("present", folder)
        slot = folder.parent
        others = [d for d in slot.iterdir() if (d / MANIFEST).is_file()] if slot.is_dir() else []
        if not others:
            return Lookup("absent", folder)
        newest = max(others, key=lambda d: (d / MANIFEST).stat().st_mtime)
        try:
            old = json.loads((newest / MANIFEST).read_text())["key"]
            detail = describe_change(old, key)
        except (OSError, ValueError, KeyError):
            detail = "an unreadable manifest"
        return Lookup("stale", folder, detail)

    def commit(self, staging: Path, key: dict, **facts) -> Path:
        """Move a built package into place with its manifest (atomic: a reader never sees half a package)."""
        package = staging / PACKAGE
        manifest = {"key": key, "hash": key_hash(key), "sha256": sha256_file(package),
                    "bytes": package.stat().st_size, "built_at": time.time(), **facts}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
        folder = self.folder(key)
        try:
            os.replace(staging, folder)
        except OSError:  # another process committed the same key meanwhile: keep theirs
            shutil.rmtree(staging, ignore_errors=True)
            if not (folder / MANIFEST).is_file():
                raise
        self.prune(folder.parent)
        return folder

    def staging(self, key: dict) -> Path:
        folder = self.folder(key)
        staging = folder.with_name(f".{folder.name}.building-{os.getpid()}-{threading.get_ident()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return staging

    def remove(self, folder: Path) -> None:
        shutil.rmtree(folder, ignore_errors=True)

    def prune(self, slot: Path) -> None:
        """Keep the newest KEEP_PER_SLOT keys of a slot; drop builds a killed process left half done."""
        kept = sorted((d for d in slot.iterdir() if (d / MANIFEST).is_file()),
                      key=lambda d: (d / MANIFEST).stat().st_mtime, reverse=True)
        for old in kept[KEEP_PER_SLOT:]:
            shutil.rmtree(old, ignore_errors=True)
        self.clean_interrupted()


# --- calls -----------------------------------------------------------------------------------------
def call_signature(args: tuple, kwargs: dict) -> str:
    """What a package was exported for: the structure of the call, each tensor's shape and dtype, every
    other value. A call with a different signature is not this package's (it runs eagerly instead)."""
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten((tuple(args), dict(sorted(kwargs.items()))))
    parts = [("T", tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else ("V", repr(x)) for x in leaves]
    return repr((str(spec), tuple(parts)))


def constants_of(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The module's own parameter and buffer tensors by name (tied ones under each name): what
    `load_constants(..., user_managed=True)` points a package at. No copies."""
    named = {}
    for name, tensor in module.named_parameters(remove_duplicate=False):
        named[prefix + name] = tensor
    for name, tensor in module.named_buffers(remove_duplicate=False):
        named[prefix + name] = tensor
    return named


def detached_clone(module: torch.nn.Module) -> torch.nn.Module:
    """A module tree with its own parameter, buffer and child dicts holding the same tensors.

    Non-strict export swaps each module's parameters for fake tensors while it traces; on the real module
    that would break a request running meanwhile (the engine serves eagerly while a bucket builds)."""
    clone = copy.copy(module)
    clone._parameters = OrderedDict(module._parameters)
    clone._buffers = OrderedDict(module._buffers)
    clone._modules = OrderedDict(
        (name, detached_clone(child) if child is not None else None) for name, child in module._modules.items()
    )
    return clone


class _Delegate(torch.nn.Module):
    """Stands in for a pipeline component: calls are its own, every attribute is the real module's
    (pipelines read `.config`, `.dtype`, `.device` and enter `cache_context(...)` on their denoiser)."""

    def __init__(self, real: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "_real", real)  # not a submodule: its parameters stay the real module's

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_real"], name)


class _DecodeModule(torch.nn.Module):
    """`vae.decode(z, return_dict=False)[0]` as a module, so it can be exported on its own."""

    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae

    def forward(self, z):
        return self.vae.decode(z, return_dict=False)[0]


class AotDenoiser(_Delegate):
    """The denoiser of the aot variant: each call runs the package exported for its signature; a call no
    package matches runs the real module eagerly (counted in `misses`, never compiled)."""

    def __init__(self, real: torch.nn.Module):
        super().__init__(real)
        object.__setattr__(self, "packages", {})
        object.__setattr__(self, "hits", 0)
        object.__setattr__(self, "misses", 0)

    def forward(self, *args, **kwargs):
        package = self.packages.get(call_signature(args, kwargs))
        if package is None:
            object.__setattr__(self, "misses", self.misses + 1)
            return self.__dict__["_real"](*args, **kwargs)
        object.__setattr__(self, "hits", self.hits + 1)
        return package(*args, **kwargs)


class AotDecoder:
    """`vae.decode` of the aot variant: the package for the latents' shape, else the real decode."""

    def __init__(self, vae: torch.nn.Module):
        self.vae = vae
        self.packages: dict[str, object] = {}
        self.hits = 0
        self.misses = 0

    def __call__(self, z, return_dict: bool = True, **kwargs):
        package = None if kwargs else self.packages.get(call_signature((z,), {}))
        if package is None:
            self.misses += 1
            return self.vae.decode(z, return_dict=return_dict, **kwargs)
        self.hits += 1
        sample = package(z)
        if not return_dict:
            return (sample,)
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=sample)


# --- build and load --------------------------------------------------------------------------------
def build_package(module: torch.nn.Module, args: tuple, kwargs: dict, inductor_configs: dict, path: Path) -> None:
    """torch.export the module (on a structural clone) at these example inputs and AOT-compile it to `path`."""
    exported = torch.export.export(detached_clone(module), tuple(args), dict(kwargs), strict=False)
    torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=inductor_configs)


def compile_module(module: torch.nn.Module, args: tuple, kwargs: dict, inductor_configs: dict, folder: Path):
    """Build a package of `module` in `folder` and load it on the module's own tensors (the denoiser bench)."""
    path = Path(folder) / PACKAGE
    build_package(module, args, kwargs, inductor_configs, path)
    package = open_package(path)
    constants = constants_of(module)
    package.load_constants({n: constants[n] for n in package.get_constant_fqns()}, check_full_update=True,
                           user_managed=True)
    return package


def cpu_isa_mismatch(metadata: dict) -> str | None:
    """Why this machine's CPU cannot run a package's host code (built for another architecture, or for
    vector instructions it lacks: the .so would die on an illegal instruction), or None."""
    machine = metadata.get("AOTI_MACHINE")
    if machine and machine != platform.machine():
        return f"built for {machine}, this machine is {platform.machine()}"
    wanted = metadata.get("AOTI_CPU_ISA", "").lower().split()
    if wanted and platform.machine() in ("x86_64", "AMD64"):
        from torch._inductor.cpu_vec_isa import x86_isa_checker

        lacking = sorted(set(wanted) - set(x86_isa_checker()))
        if lacking:
            return f"built for CPU instructions this machine lacks ({', '.join(lacking)})"
    return None


def open_package(path: Path):
    """Open an AOTInductor package without `aoti_load_package`'s device probe.

    torch's loader compares the package with the machine through inductor's CPU vector-ISA probe, which
    builds and runs small C++ programs in any process whose inductor cache is empty (every fresh process
    on a Space) and then only warns on a mismatch (docs/spaces.md has the cost). Reading the CPU's flags
    is enough, and a mismatch is refused (the package would crash the process) so the caller rebuilds it."""
    try:
        from torch.export.pt2_archive._package import AOTICompiledModel

        loader = torch._C._aoti.AOTIModelPackageLoader
    except (ImportError, AttributeError):  # another torch: its public loader
        return torch._inductor.aoti_load_package(str(path))
    mismatch = cpu_isa_mismatch(loader.load_metadata_from_package(str(path), "model"))
    if mismatch:
        raise PackageError("stale", mismatch)
    return AOTICompiledModel(loader(str(path), "model", False, 1, -1))


def load_package(folder: Path, constants: dict[str, torch.Tensor]):
    """Load a committed package and point it at `constants`; PackageError when it must not be used."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        expected = manifest["sha256"]
    except (OSError, ValueError, KeyError) as exc:
        raise PackageError("corrupt", f"unreadable manifest ({type(exc).__name__})") from None
    path = folder / PACKAGE
    try:
        actual = sha256_file(path)
    except OSError as exc:
        raise PackageError("corrupt", f"package file unreadable ({exc.strerror or exc})") from None
    if actual != expected:
        raise PackageError("corrupt", f"checksum mismatch: {path.stat().st_size} bytes, expected "
                                      f"{manifest.get('bytes')} (truncated or modified)")
    try:
        package = open_package(path)
        names = package.get_constant_fqns()
    except PackageError:
        raise
    except Exception as exc:
        raise PackageError("corrupt", f"cannot be loaded: {type(exc).__name__}: {str(exc)[:200]}") from None
    missing = [n for n in names if n not in constants]
    if missing:
        raise PackageError("stale", f"the model has no tensor {missing[0]!r} (and {len(missing) - 1} more)")
    try:
        package.load_constants({n: constants[n] for n in names}, check_full_update=True, user_managed=True)
    except Exception as exc:
        raise PackageError("stale", f"constants do not fit: {type(exc).__name__}: {str(exc)[:200]}") from None
    return package, manifest


@dataclass
class _Capture:
    denoiser: tuple[tuple, dict] | None = None
    decode: tuple[tuple, dict] | None = None


class _StopCapture(Exception):
    pass


class _Recorder(_Delegate):
    def __init__(self, real, capture: _Capture, stop: bool):
        super().__init__(real)
        object.__setattr__(self, "capture", capture)
        object.__setattr__(self, "stop", stop)

    def forward(self, *args, **kwargs):
        if self.capture.denoiser is None:
            self.capture.denoiser = (args, kwargs)
            if self.stop:
                raise _StopCapture
        return self.__dict__["_real"](*args, **kwargs)


@dataclass(frozen=True)
class AotTarget:
    """What an engine's aot packages are built for, and keyed by: its preset, recipe options, device spec,
    precision plan, the model source from_pretrained loaded, and the folder its packages live in."""

    preset: object
    recipe: object
    spec: object
    precision: object
    source: str
    store_root: Path
    vae_source: str | None = None  # the VAE's own folder when the preset loads it from another model


class AotEngine:
    """Mode aot of one engine: the variant pipeline (its denoiser and vae.decode dispatch to packages) and
    the per-bucket warm-up that loads each package or builds the missing ones.

    Built on the engine's loaded pipeline `base`, for `target`; the capture runs the warm-up's requests
    (`requests`: engine/pipeline/warmup.py WarmRequests) through `caller` (engine/pipeline/calls.py); `faults`
    says whether a build must fail; `batch_sizes` are the engine's (a size's packages, one per batch)."""

    def __init__(self, base, target: AotTarget, requests, caller, faults, batch_sizes: tuple[int, ...],
                 inductor_configs: dict):
        self.base, self.target, self.requests, self.caller, self.faults = base, target, requests, caller, faults
        self.batch_sizes = batch_sizes
        self.inductor_configs = inductor_configs
        self.store = PackageStore(settings.aot_dir() or target.store_root)
        self.denoiser_name = target.preset.denoiser
        self.real_denoiser = getattr(base, self.denoiser_name)
        self.denoiser = AotDenoiser(self.real_denoiser)
        self.decoder = AotDecoder(base.vae) if target.recipe.compile_vae and getattr(base, "vae", None) else None
        replaced = {self.denoiser_name: self.denoiser}
        if self.decoder is not None:
            replaced["vae"] = vae_decoding_with(base.vae, self.decoder)
        self.pipe = pipeline_over(base, **replaced)
        self._keys_lock = threading.Lock()
        self._model_ids: dict[str, str] = {}

    # -- keys ---------------------------------------------------------------------------------------
    def batch(self, guidance: float, images: int = 1) -> int:
        """The denoiser's batch for `images` images in one call (engine/pipeline/batching.py)."""
        preset = self.target.preset
        return (2 if preset.cfg and guidance > 1.0 else 1) * images

    def _model_id(self, component: str) -> str:
        with self._keys_lock:
            if component not in self._model_ids:
                vae_source = self.target.vae_source if component == "vae" else None
                self._model_ids[component] = model_fingerprint(vae_source or self.target.source, component)
            return self._model_ids[component]

    def package_key(self, kind: str, size: Size, batch: int) -> dict:
        t = self.target
        component = self.denoiser_name if kind == DENOISER else "vae"
        module = self.real_denoiser if kind == DENOISER else self.base.vae
        options = recipes.graph_options(t.recipe)  # the recipe levers that change the graph
        flags = t.recipe.inductor_flags
        options["inductor_flags"] = bool(t.spec.inductor_flags_default if flags is None else flags)
        return {
            "format": AOT_FORMAT, "kind": kind, "preset": t.preset.name, "pipeline": t.preset.pipeline,
            "module": type(module).__name__, "model": self._model_id(component),
            "precision": str(t.precision.precision), "device": t.spec.name, "target": t.spec.aot_target(),
            **runtime_fingerprint(), "options": options, "text_len": t.preset.max_sequence_length,
            "size": str(size), "batch": batch,
        }

    def constants(self, kind: str) -> dict[str, torch.Tensor]:
        if kind == DENOISER:
            return constants_of(self.real_denoiser)
        return constants_of(self.base.vae, prefix="vae.")

    # -- capture ------------------------------------------------------------------------------------
    def capture(self, bucket: BucketKey, guidance: float, decode: bool) -> _Capture:
        """One eager run at the bucket recording what the pipeline passes the denoiser (and vae.decode)."""
        captured = _Capture()
        replaced = {self.denoiser_name: _Recorder(self.real_denoiser, captured, stop=not decode)}
        if decode:

            def record_decode(z, *args, **kwargs):
                captured.decode = ((z, *args), kwargs)
                raise _StopCapture

            replaced["vae"] = vae_decoding_with(self.base.vae, record_decode)
        run = pipeline_over(self.base, **replaced)
        request = self.requests.request(BucketKey(Mode.EAGER, bucket.size), guidance).replace(
            steps=1, request_id=f"aot-capture-{bucket}")
        members = [request.replace(seed=i) for i in range(bucket.batch)] if bucket.batch > 1 else None
        try:
            self.caller.call(run, request, members=members)
        except _StopCapture:
            pass
        if captured.denoiser is None or (decode and captured.decode is None):
            raise RuntimeError(f"the {self.target.preset.pipeline} run at {bucket.size} never called the "
                               f"{'decoder' if captured.denoiser else 'denoiser'}: nothing to export")
        return captured

    # -- one bucket ---------------------------------------------------------------------------------
    def warm(self, bucket: BucketKey, report=None) -> tuple[str, list[str]]:
        """Load every package of `bucket`, building what is missing, stale or corrupt. Returns the origin
        text for the board and notices; `report(text)` is told what happens while it happens."""
        report = report or (lambda text: None)
        built, problems = [], []
        guidances = self.requests.guidances()
        for i, guidance in enumerate(guidances):
            kinds = [DENOISER] + ([VAE] if self.decoder is not None and i == 0 else [])
            captured = None
            for kind in kinds:
                batch = self.batch(guidance, bucket.batch) if kind == DENOISER else bucket.batch
                key = self.package_key(kind, bucket.size, batch)
                found = self.store.find(key)
                if found.state == "present":
                    try:
                        self._install(kind, *load_package(found.folder, self.constants(kind)))
                        continue
                    except PackageError as exc:  # visitors read the problem on the board: no server path
                        problems.append(scrub_paths(f"{exc.kind} {kind} package replaced: {exc.detail}"))
                        log.warning("%s: %s", bucket, problems[-1])
                        self.store.remove(found.folder)
                elif found.state == "stale":
                    problems.append(scrub_paths(f"stale {kind} package replaced: {found.detail}"))
                report(f"building {kind} b{batch}" + (f" ({problems[-1]})" if problems else ""))
                if captured is None:
                    captured = self.capture(bucket, guidance, decode=VAE in kinds)
                self._build(kind, key, captured)
                folder = self.store.folder(key)
                self._install(kind, *load_package(folder, self.constants(kind)))
                built.append(f"{kind} b{batch}")
        if not built:
            return ORIGIN_LOADED, []
        origin = ORIGIN_BUILT + (f" ({'; '.join(problems)})" if problems else "")
        return origin, [f"aot {bucket}: {p}" for p in problems]

    def _build(self, kind: str, key: dict, captured: _Capture) -> None:
        if self.faults.should_fail_compile():
            raise RuntimeError(COMPILE_FAILURE)
        if kind == DENOISER:
            module, (args, kwargs) = self.real_denoiser, captured.denoiser
        else:
            module, (args, kwargs) = _DecodeModule(self.base.vae), (captured.decode[0][:1], {})
        staging = self.store.staging(key)
        start = time.perf_counter()
        try:
            build_package(module, args, kwargs, self.inductor_configs, staging / PACKAGE)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.store.commit(staging, key, signature=call_signature(args, kwargs), build_s=time.perf_counter() - start)

    def remove_packages(self, size: Size) -> None:
        """Delete this engine's packages for a size (every batch shape), so the next warm-up builds them."""
        for guidance in self.requests.guidances():
            for images in self.batch_sizes:
                for kind, batch in ((DENOISER, self.batch(guidance, images)), (VAE, images)):
                    self.store.remove(self.store.folder(self.package_key(kind, size, batch)))

    def _install(self, kind: str, package, manifest: dict) -> None:
        target = self.denoiser if kind == DENOISER else self.decoder
        target.packages[manifest["signature"]] = package

    def counters(self) -> tuple[int, int]:
        """(hits, misses) of calls so far, denoiser and decoder together."""
        hits, misses = self.denoiser.hits, self.denoiser.misses
        if self.decoder is not None:
            hits, misses = hits + self.decoder.hits, misses + self.decoder.misses
        return hits, misses
