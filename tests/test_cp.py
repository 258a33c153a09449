"""Context parallel for real on CPU: the torchrun sidecar with 2 gloo ranks in the Ulysses layout.

- One sidecar for the module, started by an EngineManager (the app's path): rank 0's decoded float image
  (the sidecar's --dump-dir test hook) matches one process running the same request to <= 1/255, eager,
  compile and regional; the PNG the app gets differs from one process's by at most one level per pixel.
- Its board and timings have the shape of a tensor-parallel engine's; cancel stops every rank at the same
  step; aot is refused with the reason.
- Two node launchers (one rank each, `--parallel ulysses`) attached like `app.py --tp-address` serve the same
  image; SIGTERM on node 0 leaves no process within 10 s. The UI's "2 · ring" choice reaches the manager.
- Refused up front, before torchrun starts: Ring with the native attention backend (no log-sum-exp), degrees
  that do not divide the heads or the tokens, and attention backends without a context-parallel path here.

Run: .venv/bin/python -m pytest tests/test_cp.py -q -x
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partialmethod

import numpy as np
import pytest
from helpers import fake_gate, poll, process_gone
from test_tp import _reference, _request

from engine.config.presets import get_preset
from engine.config.request import ImageRequest
from engine.errors import Cancelled, InvalidRequest, UnsupportedCombination
from engine.protocol import EngineKey, EngineOptions, Parallel, parse_ranks, ranks_choice

pytestmark = pytest.mark.slow  # starts torchrun context-parallel sidecars

TOLERANCE = 1 / 255
PRESET = "tiny-flux"


@pytest.fixture(scope="module")
def cp(cache_dir, tiny_models, tmp_path_factory):
    """An EngineManager whose tiny-flux ulysses2 engine is a sidecar dumping rank 0's float images."""
    from engine.serving.manager import EngineManager
    from engine.tp.client import SidecarClient

    dump = tmp_path_factory.mktemp("cp-dump")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SidecarClient, "__init__", partialmethod(SidecarClient.__init__, dump_dir=dump))
        manager = EngineManager(cache_dir=cache_dir, options=EngineOptions(warm_sizes=(), compile_vae=False))
        key = manager.gate.make_key(PRESET, "cpu", "fp32", 2, parallel="ulysses")
        engine = manager.engine(key)
        try:
            engine.wait_ready(300)
            yield manager, key, engine, dump
        finally:
            pids = [engine.pid, *engine.rank_pids()]
            manager.shutdown()
    assert poll(lambda: all(process_gone(pid) for pid in pids), 15)


def _generate(manager, request, **kwargs):
    return manager.generate(ImageRequest(preset=PRESET, device="cpu", precision="fp32", tp=2,
                                         parallel="ulysses", mode=request.mode,
                                         size=f"{request.width}x{request.height}", prompt=request.prompt,
                                         steps=request.steps, guidance=request.guidance, seed=request.seed,
                                         on_cold=request.on_cold), **kwargs)


def _matches(dump, result, tiny_models, request) -> float:
    """Max abs difference of rank 0's float image from one process; the app's PNG within one level."""
    from diffusers.image_processor import VaeImageProcessor

    reference = _reference(tiny_models, PRESET, request)
    diff = float(np.abs(np.load(dump / f"{result.request_id}.npy") - reference).max())
    png = np.asarray(result.image().convert("RGB"), dtype=np.int16)
    one = np.asarray(VaeImageProcessor.numpy_to_pil(reference[None])[0], dtype=np.int16)
    assert np.abs(png - one).max() <= 1
    return diff


