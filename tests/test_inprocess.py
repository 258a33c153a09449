"""The in-process runtime (engine/serving/inprocess.py) and the Space defaults (app.py).

ZeroGPU itself cannot run here; `ForkingGpu` stands in for it: every GPU call runs in a child made with
os.fork, its arguments and events pickled across, the child discarded after, as ZeroGPU does.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.config.request import ImageRequest

REPO = Path(__file__).resolve().parent.parent
PROMPT = "a red circle on a blue background"


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


# -- Space defaults ------------------------------------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch):
    for name in ("SPACE_ID", "SHOWCASE_PUBLIC", "SHOWCASE_RUNTIME", "SPACES_ZERO_GPU", "SHOWCASE_ADMIN_TOKEN",
                 "SHOWCASE_MODE", "SHOWCASE_AOT_DIR", "SHOWCASE_AOT_REPO"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_space_starts_public_unless_told_otherwise(clean_env):
    import app
    from engine.serving.flags import host_policy

    args = app.build_parser().parse_args([])
    hosting = app.resolve_hosting(args)
    assert hosting.public is False and hosting.lines[0].startswith("hosting mode: developer")
    assert hosting.runtime == "workers" and args.public is None  # the flags are read, never rewritten

    clean_env.setenv("SPACE_ID", "someone/showcase")
    clean_env.setenv("SHOWCASE_ADMIN_TOKEN", "s3cret-from-a-space-secret")
    args = app.build_parser().parse_args([])
    hosting = app.resolve_hosting(args)
    assert hosting.public is True and "SPACE_ID=someone/showcase" in hosting.lines[0]
    assert host_policy(args, hosting.public).public and args.admin_token == "s3cret-from-a-space-secret"
    assert "s3cret" not in " ".join(hosting.lines)

    args = app.build_parser().parse_args(["--no-public"])  # opt out by flag
    hosting = app.resolve_hosting(args)
    assert hosting.lines[0] == "hosting mode: developer (--no-public)"
    assert not host_policy(args, hosting.public).public
    clean_env.setenv("SHOWCASE_PUBLIC", "0")  # or by variable
    hosting = app.resolve_hosting(app.build_parser().parse_args([]))
    assert "SHOWCASE_PUBLIC=0" in hosting.lines[0] and hosting.public is False


def test_zero_gpu_picks_the_in_process_runtime_and_aot(clean_env):
    import app

    clean_env.setenv("SPACES_ZERO_GPU", "true")
    args = app.build_parser().parse_args([])
    hosting = app.resolve_hosting(args)
    assert hosting.runtime == "inprocess" and "SPACES_ZERO_GPU" in hosting.lines[1]
    assert hosting.mode == "aot" and any("no torch.compile" in line for line in hosting.lines)
    with pytest.raises(SystemExit, match="--runtime workers"):
        app.resolve_hosting(app.build_parser().parse_args(["--tp", "2", "--runtime", "inprocess"]))


def test_durations_follow_measured_steps():
    from engine.serving.gpu import DURATION_MARGIN, MIN_DURATION_S, Durations

    d = Durations(default_s=60, max_s=120)
    assert d.for_request("eager", "64x64", 8) == 60  # no measurement: the documented default
    d.record("eager", "64x64", 8, (900.0, 1000.0, 1100.0))
    assert d.for_request("eager", "64x64", 8) == int(np.ceil(1.0 * 8 * DURATION_MARGIN + 3.0))
    assert d.for_request("eager", "64x64", 4) < d.for_request("eager", "64x64", 8)  # shorter asks for less
    d.record("aot", "64x64", 8, (1.0,))
    assert d.for_request("aot", "64x64", 8) == MIN_DURATION_S
    d.record("eager", "128x128", 1, (1e6,))
    assert d.for_request("eager", "128x128", 50) == 120  # capped


# -- engines -------------------------------------------------------------------------------------------
def _config(cache_dir, **options):
    from engine.config.presets import get_preset
    from engine.protocol import EngineConfig, EngineKey, EngineOptions

    options.setdefault("warm_sizes", ())
    return EngineConfig(EngineKey("tiny-shapes", "cpu", "fp32"), get_preset("tiny-shapes"),
                        EngineOptions(**options), str(cache_dir))


def _request(**fields):
    from engine.protocol import GenerateRequest

    base = dict(prompt=PROMPT, width=64, height=64, steps=8, guidance=1.0, seed=0, mode="eager")
    return GenerateRequest.checked(**{**base, **fields})


def _engine(cache_dir, kind):
    from engine.serving.gpu import make_gpu_calls
    from engine.serving.inprocess import InProcessClient

    engine = InProcessClient(_config(cache_dir), gpu=make_gpu_calls(kind)).start()
    assert engine.wait_ready(300)
    return engine


@pytest.fixture(scope="module")
def direct(cache_dir, tiny_models):
    engine = _engine(cache_dir, "direct")
    yield engine
    engine.close()


@pytest.mark.slow
def test_in_process_serves_the_embedded_default_like_a_worker(manager, direct):
    from engine.protocol import Mode

    worker = manager.generate(ImageRequest(preset="tiny-shapes", device="cpu", precision="fp32", mode="eager",
                                           size="64x64", prompt=PROMPT, steps=8, seed=0))
    steps = []
    ours = direct.generate(_request(), on_progress=steps.append, timeout=300)
    assert np.abs(pixels(ours.image_png) - pixels(worker.image_png)).max() <= 1
    assert [p.step for p in steps] == list(range(1, 9))
    status = direct.status()
    assert status["kind"] == "inprocess" and status["state"] == "ready"
    assert Mode.COMPILE not in direct.info.modes and Mode.AOT in direct.info.modes
    assert all(b.bucket.mode is not Mode.COMPILE for b in direct.buckets())
    assert direct.footprint is not None and direct.footprint.weights_bytes > 0


def test_the_manager_refuses_what_cannot_run_in_process(cache_dir, tiny_models):
    from helpers import engine_manager

    from engine.errors import UnsupportedCombination

    with engine_manager(cache_dir, runtime="inprocess") as m:
        with pytest.raises(UnsupportedCombination, match="torch.compile"):
            m.generate(ImageRequest(preset="tiny-shapes", device="cpu", mode="compile", prompt=PROMPT))
        with pytest.raises(UnsupportedCombination, match="torch.compile"):
            m.warm("tiny-shapes", "cpu", "fp32", mode="regional", size="64x64")
        with pytest.raises(UnsupportedCombination, match="torchrun"):
            m.generate(ImageRequest(preset="tiny-shapes", device="cpu", tp=2, prompt=PROMPT))
        assert m.residency.engines() == []  # refused before any engine started


@pytest.mark.slow
def test_a_forked_gpu_call_loses_nothing(direct, cache_dir):
    """Weights (same image), progress and result back, the duration asked for, cancel across the fork."""
    from engine.errors import Cancelled
    from engine.serving.gpu import ForkingGpu

    forked = _engine(cache_dir, "fork")
    try:
        assert isinstance(forked.gpu, ForkingGpu)
        steps = []
        first = forked.generate(_request(request_id="f1"), on_progress=steps.append, timeout=300)
        reference = direct.generate(_request(request_id="d1"), timeout=300)
        assert np.abs(pixels(first.image_png) - pixels(reference.image_png)).max() <= 1
        assert [p.step for p in steps] == list(range(1, 9)) and all(p.step_ms > 0 for p in steps)
        assert first.timings.total_ms > 0 and first.steps == 8
        # The first request had no measurement (the default); the second asks for what was measured.
        forked.generate(_request(request_id="f2"), timeout=300)
        asked = [d for _, d in forked.gpu.calls]
        assert asked[0] == 60 and asked[-1] < 60
        board = {str(b.bucket): b for b in forked.buckets()}
        assert board["eager:64x64"].requests_served == 2  # the child's board change came back

        started = threading.Event()
        future = forked.submit(_request(request_id="f3", steps=200, width=128, height=128),
                               on_progress=lambda p: started.set())
        assert started.wait(120)
        forked.cancel("f3")
        with pytest.raises(Cancelled):
            future.result(60)
    finally:
        forked.close()
    assert not forked._thread.is_alive()


# -- aot through the in-process runtime ---------------------------------------------------------------
FRESH = r"""
import json, sys
from engine.serving.gpu import make_gpu_calls
from engine.serving.inprocess import InProcessClient
from engine.config.presets import get_preset
from engine.protocol import *
config = EngineConfig(EngineKey("tiny-shapes", "cpu", "fp32"), get_preset("tiny-shapes"),
                      EngineOptions(warm_sizes=()), sys.argv[1])
