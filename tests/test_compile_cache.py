"""The compile cache's promise: a restart warms from it; a corrupt or unwritable cache never costs a bucket, nothing
lands outside it.

- A cold process fills the cache folder (misses, nothing in the system's temporary folder); a worker started
  on the same folder afterwards compiles from it (hits, no misses).
- Every compiled module of a populated cache overwritten with garbage: a fresh engine's bucket still
  becomes warm (the broken files are removed, not found again by inductor's C++ code cache). Every file of
  it overwritten with garbage: the bucket warms and serves too.
- A cache that turns read-only while the engine runs: the compile moves to a temporary cache, with the
  notice on the engine and on the bucket.
- A `.building-*` folder of an aot build whose process is gone is removed when the store opens.
- Temporary files and inductor's precompiled headers point inside the cache folder; a compile run leaves
  nothing in the system's temporary folder.
Each compile runs in its own process (inductor keeps loaded modules in memory). The module pays one cold
compile: the restart reads the folder it filled, and each corruption is done to a copy of it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import engine_config, make_request, torch_configs_restored, wait_until

from engine.protocol import BucketKey, BucketState, Mode, Size
from engine.worker.client import ProcessClient


@pytest.fixture
def torch_configs():
    """The fallback turns inductor's caches and precompiled headers off process-wide: restored after."""
    with torch_configs_restored():
        yield

pytestmark = pytest.mark.slow  # compiles in fresh child processes

REPO = Path(__file__).resolve().parent.parent

_WARM = textwrap.dedent("""
    import json, sys
    from engine.config.presets import get_preset
    from engine.protocol import BucketKey, EngineConfig, EngineKey, EngineOptions, Mode, Size
    from engine.pipeline.runner import PipelineRunner

    config = EngineConfig(EngineKey("tiny-flux", "cpu", "fp32"), get_preset("tiny-flux"),
                          EngineOptions(warm_sizes=()), sys.argv[1])
    runner = PipelineRunner(config)
    runner.load()
    info = runner.warm_bucket(BucketKey(Mode.REGIONAL, Size(64, 64)))
    print("RESULT " + json.dumps({"state": info.state.value, "error": info.error, "notices": runner.notices,
                                  "hits": info.cache_hits, "misses": info.cache_misses}))
""")


