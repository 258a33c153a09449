"""Memory levers: their text, the registry of what runs where, the engine key, and each lever run for real on
the embedded model (group offload to disk, layerwise fp8, VAE slicing) or through a mock where it needs an
accelerator (model / sequential offload, encoder placement); the prompt-embedding cache."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest

from engine.errors import InvalidRequest, UnsupportedCombination
from engine.protocol import EngineKey, GenerateRequest, MemoryLevers

REQUEST = dict(prompt="a red circle", width=64, height=64, steps=4, guidance=3.5, seed=0)


def test_lever_text_round_trips_and_bad_text_names_the_forms():
    levers = MemoryLevers.parse("group:block:2:disk, layerwise:fp8,vae-slicing")
    assert (levers.group, levers.group_blocks, levers.group_disk, levers.layerwise) == ("block", 2, True, "fp8")
    assert str(levers) == "layerwise:fp8,group:block:2:disk,vae-slicing"
    assert MemoryLevers.parse(str(levers)) == levers
    assert str(levers.engine_part()) == "layerwise:fp8,group:block:2:disk"
    assert str(levers.request_part()) == "vae-slicing"
    assert not MemoryLevers.parse("none").enabled
    for bad, words in (("group:block:0", "out of range"), ("group:ring", "group:block"), ("warp-drive", "unknown"),
                       ("layerwise:int4", "fp8"), ("group:leaf,model-offload", "pick one"),
                       ("model-offload,encoders:cpu", "already moves"), ("vae-tiling,vae-tiling", "repeats")):
        with pytest.raises(InvalidRequest, match=words):
            MemoryLevers.parse(bad)


def test_engine_key_carries_the_engine_levers_only():
    key = EngineKey("tiny-shapes", "cpu", "fp32", memory="vae-tiling,group:leaf")
    assert key.memory == "group:leaf"
    assert str(key) == "tiny-shapes@cpu/fp32+group:leaf"
    assert key != EngineKey("tiny-shapes", "cpu", "fp32")
    assert EngineKey("tiny-shapes", "cpu", "fp32", memory="vae-slicing") == EngineKey("tiny-shapes", "cpu", "fp32")
    assert GenerateRequest.checked(**REQUEST, memory="vae-slicing,group:leaf").memory == "vae-slicing"


def _gpu_like(spec):
    return dataclasses.replace(spec, name="gpu", host_memory_is_device_memory=False, offload_streams=True)


def test_registry_says_what_runs_on_a_cpu_and_why_not():
    from engine import devices
    from engine.pipeline import memory

    cpu = devices.get_device("cpu")
    rows = {r["name"]: r for r in memory.lever_table(cpu)}
    assert rows["group:block"]["usable"] and rows["layerwise"]["usable"] and rows["vae-slicing"]["usable"]
    assert "nowhere to offload" in rows["model-offload"]["why_not"]
    assert "nowhere to offload" in rows["sequential-offload"]["why_not"]
    assert rows["vae-tiling"]["scope"] == "request" and rows["group:leaf"]["scope"] == "engine"
    compiled = {r["name"]: r for r in memory.lever_table(cpu, "compile")}
    assert "Parameter() constructor with Dynamo" in compiled["layerwise"]["why_not"]
    gpu = {r["name"]: r for r in memory.lever_table(_gpu_like(cpu))}
    assert gpu["model-offload"]["usable"] and gpu["encoders:cpu"]["usable"]


def test_impossible_sets_are_refused_with_the_reason():
    from engine import devices
    from engine.pipeline import memory

    cpu = devices.get_device("cpu")
    with pytest.raises(UnsupportedCombination, match="CUDA or XPU streams"):
        memory.check_levers("group:block:stream", cpu)
    assert memory.check_levers("group:block:stream", _gpu_like(cpu))
    with pytest.raises(UnsupportedCombination, match="single-device"):
        memory.check_levers("group:leaf", cpu, tp=2)
    with pytest.raises(UnsupportedCombination, match="torchao"):
        memory.check_levers("layerwise:fp8", cpu, quantized=True)
    with pytest.raises(UnsupportedCombination, match="cpu-offload"):
        memory.check_levers("group:leaf", cpu, cpu_offload=True)
    assert memory.excluded_mode("layerwise:fp8", "regional")
    assert memory.excluded_mode("group:block", "compile")
    assert not memory.excluded_mode("vae-tiling", "compile")  # per request: checked per request
    with pytest.raises(UnsupportedCombination, match="step cache"):
        memory.check_request("group:block", "", "eager", step_cache=True, lora=False)
    with pytest.raises(UnsupportedCombination, match="vae-tiling not in mode compile"):
        memory.check_request("", "vae-tiling", "compile", step_cache=False, lora=False)


def test_model_and_sequential_offload_go_through_diffusers_on_an_accelerator(tmp_path):
    from engine.pipeline import memory

    for lever, method in (("model-offload", "enable_model_cpu_offload"),
                          ("sequential-offload", "enable_sequential_cpu_offload")):
        pipe = mock.MagicMock()
        notices = memory.apply_engine_levers(pipe, "transformer", lever, "cuda", None, tmp_path)
        getattr(pipe, method).assert_called_once_with(device="cuda")
        pipe.to.assert_not_called()
        assert "offload" in notices[-1]


def test_encoders_on_the_cpu_encode_there_and_hand_the_device_their_output():
    import torch

    from engine.pipeline.prompts import PromptCache, PromptEncoder

    seen = []

    class Pipe:
        components = {"text_encoder": torch.nn.Linear(1, 1), "transformer": torch.nn.Linear(1, 1)}

        def encode_prompt(self, prompt, device=None, num_images_per_prompt=1):
            seen.append(device)
            return torch.ones(2), None

    pipe = Pipe()
    encoder = PromptEncoder(pipe, "encoders:cpu", "meta", "k", PromptCache(4, 2**20))
    encoder.bind(pipe)
    embeds, pooled = pipe.encode_prompt(prompt="a", device="meta")
    assert seen == ["cpu"] and embeds.device.type == "meta" and pooled is None
    pipe.encode_prompt(prompt="a", device="meta")
    assert seen == ["cpu"]  # the second call came from the cache


def test_prompt_cache_is_bounded_in_entries_and_bytes():
    import torch

    from engine.pipeline.prompts import PromptCache

    cache = PromptCache(entries=2, max_bytes=1000)
    for i in range(3):
        cache.put(i, (torch.zeros(10),))  # 40 bytes each
    assert len(cache) == 2 and cache.get(0) is None and cache.get(2) is not None
    cache.put("big", (torch.zeros(300),))  # 1200 bytes: over the whole bound, never kept
    assert cache.get("big") is None and cache.bytes == 80
    cache = PromptCache(entries=10, max_bytes=100)
    for i in range(3):
        cache.put(i, (torch.zeros(10),))
    assert len(cache) == 2 and cache.bytes == 80


@pytest.fixture(scope="module")
def runners(cache_dir, tiny_models):
    from engine.config.presets import get_preset
    from engine.pipeline.runner import PipelineRunner
    from engine.protocol import EngineConfig, EngineOptions

    def runner(levers: str):
        key = EngineKey("tiny-shapes", "cpu", "fp32", memory=levers)
        r = PipelineRunner(EngineConfig(key, get_preset("tiny-shapes"), EngineOptions(warm_sizes=()), str(cache_dir)))
        r.load()
        return r

    return runner


def _pixels(result):
    return np.asarray(result.image(), dtype=np.int16)


def test_group_offload_to_disk_serves_the_same_image(runners, cache_dir):
    plain, offloaded = runners(""), runners("group:block:1:disk")
    request = GenerateRequest.checked(**REQUEST)
    # weights read back from disk sit at the address (modulo 64 bytes) they had as loaded: the group files'
    # layout sent the CPU's matmuls another way through each row and moved a large model's image by 1/255
    den, in_phase = offloaded.pipe.transformer, []
    for name in ("transformer_blocks.0.attn.to_q", "single_transformer_blocks.1.proj_mlp", "x_embedder"):
        phase = plain.pipe.transformer.get_submodule(name).weight.data_ptr() % 64
        den.get_submodule(name).register_forward_pre_hook(
            lambda m, args, phase=phase: in_phase.append(m.weight.data_ptr() % 64 == phase))
    a, b = plain.generate(request), offloaded.generate(request)
    assert len(in_phase) == 3 * REQUEST["steps"] and all(in_phase)
    assert np.abs(_pixels(a) - _pixels(b)).max() == 0
    assert any("files in" in n for n in offloaded.notices)
    folder = next(n for n in offloaded.notices if "files in" in n).split("files in ")[1].rstrip(")")
    assert list(__import__("pathlib").Path(folder).iterdir())  # the weights went to disk
    assert offloaded.modes() == ("eager",)
    with pytest.raises(UnsupportedCombination, match="step cache"):
        offloaded.generate(request.replace(step_cache="first-block"))


def test_layerwise_fp8_halves_the_denoiser_and_refuses_compile(runners):
    import torch

    from engine.pipeline.footprint import weights_bytes

    plain, cast = runners(""), runners("layerwise:fp8")

    def denoiser_bytes(r):
        return sum(t.numel() * t.element_size() for t in (*r.pipe.transformer.parameters(),
                                                           *r.pipe.transformer.buffers()))

    assert denoiser_bytes(cast) <= 0.5 * denoiser_bytes(plain)
    assert weights_bytes(cast.pipe) < weights_bytes(plain.pipe)
    # the first and last layers keep fp32 (the input projection cost most of the PSNR in fp8), the blocks do not
    den = cast.pipe.transformer
    assert den.x_embedder.weight.dtype == den.proj_out.weight.dtype == den.norm_out.linear.weight.dtype == torch.float32
    assert den.transformer_blocks[0].attn.to_q.weight.dtype == den.context_embedder.weight.dtype == torch.float8_e4m3fn
    request = GenerateRequest.checked(**REQUEST)
    diff = np.abs(_pixels(plain.generate(request)) - _pixels(cast.generate(request))).astype(float)
    assert 10 * np.log10(255**2 / max((diff**2).mean(), 1e-9)) >= 30  # close, not equal
    with pytest.raises(UnsupportedCombination, match="Dynamo"):
        cast.generate(request.replace(mode="compile"))


def test_vae_levers_per_request_and_the_prompt_cache(runners):
    plain = runners("")
    request = GenerateRequest.checked(**REQUEST)
    first = plain.generate(request.replace(prompt="two blue squares"))
    hits = plain.caller.prompts.cache.hits
    again = plain.generate(request.replace(prompt="two blue squares", memory="vae-slicing"))
    assert plain.caller.prompts.cache.hits == hits + 1
    assert np.abs(_pixels(first) - _pixels(again)).max() == 0  # cached embeddings, sliced decode: same image
    with pytest.raises(UnsupportedCombination, match="AutoencoderTiny"):
        plain.generate(request.replace(memory="vae-tiling"))


FAKE_DEVICE_SCRIPT = """
import json, sys
sys.path[:0] = [{tests!r}, {root!r}]
from fake_device import install_fake_device
fake = install_fake_device("neuron")
import numpy as np
from engine.config.presets import get_preset
from engine.pipeline.runner import PipelineRunner
from engine.protocol import EngineConfig, EngineKey, EngineOptions, GenerateRequest

