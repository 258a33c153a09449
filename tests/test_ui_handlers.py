"""UI handlers called directly on the tiny models, plus the pure view helpers (no server, no browser)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from types import SimpleNamespace

import gradio as gr
import pytest
from helpers import fake_gate, poll, spy_generate, wait_until

from engine.config.request import ImageRequest
from engine.errors import Cancelled, EngineCrashed
from engine.protocol import EngineKey, StepProgress
from engine.serving.manager import HostPolicy
from engine.serving.stream import Step, request_events
from ui import buckets_views, compare_views, views
from ui.generate import PARTIAL_EVERY_S, GenerateHandlers
from ui.handlers import Handlers, UIDefaults
from ui.runs import RunRegistry
from ui.system import HIDDEN, environment_in_force, system_markdown


class RecordingProgress:
    """Stands in for gr.Progress: records every update."""

    def __init__(self):
        self.calls = []

    def __call__(self, progress, desc=None, total=None, unit="steps"):
        self.calls.append((progress, desc))


@pytest.fixture(scope="module")
def handlers(manager):
    return Handlers(manager.serving(), UIDefaults(device="cpu", mode="eager"))


def fox(**overrides) -> dict:
    """A small Generate form (the fields the page's handler takes by name)."""
    return {**dict(prompt="fox", negative_prompt="", preset="tiny-flux", device="cpu", precision="fp32",
                   mode="eager", size="64x64", steps=4, guidance=3.5, seed=0, on_cold="eager"), **overrides}


def run_generate(handlers, **overrides):
    args = dict(prompt="a red fox", negative_prompt="", preset="tiny-flux", device="cpu", precision="fp32",
                mode="eager", size="64x64", steps=4, guidance=3.5, seed=0, on_cold="eager")
    args.update(overrides)
    progress = RecordingProgress()
    outputs = list(handlers.generate(**args, request=None, progress=progress))
    return outputs, progress


# -- pure views ------------------------------------------------------------------------------------
def result_dict(engine="tiny-flux@cpu/fp32", mode="eager", median=10.0, total=100.0, **extra):
    return {"engine": engine, "device": "cpu", "precision": "fp32", "mode": mode, "bucket": "64x64",
            "timings": {"step_ms": [median] * 4, "median_step_ms": median, "total_ms": total}, **extra}


def test_speedup_table_against_eager_of_the_same_engine():
    rows = compare_views.speedup_table([
        result_dict(config="cpu/fp32/eager", median=10.0, total=100.0),
        result_dict(config="cpu/fp32/regional", mode="regional", median=5.0, total=60.0, compile_s=8.0, warmup_s=0.0),
        result_dict(engine="tiny-flux@cpu/bf16", precision="bf16", config="cpu/bf16/compile", mode="compile",
                    median=4.0, total=50.0),
        {"config": "tpu/fp32/eager", "error": "tpu is not available"},
    ])
    eager, regional, other_engine, failed = rows
    assert eager["speedup_step"] == pytest.approx(1.0)
    assert regional["speedup_step"] == pytest.approx(2.0)
    assert regional["speedup_total"] == pytest.approx(100 / 60)
    assert regional["break_even_images"] == 200  # 8 s compile / 0.04 s saved per image
    assert other_engine["speedup_step"] is None  # no eager run of tiny-flux@cpu/bf16 to compare with
    assert failed["error"] == "tpu is not available" and failed["speedup_step"] is None
    display = compare_views.speedup_display_rows(rows)
    assert display[1][3] == "2.00×" and "failed" in display[3][1]
    assert all(len(r) == len(compare_views.SPEEDUP_COLUMNS) for r in display)


def test_board_rows_show_loading_engines_and_every_bucket():
    status = [
        {"engine": "tiny-sd3@cpu/bf16", "state": "loading", "buckets": []},
        {"engine": "tiny-flux@cpu/fp32", "state": "ready", "buckets": [
            {"device": "cpu", "precision": "fp32", "mode": "regional", "size": "64x64", "state": "warm",
             "compile_s": 9.5, "warmup_s": 0.2, "requests_served": 3, "cache_hits": 6},
            {"device": "cpu", "precision": "fp32", "mode": "compile", "size": "128x128", "state": "failed",
             "error": "BackendCompilerFailed: boom"},
        ]},
    ]
    rows = buckets_views.board_rows(status)
    assert rows[0][:3] == ["tiny-sd3@cpu/bf16", "cpu", "bf16"] and rows[0][5] == "engine loading"
    assert rows[1][3:6] == ["regional", "64x64", "warm"] and rows[1][7] == "9.50" and rows[1][9] == 3
    assert rows[2][5] == "failed" and "boom" in rows[2][6]
    assert all(len(r) == len(buckets_views.BOARD_COLUMNS) for r in rows)
    status[1]["lora"] = {"adapters": ["swap", "corner"], "refused": ["big"], "target_rank": 8, "current": "swap",
                         "scale": 0.5, "swaps": 3, "median_swap_ms": 14.25, "recompiles": 0}
    slot = buckets_views.board_rows(status)[-1]  # after the engine's buckets
    assert slot[3:6] == [buckets_views.LORA_SLOT, "", "swap at 0.5"] and slot[9] == "3 swaps"
    assert slot[6] == ("rank 8 · adapters swap, corner · median swap 14.2 ms · 0 recompiles · refused big "
                       "(see notices)")
    assert len(slot) == len(buckets_views.BOARD_COLUMNS)
    status[1]["lora"] = None
    engine = status[1]
    assert views.size_label("64x64", "regional", engine) == "64x64 · warm"
    assert views.size_label("128x128", "regional", engine) == "128x128 · cold"
    assert views.size_label("64x64", "eager", None) == "64x64 · eager"
    assert views.size_label("64x64", "compile", status[0]) == "64x64 · loading"


def test_device_choices_list_every_device_and_mark_unavailable_ones():
    report = [
        {"name": "cuda", "label": "GPU", "available": False, "reason": "no CUDA build: install one"},
        {"name": "cpu", "label": "CPU", "available": True, "auto": True},
    ]
    choices = views.device_choices(report)
    assert choices[0] == ("auto (→ cpu)", "auto")
    assert ("cuda · unavailable: no CUDA build", "cuda") in choices
    assert ("cpu · CPU", "cpu") in choices


def test_secrets_are_never_shown(monkeypatch):
    env = {"HF_TOKEN": "hf_abc", "SHOWCASE_AUTH": "me:pw", "GRADIO_SECRET_X": "s", "HF_HUB_OFFLINE": "1",
           "TORCHINDUCTOR_CACHE_DIR": "/c/inductor", "HOME": "/root", "MY_PASSWORD": "x"}
    shown = environment_in_force({"TORCH_NEURONX_NEFF_CACHE_DIR": "/c/neff"}, environ=env)
    assert shown["HF_TOKEN"] == HIDDEN and shown["SHOWCASE_AUTH"] == HIDDEN and shown["GRADIO_SECRET_X"] == HIDDEN
    assert shown["TORCHINDUCTOR_CACHE_DIR"] == "/c/inductor" and shown["TORCH_NEURONX_NEFF_CACHE_DIR"] == "/c/neff"
    assert "HOME" not in shown and "MY_PASSWORD" not in shown  # unrelated variables are not listed at all


# -- handlers on the tiny model --------------------------------------------------------------------
def test_generate_streams_progress_and_returns_image_and_timings(handlers):
    outputs, progress = run_generate(handlers, steps=4, seed=7)
    image, timings = outputs[-1]
    assert image.size == (64, 64)
    assert len(timings["timings"]["step_ms"]) == 4
    assert timings["seed"] == 7 and timings["bucket"] == "64x64" and timings["engine"] == "tiny-flux@cpu/fp32"
    steps_seen = [p for p, _ in progress.calls if isinstance(p, tuple)]
    # The bar starts at the first step, then moves at most every PROGRESS_EVERY_S (the result ends it).
    assert steps_seen[0] == (1, 4) and steps_seen == sorted(set(steps_seen)) and steps_seen[-1] <= (4, 4)
    plot, stats, summary = handlers.render_run(timings)
    assert list(plot["value"].dropna()["step"]) == ["1", "2", "3", "4"] and "x_lim" not in plot
    assert "seed 7" in summary and "peak memory" in summary
    table = dict(stats.values.tolist())
    assert set(table) >= {"encode", "denoise", "decode", "total", "first step / median step", "it/s", "bucket",
                          "recompiles", "peak memory", "notices"}
    assert table["bucket"].startswith("eager")


def test_partial_results_render_while_running(handlers):
    partial = {"running": True, "engine": "tiny-flux@cpu/fp32", "mode": "eager", "bucket": "64x64", "steps": 4,
               "timings": {"step_ms": [5.0, 4.0]}}
    plot, stats, summary = handlers.render_run(partial)
    assert len(plot["value"].dropna()) == 2 and "step 2 of 4" in stats.values.tolist()[1][1]
    assert summary.startswith("**Running**") and "step 2 of 4" in summary


def test_compiled_mode_at_a_cold_bucket_is_served_eagerly_with_a_notice(handlers):
    outputs, _ = run_generate(handlers, mode="compile", size="128x64", steps=2)
    _, timings = outputs[-1]
    assert timings["eager_fallback"] is True and timings["warm"] is False
    assert any("served eagerly" in n for n in timings["notices"])


@pytest.mark.parametrize("overrides, message", [
    ({"device": "tpu"}, "not available"),
    ({"size": "big"}, "WIDTHxHEIGHT"),
    ({"steps": 0}, "steps must be between"),
    ({"preset": "nope"}, "unknown preset"),
    ({"preset": "tiny-sd3", "tp": 2}, "no tensor-parallel plan"),
    ({"tp": 0}, "tp must be a whole number"),
])
def test_bad_requests_raise_gradio_errors_with_the_engine_message(handlers, overrides, message):
    with pytest.raises(gr.Error, match=message):
        run_generate(handlers, **overrides)


def test_cancel_stops_a_run_between_steps(handlers):
    progress = RecordingProgress()
    gen = handlers.generate(**fox(steps=60), request=None, progress=progress)
    outputs = []
    consumer = threading.Thread(target=lambda: outputs.extend(gen))
    consumer.start()
    wait_until(lambda: any(isinstance(p, tuple) for p, _ in progress.calls), 60, message="a step's progress")
    assert handlers.cancel(None).startswith("cancel")
    consumer.join(60)
    image, timings = outputs[-1]
    assert image is None and timings["cancelled"] is True
    assert len(timings["timings"]["step_ms"]) < 60
    # the engine keeps serving
    outputs, _ = run_generate(handlers, steps=1)
    assert outputs[-1][1]["cancelled"] is False


def test_closing_the_handler_cancels_the_engine_request_between_steps(handlers, manager, monkeypatch):
    """What Gradio does on the Cancel button (cancels=), job.cancel() or a closed tab: close the generator."""
    outcomes = spy_generate(manager, monkeypatch)
    gen = handlers.generate(**fox(steps=200), request=None, progress=RecordingProgress())
    for _image, timings in gen:
        if timings.get("running") and timings["timings"]["step_ms"]:
            break  # a partial with steps: the run is stepping
    gen.close()
    wait_until(lambda: outcomes, 30, message="the engine request ending")
    assert isinstance(outcomes[0], Cancelled), outcomes
    assert int(re.search(r"after step (\d+) of 200", str(outcomes[0])).group(1)) < 200
    assert handlers.runs.cancel("page:default") == "nothing to cancel"  # the run left the /cancel registry
    outputs, _ = run_generate(handlers, steps=1)  # the engine keeps serving
    assert outputs[-1][1]["cancelled"] is False


class ScriptedManager:
    """Stands in for the manager's serving interface (engine/serving/interface.py): an engine that loads until
    `loaded` is set, then `script` runs."""

    def __init__(self, script=None):
        self.loaded, self.submitted = threading.Event(), threading.Event()
        self.cancelled: list[str] = []
        self.script = script
        self.admit = fake_gate(self.make_key).admit
        # an engine loading until `loaded` is set; no earlier loads to estimate from
        self.status_rows, self.compiles = list, dict

    def serving(self):
        return self

    def public(self):
        return HostPolicy().public

    def loaded_engine(self, key):
        return SimpleNamespace(ready=self.loaded)

    def events(self, spec, **options):
        return request_events(self, spec, **options)

    def make_key(self, preset, device, precision, tp=1, caller=None, parallel="tensor"):
        return EngineKey(preset, device, precision, tp)

    def generate(self, spec, *, on_progress, on_submit, **hooks):
        self.loaded.wait(30)
        on_submit("req-1")
        self.submitted.set()
        if self.script:
            return self.script(on_progress)
        deadline = time.monotonic() + 30
        while "req-1" not in self.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        raise Cancelled("request req-1 cancelled before it started")

    def cancel(self, request_id):
        self.cancelled.append(request_id)
        return True


def test_a_handler_closed_while_its_engine_loads_cancels_the_request_once_submitted():
    manager = ScriptedManager()
    h = GenerateHandlers(manager.serving(), UIDefaults(device="cpu"))
    gen = h.generate(**fox(), request=None, progress=RecordingProgress())
    assert next(gen)[1]["running"] is True  # the page shows the run from its start
    # a heartbeat while the engine loads (it never would: loaded waits 30 s), so Gradio can close it
    assert next(gen) == (gr.skip(), gr.skip())
    gen.close()
    manager.loaded.set()
    assert manager.submitted.wait(10)
    wait_until(lambda: manager.cancelled, 30, 0.01, "the submitted request cancelled")
    assert manager.cancelled == ["req-1"]


def test_a_failure_mid_run_settles_the_partial_so_it_is_not_shown_as_cancelled():
    def crash_after_two_steps(on_progress):
        for step in (1, 2):
            on_progress(StepProgress("req-1", step, 4, 5.0))
            time.sleep(PARTIAL_EVERY_S + 0.05)  # so every step is streamed
        raise EngineCrashed("engine tiny-flux@cpu/fp32 stopped: worker process exited with code 9")

    manager = ScriptedManager(crash_after_two_steps)
    manager.loaded.set()
    h = GenerateHandlers(manager.serving(), UIDefaults(device="cpu"))
    outputs = []
    with pytest.raises(gr.Error, match="exited with code 9"):
        for out in h.generate(**fox(), request=None, progress=RecordingProgress()):
            outputs.append(out)
    partials = [t for _, t in outputs if "timings" in t]  # not the heartbeats
    assert partials[0]["running"] is True and len(partials) >= 3  # the start, then a partial per step
    assert partials[-1]["running"] is False and "code 9" in partials[-1]["error"]
    assert h.generate_ended(partials[-1]) == (gr.skip(), gr.skip())  # settled: not taken for a cancel


def test_cancelling_an_async_handler_while_steps_flow_stops_its_engine_request():
    """The /generate API's handler is async: Gradio cancels its task (job.cancel(), a closed page) at any
    await. With steps arriving every millisecond, the cancel must still stop the engine request
    (asyncio.wait_for on Python 3.11 returned an item that arrived with the cancel and dropped it)."""
    for attempt in range(5):
        manager = ScriptedManager()

        def steps_until_cancelled(on_progress, manager=manager):
            for step in range(1, 5_000):
                if "req-1" in manager.cancelled:
                    raise Cancelled(f"request req-1 cancelled after step {step - 1}")
                on_progress(StepProgress("req-1", step, 5_000, 1.0))
                time.sleep(0.001)
            return None

        manager.script = steps_until_cancelled
        manager.loaded.set()
        runs = RunRegistry(manager.cancel)
        steps = []

        async def consume(runs=runs, steps=steps, manager=manager):
            with runs.open("s") as run:
                async for event in request_events(manager, ImageRequest("tiny-flux"),
                                                  key=EngineKey("tiny-flux", "cpu", "fp32"), run=run):
                    if isinstance(event, Step):
                        steps.append(event.progress.step)

        async def cancel_mid_run(steps=steps, after=20 + attempt * 7):
            task = asyncio.create_task(consume())
            while len(steps) < after:
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancel_mid_run())
        poll(lambda m=manager: m.cancelled, 10, 0.01)
        assert manager.cancelled == ["req-1"], f"attempt {attempt}: the engine request was not cancelled"