def test_ulysses_eager_matches_one_process_and_looks_like_tp(cp, tiny_models):
    manager, key, engine, dump = cp
    assert str(key) == "tiny-flux@cpu/fp32 ulysses2" and key.parallel is Parallel.ULYSSES
    status = next(s for s in manager.residency.status_rows() if s["engine"] == str(key))
    assert status["state"] == "ready" and status["kind"] == "tp-sidecar" and status["tp"] == 2
    assert status["parallel"] == "ulysses" and [r["rank"] for r in status["ranks"]] == [0, 1]
    assert any("context parallel (ulysses) over 2 ranks" in n for n in status["notices"])
    assert not any("sharded" in n for n in status["notices"])  # every rank holds the whole transformer
    # The board: every bucket of each mode a tensor-parallel engine has (eager warm, compiled cold, no aot).
    board = {(b["mode"], b["size"]): b for b in status["buckets"]}
    sizes = {str(s) for s in get_preset(PRESET).buckets}
    assert set(board) == {(m, s) for m in ("eager", "compile", "regional") for s in sizes}
    assert all(b["state"] == "warm" for (m, _), b in board.items() if m == "eager")
    assert all(b["engine"] == str(key) and b["parallel"] == "ulysses" for b in board.values())

    request = _request("cp-eager", steps=4)
    result = _generate(manager, request)
    timings = result.as_dict()
    assert timings["engine"] == str(key) and timings["bucket"] == "64x64" and timings["mode"] == "eager" and timings["warm"]
    assert len(result.timings.step_ms) == 4 and result.timings.median_step_ms > 0
    assert result.image().size == (64, 64)
    diff = _matches(dump, result, tiny_models, request)
    print(f"tiny-flux ulysses2 eager: max abs diff {diff:.2e}, median step {result.timings.median_step_ms:.1f} ms")
    assert diff <= TOLERANCE
    from ui import buckets_views

    rows = [r for r in buckets_views.board_rows(manager.residency.status_rows()) if r[0] == str(key)]
    assert [r[1:3] for r in rows[:1]] == [["cpu", "fp32"]] and len(rows) == len(board)


@pytest.mark.parametrize("mode", ["compile", "regional"])
def test_ulysses_compiled_bucket_matches_one_process(cp, tiny_models, mode):
    manager, key, _, dump = cp
    request = _request(f"cp-{mode}", mode=mode)
    started = time.perf_counter()
    result = _generate(manager, request)  # on_cold="wait": every rank compiles the bucket first
    wall = time.perf_counter() - started
    assert result.warm and not result.eager_fallback
    bucket = next(b for b in manager.residency.status_rows() if b["engine"] == str(key))["buckets"]
    bucket = next(b for b in bucket if b["mode"] == mode and b["size"] == "64x64")
    # Inductor really compiled (a regional clone that ran the original's eager blocks would compile nothing).
    assert bucket["state"] == "warm" and bucket["compile_s"] > 0 and bucket["cache_hits"] + bucket["cache_misses"] > 0
    again = _generate(manager, _request(f"cp-{mode}-2", mode=mode))
    assert again.warm and again.recompiles == 0
    diff = max(_matches(dump, r, tiny_models, request) for r in (result, again))
    print(f"tiny-flux ulysses2 {mode}: compile+run {wall:.1f} s, max abs diff {diff:.2e}, "
          f"median step {again.timings.median_step_ms:.1f} ms")
    assert diff <= TOLERANCE


def test_ulysses_cancel_stops_every_rank_at_the_same_step(cp):
    manager, _, _, _ = cp
    submitted, seen = [], []

    def on_progress(p):
        seen.append(p.step)
        if p.step == 2:
            manager.cancel(submitted[0])

    with pytest.raises(Cancelled):
        _generate(manager, _request("cp-cancel", steps=30), on_progress=on_progress, on_submit=submitted.append)
    assert 2 <= max(seen) < 30
    assert len(_generate(manager, _request("cp-after-cancel", steps=2)).timings.step_ms) == 2  # still in step


def test_aot_is_refused_with_the_reason(cp):
    manager, _, _, _ = cp
    with pytest.raises(UnsupportedCombination, match="context-parallel denoiser runs collectives"):
        _generate(manager, _request("cp-aot", mode="aot"))


