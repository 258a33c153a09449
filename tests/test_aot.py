"""Mode aot: AOTInductor packages per bucket, keyed, checked, shared weights, built ahead of time.

A package build costs 40 s of CPU (minutes on a loaded 2-core machine), so these tests build as little
as possible: the tiny-flux 64x64 packages (denoiser + VAE decoder) live in the persistent test cache and
are built only when missing; the one build every session pays is the corrupt-package test's rebuild of
the denoiser package, on a copy of the store. Key, staleness, refusal and weight-sharing checks reuse
what is there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import make_request, make_runner

from engine import devices
from engine.config.presets import get_preset
from engine.errors import UnsupportedCombination
from engine.pipeline import aot
from engine.pipeline.runner import PipelineRunner, export_aot_packages
from engine.protocol import (
    BucketKey,
    BucketState,
    EngineConfig,
    EngineKey,
    EngineOptions,
    GenerateRequest,
    Mode,
    Size,
)

pytestmark = pytest.mark.slow  # builds and loads AOTInductor packages

REPO = Path(__file__).resolve().parent.parent
KEY = EngineKey("tiny-flux", "cpu", "fp32")
BUCKET = BucketKey(Mode.AOT, Size(64, 64))


def request(**fields) -> GenerateRequest:
    return make_request(**{"mode": "aot", **fields})


@pytest.fixture(scope="module")
def runner(cache_dir, tiny_models):
    """One engine in this process with its aot 64x64 bucket warm (loaded from the persistent test cache;
    built there the first time)."""
    r = make_runner(cache_dir)
    info = r.warm_bucket(BUCKET)
    assert info.state == BucketState.WARM, info.error
    return r


def capture(runner) -> tuple[tuple, dict]:
    return runner.variants.aot.capture(BUCKET, runner.preset.guidance, decode=False).denoiser


# ---- keys -----------------------------------------------------------------------------------------


def test_package_key_changes_with_each_invalidating_input(runner, monkeypatch, tmp_path):
    engine = runner.variants.aot
    base = engine.package_key(aot.DENOISER, Size(64, 64), 1)
    keys = {"base": base}
    keys["size"] = engine.package_key(aot.DENOISER, Size(128, 64), 1)
    keys["batch"] = engine.package_key(aot.DENOISER, Size(64, 64), 2)
    keys["kind"] = engine.package_key(aot.VAE, Size(64, 64), 1)
    for field, value in (("fuse_qkv", True), ("attention_backend", "_native_math"), ("cuda_graphs", True),
                         ("max_autotune", True), ("channels_last", True), ("inductor_flags", True)):
        recipe = dataclasses.replace(engine.target.recipe, **{field: value})
        monkeypatch.setattr(engine, "target", dataclasses.replace(engine.target, recipe=recipe))
        keys[field] = engine.package_key(aot.DENOISER, Size(64, 64), 1)
        monkeypatch.undo()
    precision = dataclasses.replace(engine.target.precision, precision="bf16")
    monkeypatch.setattr(engine, "target", dataclasses.replace(engine.target, precision=precision))
    keys["precision"] = engine.package_key(aot.DENOISER, Size(64, 64), 1)
    monkeypatch.undo()
    spec = dataclasses.replace(engine.target.spec, aot_target_fn=lambda: "x86_64 avx512")
    monkeypatch.setattr(engine, "target", dataclasses.replace(engine.target, spec=spec))
    keys["target"] = engine.package_key(aot.DENOISER, Size(64, 64), 1)
    monkeypatch.undo()
    preset = dataclasses.replace(engine.target.preset, max_sequence_length=128)
    monkeypatch.setattr(engine, "target", dataclasses.replace(engine.target, preset=preset))
    keys["text_len"] = engine.package_key(aot.DENOISER, Size(64, 64), 1)
    monkeypatch.undo()
    for field in ("torch", "diffusers", "libstdc++"):
        real = aot.runtime_fingerprint
        monkeypatch.setattr(aot, "runtime_fingerprint", lambda field=field, real=real: {**real(), field: "other"})
        keys[field] = engine.package_key(aot.DENOISER, Size(64, 64), 1)
        monkeypatch.undo()
    monkeypatch.setattr(engine, "_model_ids", {"transformer": "folder:0123456789abcdef"})
    keys["model"] = engine.package_key(aot.DENOISER, Size(64, 64), 1)
    monkeypatch.undo()
    hashes = {name: aot.key_hash(k) for name, k in keys.items()}
    assert len(set(hashes.values())) == len(hashes), hashes
    assert aot.key_hash(engine.package_key(aot.DENOISER, Size(64, 64), 1)) == hashes["base"]  # deterministic

    # The model's identity follows its folder's content.
    folder = tmp_path / "transformer"
    shutil.copytree(Path(runner.source) / "transformer", folder)
    before = aot.folder_fingerprint(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_layers": 3}))
    assert aot.folder_fingerprint(folder) != before


def test_stale_package_is_never_loaded_and_says_why(runner, monkeypatch, tmp_path):
    """A package whose key differs (here: built by another torch) is reported stale and rebuilt, not loaded."""
    engine = runner.variants.aot
    key = engine.package_key(aot.DENOISER, Size(64, 64), 1)
    store = aot.PackageStore(tmp_path / "aot")
    old = {**key, "torch": "2.12.0"}
    shutil.copytree(engine.store.folder(key), store.folder(old))
    manifest = store.folder(old) / aot.MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "key": old}))
    found = store.find(key)
    assert found.state == "stale" and "torch 2.12.0 -> " in found.detail
    assert not found.folder.exists()

    # The engine reports it and goes on to build (stopped here: the build is not what this test measures).
    class Built(Exception):
        pass

    loaded, reports = [], []
    monkeypatch.setattr(engine, "store", store)
    monkeypatch.setattr(engine, "_build", lambda *a: (_ for _ in ()).throw(Built()))
    monkeypatch.setattr(aot, "load_package", lambda *a: loaded.append(a) or (_ for _ in ()).throw(AssertionError))
    with pytest.raises(Built):
        engine.warm(BUCKET, report=reports.append)
    assert not loaded
    assert reports and "stale denoiser package replaced: torch 2.12.0 -> " in reports[0]


# ---- corrupt packages -----------------------------------------------------------------------------


def test_corrupt_package_is_reported_on_the_board_and_rebuilt(runner, cache_dir, tmp_path):
    # A copy of the store (the tiny models linked, not copied), so the persistent packages stay intact.
    (tmp_path / "models").symlink_to(cache_dir / "models")
    shutil.copytree(cache_dir / "aot" / "tiny-flux", tmp_path / "aot" / "tiny-flux")
    key = runner.variants.aot.package_key(aot.DENOISER, Size(64, 64), 1)
    folder = aot.PackageStore(tmp_path / "aot").folder(key)
    package = folder / aot.PACKAGE
    size = package.stat().st_size
    with open(package, "r+b") as f:
        f.truncate(size // 2)

    events = []
    r = make_runner(tmp_path, listener=events.append)
    info = r.warm_bucket(BUCKET)
    assert info.state == BucketState.WARM, info.error
    assert info.origin.startswith(aot.ORIGIN_BUILT) and "corrupt denoiser package replaced" in info.origin
    assert "checksum mismatch" in info.origin and info.as_dict()["origin"] == info.origin
    building = [e.origin for e in events if e.state == BucketState.COMPILING and e.origin]
    assert building and building[0].startswith("building denoiser")
    assert any("corrupt" in n for n in r.notices)
    # Rebuilt in place, checksum and all: a fresh engine loads it.
    manifest = json.loads((folder / aot.MANIFEST).read_text())
    assert package.stat().st_size > size // 2 and aot.sha256_file(package) == manifest["sha256"]
    again = make_runner(tmp_path).warm_bucket(BUCKET)
    assert again.state == BucketState.WARM and again.origin == aot.ORIGIN_LOADED

    # An unreadable manifest or a package that does not load are corrupt too (checked, not rebuilt here).
    with pytest.raises(aot.PackageError, match="unreadable manifest"):
        aot.load_package(tmp_path / "nowhere", {})
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / aot.PACKAGE).write_bytes(b"not a zip")
    (garbage / aot.MANIFEST).write_text(json.dumps({"sha256": aot.sha256_file(garbage / aot.PACKAGE)}))
    with pytest.raises(aot.PackageError, match="cannot be loaded") as err:
        aot.load_package(garbage, {})
    assert err.value.kind == "corrupt"


def test_a_package_for_a_cpu_this_machine_is_not_is_refused(runner, cache_dir, monkeypatch):
    """Loading reads the CPU's flags instead of inductor's probe build; a package built for instructions
    this CPU lacks would die on an illegal instruction, so it is refused as stale (and rebuilt)."""
    import platform

    from torch._inductor import cpu_vec_isa

    assert aot.cpu_isa_mismatch({"AOTI_MACHINE": platform.machine(), "AOTI_CPU_ISA": ""}) is None
    assert "built for riscv64" in aot.cpu_isa_mismatch({"AOTI_MACHINE": "riscv64"})
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the instruction-set check reads x86 flags")
    # The key's instruction set, read from the flags, is the one inductor's own probe picks here.
    assert devices.resolve_device("cpu").aot_target() == f"{platform.machine()} {cpu_vec_isa.pick_vec_isa()}"
    folder = aot.PackageStore(cache_dir / "aot").folder(runner.variants.aot.package_key(aot.DENOISER, Size(64, 64), 1))
    constants = runner.variants.aot.constants(aot.DENOISER)
    aot.load_package(folder, constants)  # this machine built it: loads
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["sse"])
    with pytest.raises(aot.PackageError, match="CPU instructions this machine lacks") as err:
        aot.load_package(folder, constants)
    assert err.value.kind == "stale"


# ---- correctness and weights ----------------------------------------------------------------------


def test_aot_output_matches_eager(runner):
    args, kwargs = capture(runner)
    real = runner.pipe.transformer
    with torch.no_grad():
        eager = real(*args, **kwargs)[0]
        before = runner.variants.aot.denoiser.hits
        packaged = runner.variants.aot.denoiser(*args, **kwargs)[0]
    assert runner.variants.aot.denoiser.hits == before + 1  # it really ran the package
    assert (packaged - eager).abs().max().item() < 1e-4
    a = runner.generate(request(mode="eager", seed=5))
    b = runner.generate(request(seed=5))
    assert b.warm and not b.eager_fallback and b.recompiles == 0
    import numpy as np

    diff = np.abs(np.asarray(a.image(), dtype=np.int16) - np.asarray(b.image(), dtype=np.int16)).max()
    assert diff <= 2, diff  # the whole pipeline, decoder package included, within rounding of eager


def test_packages_read_the_engines_own_weights(runner):
    engine = runner.variants.aot
    real = runner.pipe.transformer
    constants = engine.constants(aot.DENOISER)
    params = dict(real.named_parameters())
    assert params and all(constants[n].data_ptr() == p.data_ptr() for n, p in params.items())
    vae = engine.constants(aot.VAE)
    assert vae["vae.decoder.conv_out.weight"].data_ptr() == runner.pipe.vae.decoder.conv_out.weight.data_ptr()
    # Behaviour: an in-place change of the engine's weight shows in the package's output at once.
    args, kwargs = capture(runner)
    bias = real.proj_out.bias
    saved = bias.detach().clone()
    try:
        with torch.no_grad():
            bias.add_(0.5)
            eager = real(*args, **kwargs)[0]
            packaged = engine.denoiser(*args, **kwargs)[0]
        assert (packaged - eager).abs().max().item() < 1e-4
    finally:
        with torch.no_grad():
            bias.copy_(saved)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def test_a_second_package_adds_no_weight_memory(cache_dir):
    """A 64 MiB-weight module exported once (kept in the test cache): each further load on the same
    tensors adds far less than its weights; a load that copies them (user_managed=False) adds them all,
    so the measurement can tell the two apart."""
    torch.manual_seed(0)
    module = torch.nn.Linear(4096, 4096, bias=False)  # 64 MiB of fp32 weights
    x = torch.randn(2, 4096)
    folder = cache_dir / "aot-test" / f"linear-4096-{torch.__version__}"
    if not (folder / aot.MANIFEST).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        aot.build_package(module, (x,), {}, {"aot_inductor.package_constants_in_so": False}, folder / aot.PACKAGE)
        (folder / aot.MANIFEST).write_text(json.dumps({"sha256": aot.sha256_file(folder / aot.PACKAGE)}))
    weights = 4096 * 4096 * 4
    constants = aot.constants_of(module)
    kept, shared = [], []
    for _ in range(3):
        before = _rss()
        package, _ = aot.load_package(folder, constants)
        assert torch.allclose(package(x), module(x), atol=1e-4)
        shared.append(_rss() - before)
        kept.append(package)
    before = _rss()
    copied = torch._inductor.aoti_load_package(str(folder / aot.PACKAGE))
    copied.load_constants(constants, check_full_update=True, user_managed=False)
    copied(x)
    copying = _rss() - before
    kept.append(copied)
    print(f"RSS per load: shared {[s // 2**20 for s in shared]} MiB, copying {copying // 2**20} MiB")
    assert copying > 0.8 * weights
    assert max(shared[1:]) < 0.2 * weights


# ---- ahead of time, then a fresh engine ------------------------------------------------------------


def test_export_command_then_a_fresh_engine_loads_the_packages(cache_dir, tiny_models):
    from engine.worker.client import ProcessClient

    cmd = [sys.executable, "-m", "engine", "export", "--preset", "tiny-flux", "--device", "cpu",
           "--precision", "fp32", "--sizes", "64x64", "--cache-dir", str(cache_dir), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout)
    assert row["bucket"] == "aot:64x64" and row["state"] == "warm"
    assert row["origin"] in (aot.ORIGIN_LOADED, aot.ORIGIN_BUILT)  # built unless an earlier run left them
    assert "export tiny-flux@cpu/fp32" in proc.stderr  # the progress bar

    config = EngineConfig(KEY, get_preset("tiny-flux"),
                          EngineOptions(warm_modes=(Mode.AOT,), warm_sizes=("64x64",)), str(cache_dir))
    engine = ProcessClient(config, env={"TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor")}).start()
    try:
        assert engine.wait_ready(timeout=300)
        deadline = time.time() + 300
        info = None
        while time.time() < deadline:
            info = next((b for b in engine.buckets() if b.bucket == BUCKET), None)
            if info and info.state in (BucketState.WARM, BucketState.FAILED):
                break
            time.sleep(0.05)
        assert info.state == BucketState.WARM, info.error
        assert info.origin == aot.ORIGIN_LOADED
        assert info.cache_hits == 0 and info.cache_misses == 0  # nothing was compiled, not even from cache
        result = engine.generate(request(), timeout=120)
        assert result.warm and not result.eager_fallback and result.recompiles == 0
        assert not any("matched no package" in n for n in result.notices)
    finally:
        engine.close()


# ---- where aot is not offered -----------------------------------------------------------------------


@pytest.mark.parametrize("name, words", [("neuron", "NEFF cache"), ("tpu", "TorchTPU")])
def test_aot_refused_on_neuron_and_tpu_with_the_reason(name, words, cache_dir, monkeypatch):
    fake = dataclasses.replace(devices.get_device(name), probe_fn=lambda: devices.Availability(True))
    assert Mode.AOT not in fake.modes and fake.aot_refusal
    with pytest.raises(UnsupportedCombination, match=words):
        devices.check_mode(fake, "aot")
    assert isinstance(devices.check_mode(fake, "compile"), tuple)  # the other modes keep working
    assert devices.describe_device(fake)["aot"] == {"available": False, "reason": fake.aot_refusal}
    monkeypatch.setattr(devices, "resolve_device", lambda _name: fake)
    config = EngineConfig(EngineKey("tiny-flux", name, "fp32"), get_preset("tiny-flux"), EngineOptions(),
                          str(cache_dir))
    with pytest.raises(UnsupportedCombination, match=words):
        export_aot_packages(config, progress=False)  # refused before anything loads
    r = PipelineRunner(config)
    assert r.check_mode("eager") == ()
    with pytest.raises(UnsupportedCombination, match=words):
        r.check_mode("aot")


def test_aot_is_offered_where_inductor_packages_are_built():
    for name in ("cpu", "cuda"):
        spec = devices.get_device(name)
        assert Mode.AOT in spec.modes and not spec.aot_refusal
    for name in ("mps", "xpu", "neuron", "tpu"):
        spec = devices.get_device(name)
        assert Mode.AOT not in spec.modes and spec.aot_refusal
    assert devices.get_device("cpu").aot_target()  # part of every key


def test_a_batched_bucket_has_its_own_packages_and_serves_a_batch(runner):
    """engine/pipeline/batching.py: a batch of 2 at 64x64 runs on packages exported at batch 2 (denoiser and decoder),
    and each image equals the request's own at batch 1 within rounding."""
    import numpy as np

    bucket = BucketKey(Mode.AOT, Size(64, 64), 2)
    info = runner.warm_bucket(bucket)
    assert info.state == BucketState.WARM, info.error
    folders = {p.name for p in runner.variants.aot.store.root.rglob("*-64x64-b*") if p.is_dir()}
    assert any(name.endswith("-b2") and name.startswith("denoiser") for name in folders), folders
    assert any(name.endswith("-b2") and name.startswith("vae") for name in folders), folders
    members = [request(seed=3, request_id="b0"), request(seed=4, prompt="a blue bird", request_id="b1")]
    results = runner.generate_batch(members)
    assert [r.batch_size for r in results] == [2, 2]
    assert all(r.warm and r.recompiles == 0 and not any("matched no package" in n for n in r.notices) for r in results)
    alone = runner.generate(members[1])
    diff = np.abs(np.asarray(results[1].image(), dtype=np.int16) - np.asarray(alone.image(), dtype=np.int16))
    assert diff.max() <= 2