def test_after_a_cancel_the_last_partial_is_shown_cancelled(handlers):
    partial = {"running": True, "engine": "tiny-flux@cpu/fp32", "mode": "eager", "bucket": "64x64",
               "steps": 60, "timings": {"step_ms": [5.0, 4.0, 4.0]}}
    image, timings = handlers.generate_ended(partial)
    assert image is None and timings["cancelled"] is True and timings["running"] is False
    assert timings["message"] == "cancelled after step 3 of 60"
    assert handlers.generate_ended({"engine": "x", "timings": {"step_ms": [1.0]}}) == (gr.skip(), gr.skip())
    configs = ["cpu/fp32/eager", "cpu/fp32/compile", "cpu/bf16/eager"]
    done = handlers.compare_ended({"configs": configs, "done": False,
                                   "results": [result_dict(config="cpu/fp32/eager")]})
    assert done["done"] is True
    assert [r.get("error") for r in done["results"]] == [None, "cancelled", "cancelled before it started"]
    assert len(done["speedup"]) == 3
    assert handlers.compare_ended({"configs": [], "done": True, "results": []}) == gr.skip()


def test_warm_validates_then_returns_at_once(fresh_manager):
    handlers = Handlers(fresh_manager.serving(), UIDefaults(device="cpu", mode="eager"))  # its compile ends with it
    with pytest.raises(gr.Error, match="not a bucket"):
        handlers.warm("tiny-flux", "cpu", "fp32", "regional", "96x96")
    with pytest.raises(gr.Error, match="no warm-up"):
        handlers.warm("tiny-flux", "cpu", "fp32", "eager", "64x64")
    with pytest.raises(gr.Error, match="defer-and-fuse"):
        handlers.warm("tiny-flux", "cpu", "fp32", "defer-and-fuse", "64x64")
    queued = handlers.warm("tiny-flux", "cpu", "fp32", "regional", "64x64")  # compiles in the worker
    assert queued == {"engine": "tiny-flux@cpu/fp32", "mode": "regional", "queued": ["64x64"]}
    buckets = [b for row in fresh_manager.residency.status_rows() for b in row["buckets"] if b["mode"] == "regional"]
    assert all(b["state"] != "warm" for b in buckets), buckets  # returned before the compile ended