# -- refused before torchrun starts ---------------------------------------------------------------------
def test_ring_with_the_native_backend_is_refused_naming_the_reason(manager, monkeypatch):
    from engine.tp.client import SidecarClient

    launched = []  # refused up front, not by the ranks: torchrun is never planned
    monkeypatch.setattr(SidecarClient, "plan_launch", lambda self: launched.append(self.key) or pytest.fail("launched"))
    with pytest.raises(UnsupportedCombination) as info:
        manager.generate(ImageRequest(preset=PRESET, device="cpu", precision="fp32", tp=2, parallel="ring",
                                      prompt="x", steps=1))
    message = str(info.value)
    assert "ring" in message and "log-sum-exp" in message and "'native'" in message
    assert "does not support return_lse=True" in message and "use --parallel ulysses or tensor" in message
    assert launched == []
    assert not any(s["engine"].endswith("ring2") and s["state"] != "down" for s in manager.residency.status_rows())


def test_bad_degrees_are_refused_naming_what_to_change(manager, tiny_models):
    from engine import devices
    from engine.tp import plan

    cpu = devices.get_device("cpu")
    source = str(tiny_models[PRESET])
    preset = get_preset(PRESET)
    with pytest.raises(UnsupportedCombination, match=r"1/3 of the attention heads and FluxTransformer2DModel has 4; pick tp from 1, 2, 4, or --parallel ring"):
        manager.generate(ImageRequest(preset=PRESET, device="cpu", precision="fp32", tp=3, parallel="ulysses",
                                      prompt="x", steps=1))
    with pytest.raises(UnsupportedCombination, match=r"text tokens.*64x64: 63.*max_sequence_length to a multiple of 2"):
        plan.check_layout(replace(preset, max_sequence_length=63), source, 2, "ulysses", "native", cpu)
    with pytest.raises(UnsupportedCombination, match=r"image tokens.*not divisible by 2 at 48x48: 9"):
        plan.check_layout(replace(preset, buckets=(*preset.buckets, replace(preset.buckets[0], width=48, height=48))),
                          source, 2, "ulysses", "native", cpu)
    with pytest.raises(UnsupportedCombination, match="no context-parallel plan .* for SD3Transformer2DModel"):
        plan.check_layout(get_preset("tiny-sd3"), str(tiny_models["tiny-sd3"]), 2, "ulysses", "native", cpu)
    with pytest.raises(UnsupportedCombination, match="'flex' does not support context parallel"):
        plan.check_layout(preset, source, 2, "ulysses", "flex", cpu)
    with pytest.raises(UnsupportedCombination, match="'_native_flash' has no sdpa-flash kernel in diffusers' "
                                                     "context-parallel path on CPU"):
        plan.check_layout(preset, source, 2, "ulysses", "_native_flash", cpu)
    with pytest.raises(InvalidRequest, match="sharded over at least 2 ranks, and ulysses .* keeps the whole "
                                             "denoiser on every rank; use --parallel tensor"):
        _min_tp_key(manager)
    assert plan.check_layout(preset, source, 4, "ulysses", "native", cpu)  # 4 heads, 16/64 tokens: fine


def _min_tp_key(manager):
    presets = manager.catalog.presets
    presets["cp-min-tp"] = replace(get_preset(PRESET), name="cp-min-tp", min_tp=2)
    try:
        return manager.catalog.make_key("cp-min-tp", "cpu", "fp32", 2, "ulysses")
    finally:
        presets.pop("cp-min-tp")


def test_ring_is_allowed_where_the_backend_returns_the_log_sum_exp(tiny_models):
    """As data: a CUDA engine with cuDNN or flash attention may run Ring (not run here: no GPU)."""
    from engine import devices
    from engine.pipeline import attention
    from engine.tp import plan

    cuda = devices.get_device("cuda")
    for backend in ("_native_cudnn", "_native_flash", "flash", "_flash_3_hub", "sage"):
        attention.check_context_parallel(backend, "ring", cuda)
    notices = plan.check_layout(get_preset(PRESET), str(tiny_models[PRESET]), 2, "ring", "_native_cudnn", cuda)
    assert any("context parallel (ring)" in n for n in notices)
    with pytest.raises(UnsupportedCombination, match="does not support return_lse"):
        attention.check_context_parallel("native", "ring", cuda)


