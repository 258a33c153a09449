"""Tensor parallel for real on CPU: torchrun, 2 ranks, gloo, the tiny Flux and Flux2-klein pipelines.

- Rank 0's decoded float image (dumped through the sidecar's --dump-dir test hook) matches one process
  running the same pipeline to <= 1e-4, eager and compiled (regional compile of one bucket; cold it takes
  tens of seconds with two ranks on two cores, the on-disk inductor cache makes reruns faster).
- A killed rank fails the request in flight with EngineCrashed within seconds, the engine shows "down",
  and both the automatic restart and manager.restart() bring it back; shutdown leaves no process behind.

Run: .venv/bin/python -m pytest tests/test_tp.py -q -x
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from helpers import poll, process_gone

from engine.config.presets import get_preset
from engine.config.request import ImageRequest
from engine.errors import EngineCrashed
from engine.pipeline.runner import pipeline_call_kwargs
from engine.protocol import EngineConfig, EngineKey, EngineOptions, GenerateRequest
from engine.settings import data_path
from engine.tp.client import SidecarClient

pytestmark = pytest.mark.slow  # starts torchrun tensor-parallel sidecars

TOLERANCE = 1e-4
PROMPT = "a red fox in the snow"


def _config(cache_dir, preset, **preset_changes) -> EngineConfig:
    p = replace(get_preset(preset), **preset_changes) if preset_changes else get_preset(preset)
    return EngineConfig(key=EngineKey(preset, "cpu", "fp32", 2), preset=p,
                        options=EngineOptions(warm_sizes=(), compile_vae=False), cache_dir=str(cache_dir))


def _request(request_id: str, mode: str = "eager", size: int = 64, steps: int = 4, guidance: float = 3.5,
             seed: int = 0) -> GenerateRequest:
    return GenerateRequest.checked(prompt=PROMPT, width=size, height=size, steps=steps, guidance=guidance, seed=seed,
                           mode=mode, on_cold="wait", request_id=request_id)


def _reference(tiny_models, preset: str, request: GenerateRequest) -> np.ndarray:
    """The same call in this one process (what PipelineRunner._call passes), as a float image."""
    import diffusers
    import torch

    folder = tiny_models.get(preset) or data_path(get_preset(preset).bundled)  # tiny-shapes is committed
    pipe = getattr(diffusers, get_preset(preset).pipeline).from_pretrained(folder, dtype=torch.float32)  # the shapes model is stored in fp16
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        out = pipe(**pipeline_call_kwargs(get_preset(preset), pipe, request, output_type="np"))
    return out.images[0]


def _processes(engine: SidecarClient) -> list[int]:
    return [engine.pid, *engine.rank_pids()]


@pytest.fixture(scope="module")
def flux_tp(cache_dir, tiny_models, tmp_path_factory):
    dump = tmp_path_factory.mktemp("tp-dump")
    engine = SidecarClient(_config(cache_dir, "tiny-flux"), dump_dir=dump).start()
    try:
        engine.wait_ready(300)
        yield engine, dump
    finally:
        engine.close()
    assert poll(lambda: all(process_gone(pid) for pid in _processes(engine)), 15)


def test_flux_tp_eager_matches_one_process(flux_tp, tiny_models):
    engine, dump = flux_tp
    status = engine.status()
    assert status["state"] == "ready" and status["kind"] == "tp-sidecar" and status["tp"] == 2
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    # its own process group (stopped as one) in this session (the same scheduling autogroup as the app)
    assert os.getpgid(engine.process.pid) == engine.process.pid and os.getsid(engine.process.pid) == os.getsid(0)
    assert any("transformer (FluxTransformer2DModel) sharded" in n for n in status["notices"])
    request = _request("flux-eager")
    result = engine.generate(request, timeout=120)
    assert result.engine.tp == 2 and len(result.timings.step_ms) == 4 and result.image().size == (64, 64)
    diff = np.abs(np.load(dump / "flux-eager.npy") - _reference(tiny_models, "tiny-flux", request)).max()
    print(f"tiny-flux TP eager: max abs diff {diff:.2e}, median step {result.timings.median_step_ms:.1f} ms")
    assert diff <= TOLERANCE


def test_flux_tp_compiled_bucket_matches_one_process(flux_tp, tiny_models):
    engine, dump = flux_tp
    request = _request("flux-regional", mode="regional")
    started = time.perf_counter()
    result = engine.generate(request, timeout=600)  # on_cold="wait": every rank compiles the bucket first
    compile_wall = time.perf_counter() - started
    assert result.warm and not result.eager_fallback
    board = {str(b.bucket): b for b in engine.buckets()}
    assert board["regional:64x64"].state == "warm" and board["regional:64x64"].compile_s > 0
    again = engine.generate(_request("flux-regional-2", mode="regional"), timeout=120)
    assert again.warm and again.recompiles == 0  # a warm bucket compiles nothing
    reference = _reference(tiny_models, "tiny-flux", request)
    diff = max(np.abs(np.load(dump / f"{rid}.npy") - reference).max() for rid in ("flux-regional", "flux-regional-2"))
    print(f"tiny-flux TP regional: compile+run {compile_wall:.1f} s, max abs diff {diff:.2e}, "
          f"median step {again.timings.median_step_ms:.1f} ms")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("at_step", [1, 2, 3, 5])
def test_flux_tp_cancel_stops_every_rank_at_the_same_step(flux_tp, at_step):
    from engine.errors import Cancelled

    engine, _ = flux_tp
    request = _request(f"flux-cancel-{at_step}", steps=30)
    # The cancel reaches rank 0 at an arbitrary moment within a step; the ranks must still agree.
    future = engine.submit(request, on_progress=lambda p: p.step == at_step and engine.cancel(request.request_id))
    with pytest.raises(Cancelled):
        future.result(60)
    # The group is still in step: the next request runs normally.
    assert len(engine.generate(_request(f"flux-after-cancel-{at_step}", steps=2), timeout=60).timings.step_ms) == 2


def test_flux2_klein_tp_with_sharded_text_encoder_matches_one_process(cache_dir, tiny_models, tmp_path):
    # The tiny preset keeps its Qwen3 text encoder whole; shard it too (as FLUX.2-dev does with Mistral3).
    engine = SidecarClient(_config(cache_dir, "tiny-flux2-klein", tp_text_encoder=True), dump_dir=tmp_path).start()
    try:
        engine.wait_ready(300)
        assert any("text_encoder (Qwen3ForCausalLM)" in n for n in engine.info.notices)
        request = _request("klein-eager", guidance=1.0)
        result = engine.generate(request, timeout=120)
    finally:
        engine.close()
    diff = np.abs(np.load(tmp_path / "klein-eager.npy") - _reference(tiny_models, "tiny-flux2-klein", request)).max()
    print(f"tiny-flux2-klein TP (transformer + text encoder) eager: max abs diff {diff:.2e}, "
          f"median step {result.timings.median_step_ms:.1f} ms")
    assert diff <= TOLERANCE


def test_embedded_shapes_model_tp_draws_the_same_picture(cache_dir, tiny_models, tmp_path):
    """The trained default over 2 ranks: the image equals the single process (<= 2/255) and still draws
    its prompt."""
    from training.shapes.fidelity import check

    prompt = "a yellow triangle on a purple background"
    engine = SidecarClient(_config(cache_dir, "tiny-shapes"), dump_dir=tmp_path).start()
    try:
        engine.wait_ready(300)
        request = replace(_request("shapes-eager", steps=8, guidance=1.0), prompt=prompt)
        result = engine.generate(request, timeout=120)
    finally:
        engine.close()
    tp_image = np.load(tmp_path / "shapes-eager.npy")
    diff = np.abs(tp_image - _reference(tiny_models, "tiny-shapes", request)).max()
    print(f"tiny-shapes TP eager: max abs diff {diff * 255:.3f}/255, median step {result.timings.median_step_ms:.1f} ms")
    assert diff <= 2 / 255
    from PIL import Image

    assert check(Image.fromarray((tp_image * 255).round().astype(np.uint8)), prompt).correct


def test_killed_rank_fails_fast_then_restarts(cache_dir, tiny_models):
    from engine.serving.manager import EngineManager

    manager = EngineManager(cache_dir=cache_dir, options=EngineOptions(warm_sizes=()))
    seen: list[SidecarClient] = []
    try:
        key = manager.gate.make_key("tiny-flux", "cpu", "fp32", tp=2)
        engine = manager.engine(key)
        seen.append(engine)
        assert isinstance(engine, SidecarClient)
        engine.wait_ready(300)
        assert manager.generate(ImageRequest(preset="tiny-flux", device="cpu", tp=2, size="64x64", steps=2,
                                             prompt=PROMPT)).engine == key

        victim = engine.rank_pids()[1]
        killed_at: list[float] = []

        def kill_rank_1(progress):
            if not killed_at:
                os.kill(victim, signal.SIGKILL)
                killed_at.append(time.monotonic())

        future = engine.submit(_request("doomed", size=128, steps=200), on_progress=kill_rank_1)
        with pytest.raises(EngineCrashed) as crashed:
            future.result(60)
        detect_s = time.monotonic() - killed_at[0]
        assert poll(lambda: engine.status()["state"] == "down", 10)
        down_s = time.monotonic() - killed_at[0]
        print(f"killed rank 1: request failed after {detect_s:.2f} s, board down after {down_s:.2f} s: "
              f"{crashed.value}; board: {engine.status()['error']}")
        assert "tp2" in str(crashed.value)  # the crash named (a 60 s timeout would not be EngineCrashed)
        # Named: by rank 0 ("rank 1 (node 0, host h, pid p) is gone") or, when torchrun tore the group down first,
        # from its report ("rank 1 was killed by SIGKILL").
        assert "rank 1 (node 0" in str(crashed.value) or "rank 1 was killed by SIGKILL" in str(crashed.value)
        assert poll(lambda: all(process_gone(pid) for pid in _processes(engine)), 15)
        assert poll(lambda: not engine.workdir.exists(), 10)  # no token or config left behind

        # Automatic restart (the engine had been ready, so the residency restarts it: a new sidecar).
        assert poll(lambda: manager.residency.engines() and manager.residency.engines()[0] is not engine, 10)
        restarted = manager.residency.engines()[0]
        seen.append(restarted)
        restarted.wait_ready(300)
        assert manager.generate(ImageRequest(preset="tiny-flux", device="cpu", tp=2, size="64x64", steps=2,
                                             prompt=PROMPT)).steps == 2

        # Restart on request.
        again = manager.restart(key)
        seen.append(again)
        assert again is not restarted and again.wait_ready(300)
        assert manager.generate(ImageRequest(preset="tiny-flux", device="cpu", tp=2, size="64x64", steps=2,
                                             prompt=PROMPT)).steps == 2
    finally:
        manager.shutdown()
    pids = [pid for e in seen for pid in _processes(e) if pid]
    assert poll(lambda: all(process_gone(pid) for pid in pids), 15), "stray sidecar processes after shutdown"
    assert not any(e.workdir.exists() for e in seen)


def test_load_failure_on_the_ranks_is_reported_not_hung(cache_dir, tiny_models, monkeypatch):
    # Skip the client-side check so the ranks' own check fails (as for a Hub model not on disk yet).
    monkeypatch.setattr("engine.tp.plan.check_layout_if_local", lambda *a, **k: False)
    config = _config(cache_dir, "tiny-flux")
    config = replace(config, key=replace(config.key, tp=3))
    engine = SidecarClient(config).start()
    try:
        with pytest.raises(Exception, match=r"transformer \(FluxTransformer2DModel\) over 3 ranks"):
            engine.wait_ready(120)  # the ranks' reason, not a timeout: reported, not hung
        assert engine.status()["state"] == "down"
    finally:
        engine.close()
    assert poll(lambda: all(process_gone(pid) for pid in _processes(engine)), 15)


def test_cli_generate_with_tp(cache_dir, tiny_models, tmp_path):
    out = tmp_path / "fox.png"
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--preset", "tiny-flux", "--device", "cpu", "--tp", "2",
         "--size", "64x64", "--steps", "2", "--cache-dir", str(cache_dir), "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "SHOWCASE_CACHE_DIR": str(cache_dir)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"tp": 2' in proc.stdout and out.stat().st_size > 0


def test_sidecar_socket_is_loopback_and_refuses_a_wrong_token(flux_tp):
    """Rank 0 listens on 127.0.0.1 only and answers nobody without this launch's token."""
    import json
    import socket
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    engine, _ = flux_tp
    info = json.loads((engine.workdir / "address.json").read_text())
    assert info["host"] == "127.0.0.1"
    address = (info["host"], int(info["port"]))
    outcome = []

    def intrude():
        try:
            Client(address, authkey=b"not-the-launch-token").send(("generate", None))
            outcome.append("accepted")
        except (AuthenticationError, ConnectionError, EOFError, OSError) as exc:
            outcome.append(type(exc).__name__)

    thread = threading.Thread(target=intrude, daemon=True)
    thread.start()
    thread.join(10)
    assert outcome and outcome[0] != "accepted", f"a client without the token got {outcome or 'no answer'}"
    try:  # a raw client speaking garbage gets nothing and does not break the sidecar
        with socket.create_connection(address, timeout=2) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n")
            raw.settimeout(2)
            try:
                raw.recv(1024)
            except (TimeoutError, OSError):
                pass
    except OSError:
        pass  # refused outright: also fine
    assert engine.alive
    result = engine.generate(_request("after-wrong-token", seed=5), timeout=120)
    assert result.image().size == (64, 64)