def test_tick_fills_the_board_and_skips_unchanged_outputs(fresh_manager):
    manager, handlers = fresh_manager, Handlers(fresh_manager.serving(), UIDefaults(device="cpu", mode="eager"))
    manager.engine(manager.gate.make_key("tiny-flux", "cpu", "fp32")).wait_ready(timeout=120)
    board, line, sizes, engines, ready, state = handlers.tick("tiny-flux", "cpu", "fp32", "compile", {})
    assert "tiny-flux@cpu/fp32" in list(board["engine"])
    assert "tiny-flux@cpu/fp32" in ready  # the labels saying "loads a new engine" follow this list
    assert "Ready" in line
    assert any(label.startswith("64x64 · ") for label, _ in sizes["choices"])
    assert "tiny-flux@cpu/fp32" in engines["choices"]
    again = handlers.tick("tiny-flux", "cpu", "fp32", "compile", state)  # a manager of its own: nothing changed
    assert again[1] == gr.skip() and again[3] == gr.skip() and again[4] == gr.skip()


def test_select_engine_reports_an_unavailable_device_without_blocking(handlers, manager):
    line, _sizes, modes = handlers.select_engine("tiny-flux", "tpu", "fp32", "compile", "64x64")
    assert "not available" in line
    assert not [row for row in manager.residency.status_rows() if "tpu" in row["engine"]]  # refused before any engine started
    assert "defer-and-fuse" in modes["choices"]  # the device's own modes