def test_the_backend_table_agrees_with_diffusers():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from engine.pipeline import attention

    supported = {str(getattr(b, "value", b)) for b in _AttentionBackendRegistry._supports_context_parallel}
    assert {n for n, b in attention.BACKENDS.items() if b.context_parallel} == supported & set(attention.BACKENDS)
    assert all(b.context_parallel for b in attention.BACKENDS.values() if b.lse)
    assert not attention.BACKENDS["native"].lse and attention.BACKENDS["_native_cudnn"].lse


# -- the interface ----------------------------------------------------------------------------------------
def test_keys_and_ranks_choices():
    assert str(EngineKey("tiny-flux", "cpu", "fp32", 2)) == "tiny-flux@cpu/fp32 tp2"
    assert str(EngineKey("tiny-flux", "cpu", "fp32", 2, "ring")) == "tiny-flux@cpu/fp32 ring2"
    assert EngineKey("tiny-flux", "cpu", "fp32", 1, "ulysses") == EngineKey("tiny-flux", "cpu", "fp32")
    assert EngineKey("tiny-flux", "cpu", "fp32", 2, "ulysses").as_dict()["parallel"] == "ulysses"
    assert ranks_choice(1, "ring") == 1 and ranks_choice(2, "ulysses") == "2 · ulysses"
    for value, expected in ((2, (2, "tensor")), ("4", (4, "tensor")), ("2 · ulysses", (2, "ulysses")),
                            ("ring8", (8, "ring")), ("", (1, "tensor"))):
        assert parse_ranks(value) == expected
    with pytest.raises(Exception, match="unknown parallel 'diagonal'"):
        parse_ranks("2 · diagonal")


def test_the_ui_offers_each_layout_and_the_cli_and_launchers_take_the_flag():
    import app as app_module
    from engine.cli import build_parser as cli_parser
    from engine.tp.nodes import plan_node
    from engine.tp.sidecar import build_parser
    from ui.generate import RANK_CHOICES

    assert RANK_CHOICES[:4] == [1, "2 · tensor", "2 · ulysses", "2 · ring"]
    assert all(parse_ranks(c)[0] in (1, 2, 4, 8) for c in RANK_CHOICES)
    assert app_module.build_parser().parse_args(["--tp", "2", "--parallel", "ulysses"]).parallel == "ulysses"
    assert cli_parser().parse_args(["generate", "--tp", "2", "--parallel", "ring"]).parallel == "ring"
    plan = plan_node(build_parser().parse_args(["--device", "cpu", "--preset", "tiny-flux", "--tp", "2", "--nnodes",
                                                "2", "--rdzv-endpoint", "127.0.0.1:29500", "--parallel", "ulysses",
                                                "--print-command"]))
    assert plan.engine["parallel"] == "ulysses"
    for command in plan.commands.values():  # every node's ranks, and their claims, name the layout
        assert command[command.index("--parallel") + 1] == "ulysses"