def _warm_in_a_process(cache: Path, system_tmp: Path, tiny_models) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "SHOWCASE_CACHE_DIR")}
    env.update(PYTHONPATH=str(REPO), TMPDIR=str(system_tmp))
    models = cache / "models"
    if not models.exists():  # the tiny pipeline, without building it again
        models.mkdir(parents=True)
        os.symlink(tiny_models["tiny-flux"], models / "tiny-flux")
    out = subprocess.run([sys.executable, "-c", _WARM, str(cache)], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


BUCKET = BucketKey(Mode.REGIONAL, Size(64, 64))


@pytest.fixture(scope="module")
def populated(tmp_path_factory, tiny_models) -> SimpleNamespace:
    """A cache folder a cold process filled with the regional 64x64 graphs, in a fresh process whose system
    temporary folder is elsewhere. Tests restart on it as it is, or corrupt a copy of it."""
    root = tmp_path_factory.mktemp("populated")
    cache, system_tmp = root / "cache", root / "system-tmp"
    system_tmp.mkdir()
    cold = _warm_in_a_process(cache, system_tmp, tiny_models)
    return SimpleNamespace(cache=cache, system_tmp=system_tmp, cold=cold)


def _copy_of(populated, tmp_path) -> Path:
    """The populated folder copied (the tiny model stays a link): what a test corrupts."""
    return Path(shutil.copytree(populated.cache, tmp_path / "cache", symlinks=True))


def _worker_warms(cache: Path):
    """A worker process on `cache` (as the app starts one): its regional 64x64 bucket once warm (or failed),
    with the worker, which the caller closes."""
    engine = ProcessClient(engine_config(cache), env={"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}).start()
    try:
        assert engine.wait_ready(timeout=300)
        engine.warm(BUCKET)
        info = wait_until(lambda: next((b for b in engine.buckets() if b.bucket == BUCKET
                                        and b.state in (BucketState.WARM, BucketState.FAILED)), None),
                          300, message=f"{BUCKET} warming")
    except BaseException:
        engine.close()
        raise
    return engine, info


def test_a_cold_compile_misses_and_writes_nothing_outside_the_cache(populated):
    cold = populated.cold
    assert cold["state"] == BucketState.WARM.value, cold
    assert cold["misses"] > 0 and cold["hits"] == 0, cold
    assert not list(populated.system_tmp.glob("torchinductor_*")), list(populated.system_tmp.iterdir())
    assert list((populated.cache / "inductor").rglob("*.so"))


def test_restart_warms_from_the_persistent_cache(populated):
    """A fresh worker on the folder a cold process filled compiles from it: hits, no misses."""
    engine, info = _worker_warms(populated.cache)
    try:
        print(f"regional compile: cold process {populated.cold['misses']} misses, restart {info.compile_s:.1f} s "
              f"with {info.cache_hits} hits")
        assert info.state == BucketState.WARM, info.error
        assert info.cache_hits > 0 and info.cache_misses == 0, info
    finally:
        engine.close()


def test_corrupt_compiled_modules_are_removed_and_the_bucket_warms(populated, tmp_path, tiny_models):
    cache = _copy_of(populated, tmp_path)
    modules = sorted((cache / "inductor").rglob("*.so"))
    assert modules
    for module in modules:
        module.write_bytes(b"garbage, not a shared library" * 10)
    second = _warm_in_a_process(cache, populated.system_tmp, tiny_models)
    print(f"{len(modules)} compiled modules overwritten: {second}")
    assert second["state"] == BucketState.WARM.value, second
    assert not [m for m in (cache / "inductor").rglob("*.so") if m.read_bytes()[:4] != b"\x7fELF"]


def test_a_cache_whose_every_file_is_garbage_still_warms_and_serves(populated, tmp_path):
    cache = _copy_of(populated, tmp_path)
    for f in (cache / "inductor").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage" * 7)
    engine, info = _worker_warms(cache)
    try:
        assert info.state == BucketState.WARM, info.error
        assert engine.generate(make_request(mode="regional"), timeout=120).warm
    finally:
        engine.close()


def test_a_cache_that_turns_read_only_moves_the_compile_to_a_temporary_cache(tmp_path, tiny_models, monkeypatch,
                                                                              torch_configs):
    import torch._inductor.codecache as codecache

    from engine.config import caches
    from engine.config.presets import get_preset
    from engine.pipeline.runner import PipelineRunner
    from engine.protocol import EngineConfig, EngineKey, EngineOptions

    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    os.symlink(tiny_models["tiny-flux"], cache / "models" / "tiny-flux")
    # Process-wide state the fallback changes; restored after the test.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    monkeypatch.setenv("TMPDIR", os.environ.get("TMPDIR", "/tmp"))
    for name in ("_HEADER_DIR", "_HEADER_LOCK_DIR"):
        monkeypatch.setattr(codecache, name, getattr(codecache, name))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(caches, "TEMPORARY_BASES", (str(tmp_path),))  # the fallback, removed with tmp_path
    config = EngineConfig(EngineKey("tiny-flux", "cpu", "fp32"), get_preset("tiny-flux"),
                          EngineOptions(warm_sizes=()), str(cache))
    runner = PipelineRunner(config)
    runner.load()
    readonly = (cache / "inductor").resolve()
    real_write = codecache.write_atomic

    def write_atomic(path, *args, **kwargs):  # the cache folder was remounted read-only
        if Path(path).resolve().is_relative_to(readonly):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(codecache, "write_atomic", write_atomic)
    info = runner.warm_bucket(BucketKey(Mode.REGIONAL, Size(64, 64)))
    print(f"read-only cache: {info.state.value}, origin {info.origin!r}")
    assert info.state == BucketState.WARM, info.error
    assert info.origin == "compiled in a temporary cache (the compile cache disk is read-only)", info.origin
    assert any(n.startswith("the compile cache disk is read-only: compiling in a temporary cache")
               for n in runner.notices), runner.notices
    assert not Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).resolve().is_relative_to(readonly)


def test_an_interrupted_aot_build_is_removed_when_the_store_opens(tmp_path):
    from engine.pipeline.aot import PackageStore

    slot = tmp_path / "aot" / "tiny-flux" / "denoiser-cpu-fp32-64x64-b1"
    slot.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = slot / f".abc.building-{dead.pid}-1"
    live = slot / f".def.building-{os.getpid()}-2"
    for folder in (gone, live):
        folder.mkdir()
        (folder / "package.pt2").write_bytes(b"half")
    PackageStore(tmp_path / "aot")
    assert not gone.exists() and live.exists()


def test_temporary_files_and_precompiled_headers_stay_in_the_cache(tmp_path):
    """In a fresh process whose temporary folder is elsewhere, as a worker starts."""
    from engine import devices

    cache = tmp_path / "cache"
    env = devices.worker_environment(devices.get_device("cpu"), cache, base={"TMPDIR": str(tmp_path / "sys")})
    assert Path(env["TMPDIR"]).resolve().is_relative_to(cache.resolve())
    script = textwrap.dedent("""
        import json, sys, tempfile
        from pathlib import Path
        from engine import devices
        devices.apply_environment(devices.get_device("cpu"), Path(sys.argv[1]))
        import torch._inductor.codecache as codecache
        print(json.dumps([tempfile.gettempdir(), codecache._HEADER_DIR]))
    """)
    child_env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    child_env.update(PYTHONPATH=str(REPO), TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script, str(cache)], env=child_env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    temp, headers = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(temp).resolve().is_relative_to(cache.resolve()), temp
    assert Path(headers).resolve().is_relative_to(cache.resolve()), headers


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_unwritable_errors_are_recognised_through_the_chain(code):
    from engine.config.caches import unwritable_cause

    try:
        try:
            raise OSError(code, os.strerror(code))
        except OSError as inner:
            raise RuntimeError("backend='inductor' raised") from inner
    except RuntimeError as outer:
        assert unwritable_cause(outer).condition == {errno.EROFS: "read-only", errno.ENOSPC: "full"}[code]
    assert unwritable_cause(RuntimeError("x")) is None