def test_compare_runs_each_configuration_and_builds_the_speedup_table(handlers):
    progress = RecordingProgress()
    outputs = list(handlers.compare(prompt="fox", preset="tiny-flux", size="64x64", steps=2, guidance=3.5,
                                    seed=3, devices=["cpu"], precisions=["fp32"], modes=["eager", "compile"],
                                    wait_for_warm=False, timing_s=5, request=None, progress=progress))
    gallery, payload, thumbnails = outputs[-1]
    assert len(gallery) == 2 and len(thumbnails) == 3  # two images and the second one's heat map
    configs = [r["config"] for r in payload["results"]]
    assert configs == ["cpu/fp32/eager", "cpu/fp32/compile"]
    assert all(len(r["timings"]["step_ms"]) == 2 for r in payload["results"])
    assert payload["speedup"][0]["speedup_step"] == pytest.approx(1.0)
    # Timed round-robin after the quality images: one figure per configuration, the same in every view
    assert payload["timing"]["rounds"] >= 3 and payload["timing"]["stop_reason"]
    figure = payload["results"][1]["speedup_figure"]
    assert figure["images"] == payload["timing"]["rounds"] == len(payload["results"][1]["image_ms"])
    assert payload["speedup"][1]["speedup_total"] == figure["speedup"]
    plot, speed, costs, cards, legend = handlers.render_compare(payload, thumbnails)
    assert list(speed["× vs eager fp32"])[1] == figure["text"] and _html_escape(figure["text"]) in cards
    assert len(thumbnails) == 3 and cards.count('class="c-heat"') == 1  # the difference beside the image
    assert set(plot["value"]["config"]) == set(configs) and len(plot["value"]) == 4
    assert plot["colors_in_legend"] == configs and set(plot["color_map"]) == set(configs)  # redraws the legend
    assert len(speed) == 2 and len(costs) == 2
    assert list(speed["config"]) == ["cpu/fp32/eager (reference)", "cpu/fp32/compile"]
    # One card per configuration, each with its image and, after the reference, its drift against it.
    assert cards.count('class="c-card"') == 2 and cards.count("<img src=\"data:image/png;base64,") == 2
    assert cards.count('class="c-drift">drift: reference<') == 1
    total = progress.calls[-1][0][1]
    assert progress.calls[-1][0] == (total, total)  # one bar over every configuration's steps, full at the end
    assert all(c[0][0] <= total for c in progress.calls if isinstance(c[0], tuple))