# -- two nodes (one rank each) on this machine, attached like `app.py --tp-address` ----------------------
def test_two_nodes_in_ulysses_serve_the_manager_and_sigterm_stops_both(cache_dir, tiny_models, tmp_path):
    import signal

    from test_tp_multinode import Nodes
    from test_tp_multinode import _reference as _uint8_reference

    from engine.serving.manager import EngineManager
    from engine.tp.attach import SidecarAttacher

    class UlyssesNodes(Nodes):
        def command(self, node: int, port: int, *extra: str) -> list[str]:
            return super().command(node, port, "--parallel", "ulysses", *extra)

    nodes = UlyssesNodes(cache_dir, tmp_path)
    nodes.start()
    manager = EngineManager(cache_dir=cache_dir, options=EngineOptions(warm_sizes=()))
    attacher = SidecarAttacher(manager.adopt, nodes.address_file).start()
    try:
        ready = poll(lambda: any(s["engine"] == "tiny-flux@cpu/fp32 ulysses2" and s["state"] == "ready"
                                      for s in manager.residency.status_rows()), 180, 0.5)
        assert ready, f"{attacher.last_error}\n{nodes.log(0)[-3000:]}\n{nodes.log(1)[-2000:]}"
        engine = next(e for e in manager.residency.engines() if str(e.key) == "tiny-flux@cpu/fp32 ulysses2")
        assert "serves tiny-flux fp32 on cpu, ulysses2 over 2 nodes" in nodes.log(0)
        args = dict(prompt="a red fox in the snow", steps=4, guidance=3.5, seed=7)
        result = manager.generate(ImageRequest(preset=PRESET, device="cpu", precision="fp32", tp=2,
                                               parallel="ulysses", mode="eager", size="64x64", **args))
        assert result.engine == engine.key and len(result.timings.step_ms) == 4
        png = np.asarray(result.image().convert("RGB"), dtype=np.int16)
        assert np.abs(png - _uint8_reference(tiny_models, args).astype(np.int16)).max() <= 1
        family = nodes.family(0) + nodes.family(1)
        stopped_at = time.monotonic()
        nodes.procs[0].send_signal(signal.SIGTERM)
        gone = poll(lambda: all(process_gone(p) for p in family), 10, 0.05)
        print(f"ulysses2 over 2 nodes: SIGTERM on node 0, every process gone after {time.monotonic() - stopped_at:.2f} s")
        assert gone, [(p.pid, p.cmdline()) for p in family if not process_gone(p)]
    finally:
        attacher.stop()
        manager.shutdown()
        nodes.stop_all()


def test_the_ui_ranks_choice_reaches_the_manager_with_its_layout():
    import threading
    from types import SimpleNamespace

    import gradio as gr
    from test_ui_handlers import RecordingProgress

    from engine.errors import EngineBusy
    from engine.serving.manager import HostPolicy
    from engine.serving.stream import request_events
    from ui.common import UIDefaults
    from ui.generate import GenerateHandlers

    class Recorder:
        """Stands in for the serving interface (engine/serving/interface.py)."""

        calls: list = []
        status_rows, compiles = list, dict

        def serving(self):
            return self

        def public(self):
            return HostPolicy().public

        def make_key(self, preset, device, precision, tp=1, caller=None, parallel="tensor"):
            return EngineKey(preset, device, precision, tp, parallel)

        def admit(self, spec, ticket=None):
            return fake_gate(self.make_key).admit(spec)

        def loaded_engine(self, key):  # an engine that never gets ready
            return SimpleNamespace(ready=threading.Event())

        def events(self, spec, **options):
            return request_events(self, spec, **options)

        def generate(self, spec, **hooks):
            self.calls.append(spec)
            raise EngineBusy("recorded")

        def cancel(self, request_id):
            return False

    manager = Recorder()
    handlers = GenerateHandlers(manager.serving(), UIDefaults(device="cpu", tp=2, parallel="ulysses"))
    run = handlers.generate(prompt="fox", negative_prompt="", preset=PRESET, device="cpu", precision="fp32",
                            mode="eager", size="64x64", steps=4, guidance=3.5, seed=0, on_cold="eager", tp="2 · ring",
                            request=None, progress=RecordingProgress())
    assert next(run)[1]["engine"] == "tiny-flux@cpu/fp32 ring2"
    with pytest.raises(gr.Error, match="recorded"):
        list(run)
    assert manager.calls[0].key.tp == 2 and str(manager.calls[0].key.parallel) == "ring"