runner_engine = InProcessClient(config, gpu=make_gpu_calls("direct")).start()
runner_engine.wait_ready(300)
info = runner_engine.executor.warm_bucket(BucketKey(Mode.AOT, Size(64, 64)))
result = runner_engine.generate(GenerateRequest.checked(prompt=sys.argv[2], width=64, height=64, steps=8, guidance=1.0,
                                                seed=0, mode="aot"), timeout=300)
runner_engine.close()
sys.stdout.buffer.write(b"RESULT " + json.dumps({"state": info.state.value, "origin": info.origin,
    "compile_s": info.compile_s, "warm": result.warm, "notices": list(result.notices),
    "png": result.image_png.hex()}).encode() + b"\n")
"""


@pytest.mark.slow
def test_aot_buckets_build_in_a_forked_call_and_load_in_a_fresh_process(cache_dir, tiny_models, tmp_path, monkeypatch):
    from engine.protocol import BucketKey, BucketState, Mode, Size

    store = tmp_path / "aot"
    monkeypatch.setenv("SHOWCASE_AOT_DIR", str(store))
    forked = _engine(cache_dir, "fork")
    try:
        bucket = BucketKey(Mode.AOT, Size(64, 64))
        info = forked.executor.warm_bucket(bucket)  # built inside the GPU call, in the child
        assert info.state == BucketState.WARM, info.error
        assert info.origin.startswith("built now")
        assert list(store.glob("tiny-shapes/*/*/package.pt2"))
        assert forked.gpu.calls[-1][1] >= 60  # a build asks for the build duration
        result = forked.generate(_request(mode="aot", request_id="a1"), timeout=300)
        assert result.warm and not any("matched no package" in n for n in result.notices)
        eager = forked.generate(_request(request_id="e1"), timeout=300)
        assert np.abs(pixels(result.image_png) - pixels(eager.image_png)).max() <= 8  # aot drift, fp32
    finally:
        forked.close()
    env = {**os.environ, "PYTHONPATH": str(REPO), "SHOWCASE_AOT_DIR": str(store)}
    proc = subprocess.run([sys.executable, "-c", FRESH, str(cache_dir), PROMPT], env=env, capture_output=True,
                          timeout=600, cwd=str(REPO))
    line = [x for x in proc.stdout.splitlines() if x.startswith(b"RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr.decode()[-2000:]
    fresh = json.loads(line[-1][7:])
    assert fresh["state"] == "warm" and fresh["origin"] == "loaded from package" and fresh["warm"]
    assert np.abs(pixels(bytes.fromhex(fresh["png"])) - pixels(result.image_png)).max() <= 1


# -- packages on the Hub (mocked: no network here) -------------------------------------------------------
def test_packages_push_to_and_pull_from_a_hub_repo(tmp_path, monkeypatch):
    import huggingface_hub

    from engine.pipeline import aot_hub

    store = tmp_path / "store"
    key = store / "tiny-shapes" / "denoiser-cpu-fp32-64x64-b1" / "abc123"
    key.mkdir(parents=True)
    (key / "package.pt2").write_bytes(b"pt2")
    (key / "manifest.json").write_text("{}")
    (key.parent / ".abc999.building-1-2").mkdir()  # a build in progress: never uploaded
    (key.parent / ".abc999.building-1-2" / "package.pt2").write_bytes(b"half")
    remote = tmp_path / "remote"
    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, **kwargs):
            calls["create"] = (repo_id, kwargs)

        def upload_folder(self, repo_id, folder_path, allow_patterns, ignore_patterns, **kwargs):
            import fnmatch
            import shutil

            for path in Path(folder_path).rglob("*"):
                rel = path.relative_to(folder_path).as_posix()
                if path.is_file() and any(fnmatch.fnmatch(rel, p) for p in allow_patterns) \
                        and not any(part.startswith(".") for part in rel.split("/")):
                    (remote / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, remote / rel)
            return type("Info", (), {"commit_url": f"https://hub/{repo_id}/commit/1"})()

    def fake_snapshot_download(repo_id, local_dir, allow_patterns, **kwargs):
        import fnmatch
        import shutil

        for path in remote.rglob("*"):
            rel = path.relative_to(remote).as_posix()
            if path.is_file() and any(fnmatch.fnmatch(rel, p) for p in allow_patterns):
                (Path(local_dir) / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, Path(local_dir) / rel)
        return local_dir

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    url = aot_hub.push_packages("me/showcase-aot", store, preset="tiny-shapes")
    assert url.endswith("/commit/1") and calls["create"][1]["private"] is True
    assert sorted(p.name for p in remote.rglob("*") if p.is_file()) == ["manifest.json", "package.pt2"]

    fresh = tmp_path / "fresh"
    new = aot_hub.pull_packages("me/showcase-aot", fresh, preset="tiny-shapes")
    assert new == ["tiny-shapes/denoiser-cpu-fp32-64x64-b1/abc123/manifest.json",
                   "tiny-shapes/denoiser-cpu-fp32-64x64-b1/abc123/package.pt2"]
    assert aot_hub.pull_packages("me/showcase-aot", fresh, preset="tiny-shapes") == []  # nothing new
    assert aot_hub.pull_packages("me/showcase-aot", tmp_path / "other", preset="tiny-flux") == []
    with pytest.raises(FileNotFoundError, match="engine export"):
        aot_hub.push_packages("me/x", tmp_path / "empty")