def _html_escape(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def test_compare_runs_a_typed_list_and_says_why_a_configuration_cannot_run(handlers):
    typed = "eager/fp32; regional/fp32/first-block:0.2; compile/fp32/first-block:0.2"
    assert "✗ `cpu/fp32/compile/first-block:0.2`: step cache first-block with compile" in \
        handlers.check_configurations("tiny-flux", ["cpu"], typed)
    outputs = list(handlers.compare(prompt="fox", preset="tiny-flux", size="64x64", steps=2, guidance=3.5,
                                    seed=3, devices=["cpu"], precisions=[], modes=[], wait_for_warm=False,
                                    caches=None, fidelity_prompts=0, configurations=typed, timing_s=0,
                                    request=None, progress=RecordingProgress()))
    _gallery, payload, thumbnails = outputs[-1]
    by_config = {r["config"]: r for r in payload["results"]}
    assert list(by_config) == ["cpu/fp32/eager", "cpu/fp32/regional/first-block:0.2", "cpu/fp32/compile/first-block:0.2"]
    refused = by_config["cpu/fp32/compile/first-block:0.2"]
    assert refused["error"].startswith("not run: step cache first-block with compile") and "Traceback" not in refused["error"]
    assert payload["timing"]["stop_reason"] == "no timing budget"
    cards = handlers.render_compare(payload, thumbnails)[3]
    assert 'class="c-card-error">not run: step cache first-block with compile' in cards
    with pytest.raises(gr.Error, match=r"unknown mode 'eagre'; modes: eager"):
        list(handlers.compare(prompt="fox", preset="tiny-flux", size="64x64", steps=2, guidance=3.5, seed=3,
                              devices=["cpu"], precisions=[], modes=[], wait_for_warm=False, caches=None,
                              fidelity_prompts=0, configurations="eagre/fp32"))


@pytest.mark.parametrize(("precisions", "modes", "count"), [
    ([], ["eager"], 0),
    (["fp32", "bf16"], ["eager", "compile", "regional", "defer-and-fuse"], 8),
])
def test_compare_needs_one_to_six_configurations(handlers, precisions, modes, count):
    with pytest.raises(gr.Error, match=rf"pick 1–6 configurations .*these choices make {count}\b"):
        list(handlers.compare(prompt="fox", preset="tiny-flux", size="64x64", steps=2, guidance=3.5, seed=0,
                              devices=["cpu"], precisions=precisions, modes=modes, wait_for_warm=False))


def test_compare_adds_the_reference_when_it_is_not_picked(handlers):
    configs, reference, picked = handlers._configs(["cpu"], ["bf16"], ["eager"], None)
    assert (configs, reference, picked) == (["cpu/fp32/eager", "cpu/bf16/eager"], "cpu/fp32/eager", False)
    six = handlers._configs(["cpu"], ["fp32", "bf16"], ["eager", "compile", "regional"], None)[0]
    assert len(six) == 6 and six[0] == "cpu/fp32/eager"  # six picked, the reference among them, run first


def test_system_panel_lists_devices_versions_caches(handlers, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_should_never_show")
    report = handlers.system(refresh=False)
    assert {d["name"] for d in report["devices"]} >= {"cpu", "cuda", "tpu", "neuron", "mps", "xpu"}
    assert all(d["reason"] for d in report["devices"] if not d["available"])
    assert {"torch", "diffusers", "gradio"} <= set(report["versions"])
    assert any(c["folder"].startswith("inductor") for c in report["caches"])
    text = system_markdown(report)
    assert "hf_should_never_show" not in text and "HF_TOKEN" in text


def test_compare_fills_in_the_levers_one_at_a_time_and_refuses_a_missing_frontier(handlers, tmp_path):
    typed = handlers.configuration_list("the levers one at a time", "tiny-shapes", ["cpu"], "64x64", 8)
    assert typed.split("; ")[:4] == ["eager/fp32", "eager/bf16", "compile/fp32", "regional/fp32"]
    assert "✗" not in handlers.check_configurations("tiny-shapes", ["cpu"], typed)
    with pytest.raises(gr.Error, match="no Advisor result for tiny-shapes on cpu at 64x64, 3 steps: run the Advisor"):
        handlers.configuration_list("the Advisor's frontier", "tiny-shapes", ["cpu"], "64x64", 3)
    assert handlers.configuration_list(None, "tiny-shapes", ["cpu"], "64x64", 8) == gr.skip()


def test_the_ab_slider_puts_a_configuration_over_the_reference():
    """Compare's A/B slider: the reference's card image left, the picked configuration's right; a pick stays
    while it is still one of the configurations with an image."""
    from PIL import Image

    from ui import compare_ab
    from ui.compare_views import thumbnail_uri

    red, blue = Image.new("RGB", (64, 64), (255, 0, 0)), Image.new("RGB", (64, 64), (0, 0, 255))
    payload = {"results": [{"config": "cpu/fp32/eager", "reference": True, "image_index": 0},
                           {"config": "cpu/fp32/compile", "reference": False, "image_index": 1},
                           {"config": "cpu/bf16/eager", "reference": False, "error": "failed"}]}
    thumbnails = [thumbnail_uri(red), thumbnail_uri(blue)]
    choices = compare_ab.slider_choices(payload, None)
    assert (choices["choices"], choices["value"]) == (["cpu/fp32/compile"], "cpu/fp32/compile")
    assert compare_ab.slider_choices(payload, "cpu/fp32/compile")["value"] == "cpu/fp32/compile"
    left, right = compare_ab.slider_images("cpu/fp32/compile", payload, thumbnails)
    assert left.getpixel((5, 5)) == (255, 0, 0) and right.getpixel((5, 5)) == (0, 0, 255)
    assert compare_ab.slider_images("cpu/bf16/eager", payload, thumbnails) is None  # failed: no image
    assert compare_ab.slider_choices({}, None)["value"] == compare_ab.NONE_YET