def runner(device, levers=""):
    key = EngineKey("tiny-shapes", device, "fp32", memory=levers)
    r = PipelineRunner(EngineConfig(key, get_preset("tiny-shapes"), EngineOptions(warm_sizes=()), {cache!r}))
    r.load()
    return r

req = GenerateRequest.checked(prompt="a red circle", width=64, height=64, steps=2, guidance=3.5, seed=0)
ref = np.asarray(runner("cpu").generate(req).image(), dtype=np.int16)
out = {{}}
for levers in ("encoders:cpu", "encoders:offload"):
    lever = runner("neuron", levers)
    image = np.asarray(lever.generate(req).image(), dtype=np.int16)
    out[levers] = {{"denoiser": str(next(lever.pipe.transformer.parameters()).device),
                   "encoder": str(next(lever.pipe.text_encoder.parameters()).device),
                   "max_diff": int(np.abs(image - ref).max())}}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_text_encoders_beside_a_fake_accelerator(cache_dir, tiny_models):
    """On the fake PrivateUse1 device: the encoders stay on the CPU (encoders:cpu) or go back there after
    encoding (encoders:offload) while the denoiser lives on the device; the image is the CPU engine's. (Group
    offload cannot run on the fake device: its `param.data = moved` meets the fake tensor subclass.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = FAKE_DEVICE_SCRIPT.format(tests=str(root / "tests"), root=str(root), cache=str(cache_dir))
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stderr[-4000:]
    out = json.loads(line.removeprefix("RESULT "))
    for row in out.values():
        assert row["denoiser"].startswith("neuron") and row["encoder"] == "cpu"
        assert row["max_diff"] <= 2  # uint8 images: same pipeline, same seed


def test_compare_entries_take_memory_levers_and_refuse_impossible_pairs():
    from bench import configs
    from engine import devices
    from engine.config.presets import get_preset

    entry = configs.parse_entry("eager/fp32+lora=swap+mem=group:block:2, vae-slicing@cpu")
    assert entry.memory == "group:block:2,vae-slicing" and entry.lora.name == "swap" and entry.device == "cpu"
    assert configs.parse_entry(entry.text()) == entry
    with pytest.raises(ValueError, match="unknown memory lever"):
        configs.parse_entry("eager/fp32+mem=warp")
    preset, cpu = get_preset("tiny-shapes"), devices.get_device("cpu")
    assert "fullgraph" in configs.refusal(preset, cpu, configs.parse_entry("regional/fp32+mem=layerwise:fp8"))
    assert "nowhere to offload" in configs.refusal(preset, cpu, configs.parse_entry("eager/fp32+mem=model-offload"))
    assert "step cache" in configs.refusal(preset, cpu, configs.parse_entry("eager/fp32/first-block+mem=group:leaf"))
    assert configs.refusal(preset, cpu, configs.parse_entry("eager/fp32+mem=layerwise:fp8")) is None


def test_compare_shows_gib_beside_seconds():
    from ui import compare_views, generate_views

    result = {"config": "cpu/fp32/eager+mem=layerwise:fp8", "timings": {"total_ms": 500.0, "step_ms": [1.0]},
              "peak_memory_bytes": 3 * 2**29, "weights_bytes": {"transformer": 2**28, "vae": 2**28}}
    row = compare_views.price_rows([result])[0]
    assert row[1] == "0.50 · 1.50 GiB peak · weights 0.50 GiB"
    assert "1.50 GiB peak" in compare_views.compare_cards_html([result], [None])
    assert ["weights (memory levers: none)", "transformer 0.25 GiB, vae 0.25 GiB"] in generate_views.stats_rows(
        {**result, "timings": {"step_ms": [1.0]}})
    # fp8-stored weights of a small model: their bytes, not "transformer 0.00 GiB"
    small = {**result, "timings": {"step_ms": [1.0]}, "weights_bytes": {"transformer": 3 * 2**20, "vae": 2**19}}
    assert ["weights (memory levers: none)", "transformer 3.0 MiB, vae 0.5 MiB"] in generate_views.stats_rows(small)


# -- the Advisor's memory bound ------------------------------------------------------------------------
def _advisor_plan(**kw):
    from bench.advise_choice import AdvisePlan
    from engine.config.presets import get_preset
    from engine.protocol import Size

    return AdvisePlan(preset=get_preset("tiny-shapes"), device="cpu", size=Size(64, 64), steps=4, **kw)


def _row(label, ms, peak_gib, **kw):
    precision, mode = label.split("/")[:2]
    return {"precision": precision, "mode": mode, "step_cache": "none", "attention": "native", "label": label,
            "s_per_image": ms / 1000, "fidelity": 0.94, "drift_psnr_db": None, "drift_max_diff": 0, "error": None,
            "peak_bytes": None if peak_gib is None else int(peak_gib * 2**30), **kw}


def test_max_memory_picks_the_fastest_configuration_whose_peak_fits():
    from bench.advise_choice import choose
    from bench.advise_report import table_rows

    def rows():
        return [_row("fp32/eager", 100, 2.0), _row("bf16/compile", 40, 3.0),
                _row("fp32/eager/mem=layerwise:fp8", 130, 1.2, memory="layerwise:fp8")]

    assert choose(rows(), _advisor_plan())[0]["label"] == "bf16/compile"  # no bound: the fastest
    pick, table = choose(rows(), _advisor_plan(max_memory_bytes=int(2.5 * 2**30)))  # between 2.0 and 3.0 GiB
    assert pick["label"] == "fp32/eager"
    assert "3.00 GiB > --max-memory 2.50 GiB" in next(r for r in table if r["label"] == "bf16/compile")["why_not"]
    pick, _ = choose(rows(), _advisor_plan(max_memory_bytes=int(1.5 * 2**30)))  # only the lever fits
    assert pick["label"] == "fp32/eager/mem=layerwise:fp8"
    assert choose(rows(), _advisor_plan(max_memory_bytes=2**30))[0] is None  # nothing fits: no pick
    report = {"rows": table, "pick": pick}
    assert any(cells[1] == "0.130 · 1.20 GiB" for cells in table_rows(report))


def test_the_advisors_frontier_shows_seconds_against_gib_too():
    from bench.advise_choice import choose
    from bench.advise_report import frontier, markdown, memory_frontier
    from ui import advisor_views
    from ui.advisor import AdvisorHandlers

    rows = [_row("fp32/eager", 100, 2.0), _row("bf16/compile", 40, 3.0), _row("bf16/eager", 60, 3.5),
            _row("fp32/eager/mem=layerwise:fp8", 130, 1.2, memory="layerwise:fp8"),
            _row("fp32/eager/mem=group:block:1:disk", 700, 1.5, memory="group:block:1:disk"),
            _row("fp32/regional", 50, None)]  # no peak measured: not on the GiB axis
    pick, table = choose(rows, _advisor_plan(max_memory_bytes=int(2.5 * 2**30)))
    report = {"preset": "tiny-shapes", "device": "cpu", "size": "64x64", "steps": 4, "elapsed_s": 1.0,
              "rows": table, "pick": pick}
    assert pick["label"] == "fp32/eager"  # fp32/regional is faster, but its peak was not measured
    # bf16/eager is slower and bigger than bf16/compile; the disk offload slower and bigger than fp8
    assert [r["label"] for r in memory_frontier(report)] == ["bf16/compile", "fp32/eager",
                                                             "fp32/eager/mem=layerwise:fp8"]
    assert ("Speed–memory frontier, fastest first: bf16/compile (0.040 s, 3.00 GiB) → fp32/eager (0.100 s, "
            "2.00 GiB) → fp32/eager/mem=layerwise:fp8 (0.130 s, 1.20 GiB)") in markdown(report)
    points = advisor_views.memory_points(report)
    assert len(points) == 5 and {p["verdict"] for p in points} == {"pick", "within bound", "outside bound"}
    drawn = frontier(points, "peak_gib", higher=False)  # the plot's points (GiB), the same frontier
    assert [p["configuration"] for p in drawn] == [r["label"] for r in memory_frontier(report)]
    assert "fp32/eager/mem=layerwise:fp8 (0.130 s, 1.20 GiB)" in advisor_views.memory_frontier_caption(report)
    plot = AdvisorHandlers.render_advice(None, report)[1]  # the Advisor tab's second plot
    assert list(plot["value"].columns) == advisor_views.ADVISOR_MEMORY_COLUMNS
    assert sorted(plot["value"]["peak_gib"]) == pytest.approx([1.2, 1.5, 2.0, 3.0, 3.5])
    assert plot["y_lim"][0] < 1.2 and plot["y_lim"][1] > 3.5


def test_the_advisor_measures_memory_levers_with_their_peak(cache_dir, tiny_models):
    from bench.advise import Advisor, config_key
    from bench.advise_choice import Candidate, final_entries
    from engine.protocol import EngineOptions

    plan = _advisor_plan(max_minutes=5, timing_images=2, quality_samples=1, cache_dir=cache_dir,
                         options=EngineOptions(warm_sizes=(), warm_modes=()), prompt="a red circle",
                         memory_levers=("layerwise:fp8", "model-offload"))
    advisor = Advisor(plan)
    levers = [c for c in advisor.grid if c.memory]
    assert [c.memory for c in levers] == ["layerwise:fp8"]
    assert any("model-offload" in s["what"] and "nowhere to offload" in s["why"] for s in advisor.skipped)
    advisor.scan_one(Candidate("fp32", "eager"))
    advisor.scan_one(levers[0])
    plain, cast = advisor.known.measured[config_key(Candidate("fp32", "eager"))], advisor.known.measured[config_key(levers[0])]
    assert not cast.error and cast.peak_bytes and plain.peak_bytes
    assert cast.peak_bytes < plain.peak_bytes  # fp8 weights: less to hold
    row = cast.as_dict()
    assert row["memory"] == "layerwise:fp8" and row["label"] == "fp32/eager/mem=layerwise:fp8"
    assert Candidate("fp32", "eager", memory="layerwise:fp8") in final_entries([row], [row])


def test_the_advisor_tab_checks_its_memory_bound():
    import gradio as gr

    from ui.advisor import checked_size

    assert checked_size(" 16GiB ") == str(16 * 2**30)
    with pytest.raises(gr.Error, match="3GiB"):
        checked_size("lots")


@pytest.mark.slow
def test_generate_takes_memory_levers_from_its_form_and_the_api(manager):
    """/generate's last parameter (positional callers unchanged) and the page's field: lever sets this engine can
    take, each with its estimated peak and price; the engine started carries them; bad or impossible sets are
    refused naming what to change."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError
    from helpers import launch_demo

    from ui.handlers import UIDefaults

    demo, url = launch_demo(manager, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager"))
    try:
        client = Client(url, verbose=False)
        params = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/generate"]["parameters"]
        names = [p["parameter_name"] for p in params]
        memory = params[names.index("memory")]  # after the fields positional callers already send
        assert names[names.index("memory") + 1:] == ["num_frames", "fps", "images", "mask", "strength"]
        assert memory["parameter_has_default"]
        assert "group:block[:N][:stream][:disk]" in memory["python_type"]["description"]
        field = next(c for c in demo.config["components"] if c["props"].get("elem_id") == "memory")["props"]
        labels = dict((value, label) for label, value in field["choices"])
        assert field["value"] == "none" and {"none", "layerwise:fp8", "group:block:1:disk"} <= set(labels)
        assert "MiB peak" in labels["layerwise:fp8"] and "1.3× the time" in labels["layerwise:fp8"]
        form = dict(prompt="a red circle", negative_prompt="", preset="tiny-shapes", device="cpu", precision="fp32",
                    mode="eager", size="64x64", steps="2", guidance="", seed="3")
        _, plain = client.predict(*form.values(), api_name="/generate")  # positionally, without memory
        _, cast = client.predict(**form, memory="layerwise:fp8", api_name="/generate")
        assert plain["engine"] == "tiny-shapes@cpu/fp32"
        assert cast["engine"] == "tiny-shapes@cpu/fp32+layerwise:fp8" and cast["memory"] == "layerwise:fp8"
        with pytest.raises(AppError, match="unknown memory lever 'warp-drive'"):
            client.predict(**form, memory="warp-drive", api_name="/generate")
        with pytest.raises(AppError, match="Dynamo"):
            client.predict(**{**form, "mode": "compile"}, memory="layerwise:fp8", api_name="/generate")
    finally:
        demo.close()


def test_the_memory_field_lists_what_the_mode_can_run_and_the_hosts_choice(manager):
    from ui import memory_views
    from ui.handlers import Handlers, UIDefaults

    h = Handlers(manager.serving(), UIDefaults(device="cpu", mode="eager"))
    eager = h.memory_choices("tiny-shapes", "cpu", "fp32", "eager", 1, "layerwise:fp8")
    assert eager["value"] == "layerwise:fp8"
    compiled = h.memory_choices("tiny-shapes", "cpu", "fp32", "compile", 1, "layerwise:fp8")
    assert compiled["value"] == "none" and "unavailable here: why under" in compiled["info"]  # falls back
    why = h.why_not("tiny-shapes", "cpu", "fp32", "compile", 1)  # the reasons, in the accordion under the field
    assert "Dynamo" in why and "Dynamo" not in compiled["info"] and len(compiled["info"]) < 200
    assert all("unavailable" in label for label, value in compiled["choices"] if value != "none")
    rows = [{"levers": "none", "time_factor": 1.0, "why_not": "", "device_bytes": 3 * 2**30,
             "weights_bytes": 2**30, "size": "64x64", "unknown": ""}]
    assert memory_views.memory_choices(rows, "layerwise:fp8", public=True) == [("host's choice (layerwise:fp8)", "")]
    assert memory_views.memory_choices(rows, "", public=False) == [
        ("none · ≈ 3.00 GiB peak, weights 1.00 GiB · ≈ 1× the time", "none")]
    # a set whose engine is not loaded says so before the click, with this host's load estimate
    assert memory_views.memory_choices(rows, "", public=False, loads={"none": 18.4}) == [
        ("none · ≈ 3.00 GiB peak, weights 1.00 GiB · ≈ 1× the time · loads a new engine: ≈ 18 s", "none")]
    labels = {value: label for label, value in eager["choices"]}
    fp8_loaded = manager.residency.get(h.key_for("tiny-shapes", "cpu", "fp32", 1, levers="layerwise:fp8"))
    assert ("loads a new engine: ≈" in labels["layerwise:fp8"]) == (fp8_loaded is None
                                                                    or not fp8_loaded.ready.is_set())


def test_the_engine_line_says_a_new_engine_loads_and_about_how_long():
    from ui import views

    line = views.engine_line("tiny-shapes@cpu/fp32+layerwise:fp8", {"state": "loading"}, load_s=18.6)
    assert "a new engine loads: ≈ 19 s here" in line and "a Generate now waits for it" in line


# -- fit: the estimate and --memory auto ---------------------------------------------------------------
def test_the_estimate_reads_headers_and_prices_each_lever():
    from engine import devices
    from engine.config.presets import get_preset
    from engine.serving import fit

    model = fit.model_for(get_preset("tiny-shapes"), fit.Path("models/tiny-shapes"), "fp32")
    d = model.components["transformer"]
    assert d.params == 1_806_384 and d.block and d.castable < d.params
    plain = model.estimate("", 64, 64, host_is_device=True)
    cast = model.estimate("layerwise:fp8", 64, 64, host_is_device=True)
    # the denoiser's stored bytes with fp8 storage: 0.47x, as measured on the loaded model
    assert abs((plain.weights_bytes - cast.weights_bytes) / (d.params * 4) - 0.53) < 0.01
    # on a CPU group offload to host RAM saves nothing; to disk it does
    assert model.estimate("group:block:1", 64, 64, True).weights_bytes == plain.weights_bytes
    assert model.estimate("group:block:1:disk", 64, 64, True).weights_bytes < plain.weights_bytes
    rows = fit.options(model, devices.get_device("cpu"), 64, 64)
    assert [e.levers for e in rows][:2] == ["", "layerwise:fp8"] and "model-offload" not in [e.levers for e in rows]
    assert fit.choose(rows, plain.device_bytes - 1, "auto")[0].levers == "layerwise:fp8"
    assert fit.choose(rows, None, "auto")[0].levers == "" and fit.choose(rows, 1, "speed")[0].levers == ""
    assert fit.choose(rows, None, "memory")[0].device_bytes == min(e.device_bytes for e in rows)


def test_flux1_dev_is_estimated_from_its_config_without_weights():
    from engine import devices
    from engine.config.presets import get_preset
    from engine.serving import fit

    model = fit.model_for(get_preset("flux1-dev"), None, "bf16")
    assert 11.8e9 < model.components["transformer"].params < 12.0e9  # FLUX.1-dev's 11.9 B
    gpu = _gpu_like(devices.get_device("cpu"))
    rows = {e.levers: e for e in fit.options(model, gpu, 1024, 1024)}
    assert 30 * 2**30 < rows[""].device_bytes < 36 * 2**30  # diffusers measured 33.9 GB
    assert rows["group:block:1"].device_bytes < rows["model-offload"].device_bytes < rows[""].device_bytes
    assert rows["sequential-offload"].device_bytes < 2 * 2**30  # diffusers: 2.4 GB
    pick, why = fit.choose(list(rows.values()), 24 * 2**30, "auto")  # a 24 GB GPU
    assert pick.levers == "encoders:cpu" and "fits" in why
    assert "flux1-dev bf16 needs" in fit.advice_line("flux1-dev", "bf16", list(rows.values()))


def test_memory_auto_loads_a_lever_where_the_declared_memory_is_short(cache_dir, tiny_models):
    from helpers import engine_manager

    from engine import devices
    from engine.config.request import ImageRequest
    from engine.serving import fit

    with engine_manager(cache_dir, options={"memory_policy": "auto"}, runtime="inprocess") as m:
        model = fit.model_for(m.catalog.preset("tiny-shapes"), fit.Path("models/tiny-shapes"), "fp32")
        cpu = devices.get_device("cpu")
        rows = fit.options(model, cpu, 128, 64, cpu.process_overhead_bytes)
        # declared: what this process holds, plus a little less than the engine's no-lever estimate
        m.budgets.memory_budget = m.budgets.app_bytes("cpu") + rows[0].device_bytes - 1
        result = m.generate(ImageRequest("tiny-shapes", prompt="a red circle", device="cpu", size="64x64", steps=2))
        assert str(result.engine).endswith("+layerwise:fp8") and result.image_png


def test_the_hosts_table_tells_each_host_what_fits():
    from engine import devices
    from engine.config.presets import get_preset
    from engine.serving import fit

    table = fit.host_table([("flux1-dev bf16", fit.model_for(get_preset("flux1-dev"), None, "bf16"))],
                           devices.get_device("cuda"))
    row = table.splitlines()[2].split(" | ")
    assert row[1].startswith("group:block:1:stream")  # 24 GB GPU: offloaded with prefetch
    assert row[2].startswith("does not fit")  # 16 GB Mac: host RAM is the same memory
    assert row[5].startswith("none")  # H200


def test_the_cli_lists_levers_and_estimates(capsys):
    from engine import cli

    assert cli.main(["memory-levers", "--device", "cpu", "--mode", "compile"]) == 0
    out = capsys.readouterr().out
    assert "layerwise:fp8|fp8-e5m2" in out and "not with mode compile" in out
    assert cli.main(["memory-levers", "--device", "cuda", "--preset", "flux1-dev", "--free", "21GiB"]) == 0
    out = capsys.readouterr().out
    assert "--memory auto: auto: group:block:1:stream fits 21.00 GiB" in out


def test_a_bad_lever_flag_stops_the_program_naming_the_forms():
    from engine import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--memory-lever", "group:ring"])
    assert exit_info.value.code == 2


def test_the_gpu_memory_bench_runs_its_levers_on_a_small_config():
    """scripts/bench_gpu.sh memory's code path on the CPU with a small Flux config (streams need CUDA)."""
    from bench.memory_gpu import format_row, measure_lever
    from engine import devices
    from engine.config.presets import get_preset
    from engine.protocol import Size

    small = {"in_channels": 64, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
             "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
             "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]}
    preset = dataclasses.replace(get_preset("flux1-dev"), denoiser_config=small)
    cpu = devices.get_device("cpu")
    for levers in ("none", "layerwise:fp8", "model-offload"):
        row = measure_lever(levers, preset, cpu, Size(64, 64), steps=2)
        assert row["s_per_image"] > 0 and row["peak_gib"] is not None
        assert "GiB" in format_row({**row, "estimate_gib": 0.1}, 2)
