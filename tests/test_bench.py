"""The benchmark: pure table/ratio/target functions on hand-made results, the package's import
boundaries (no torch where the CLI parser and the UI import it), the bench-mode table, the analytic
Flux FLOP count against torch's FlopCounterMode, the random-weights denoiser path on tiny configs
(its variants built by the engine's own compile_denoiser), the persistent-cache probe's child
processes, and one cheap end-to-end `python -m bench bench` run on the tiny model.

No timing assertions: timings on a shared CPU are noise; only structure and invariants are checked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench
from bench import denoiser
from bench.cache_probe import run_cache_probe
from bench.plan import plan_from_args
from bench.run import run_bench
from engine import devices
from engine.errors import UnsupportedCombination
from engine.pipeline import runner
from engine.protocol import EngineOptions, Mode

REPO = Path(__file__).resolve().parent.parent

TINY_FLUX = {
    "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
    "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": [4, 6, 6],
}
TINY_SD3 = {
    "sample_size": 8, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 2,
    "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 32, "caption_projection_dim": 16,
    "pooled_projection_dim": 32, "pos_embed_max_size": 16, "dual_attention_layers": [0], "qk_norm": "rms_norm",
}
TINY_SDXL = {
    "sample_size": 8, "in_channels": 4, "out_channels": 4, "block_out_channels": [32, 64], "layers_per_block": 1,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "attention_head_dim": [2, 4], "transformer_layers_per_block": [1, 1], "norm_num_groups": 8,
    "cross_attention_dim": 32, "use_linear_projection": True, "addition_embed_type": "text_time",
    "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 6 * 8 + 32,
}


def _result(precision, mode, size, step, image=None, **extra):
    r = {
        "preset": "tiny-flux", "device": "cpu", "precision": precision, "mode": mode, "size": size,
        "steps": 4, "step_ms_median": step, "step_ms_p90": step * 1.2 if step else None,
        "image_ms_median": image if image is not None else (step * 4 + 10 if step else None),
        "recompiles": 0,
    }
    r.update(extra)
    return r


HAND_MADE = [
    _result("fp32", "eager", "64x64", 8.0, first_request_ms=45.0),
    _result("fp32", "compile", "64x64", 2.0, compile_s=30.0, first_request_ms=19.0),
    _result("fp32", "regional", "64x64", 3.0, compile_s=10.0, first_request_ms=30.0),
    _result("bf16", "eager", "64x64", 10.0),
    _result("bf16", "compile", "64x64", 4.0, compile_s=20.0, first_request_ms=25.0),
    _result("bf16", "regional", "64x64", None, error="InductorError: boom"),
    _result("fp32", "compile", "128x128", 5.0, compile_s=15.0),  # no eager at 128x128
]


# ---- pure functions ------------------------------------------------------------------------------


HEAVY = ("torch", "gradio", "diffusers", "matplotlib")


def _heavy_modules_after(code: str) -> list[str]:
    """Run `code` in a fresh interpreter; which heavy modules did it import?"""
    probe = f"{code}\nimport json, sys; print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["bench", "bench.stats", "bench.report", "bench.cli"])
def test_import_has_no_torch_side_effects(module):
    assert _heavy_modules_after(f"import {module}") == []


def test_the_measuring_commands_parsers_build_without_torch():
    # bench/commands.py builds every measuring command's parser for `--help` and any unnamed command.
    code = "from bench.commands import build_parser\nbuild_parser()"
    assert _heavy_modules_after(code) == []


def test_every_bench_mode_maps_to_an_engine_mode():
    assert set(Mode.values()) <= set(bench.BENCH_MODES)
    for name in bench.BENCH_MODES:
        mode = bench.MODE_TABLE[name]
        assert isinstance(mode.engine, Mode) and mode.name == name
        dataclasses.replace(EngineOptions(), **mode.overrides)  # overrides are EngineOptions fields
    assert bench.COMPILED_MODES == tuple(n for n in bench.BENCH_MODES if bench.MODE_TABLE[n].engine.compiled)
    assert bench.MODE_TABLE["max-autotune"].engine is Mode.COMPILE
    assert bench.MODE_TABLE["max-autotune"].overrides == {"max_autotune": True}


def test_median_and_p90():
    assert bench.median([3, 1, 2]) == 2
    assert bench.median([]) is None
    assert bench.p90([5.0]) == 5.0
    assert bench.p90(list(range(1, 11))) == pytest.approx(9.1)
    assert bench.p90([None, 2.0]) == 2.0


def test_speedup_table_on_hand_made_results():
    rows = bench.speedup_table(HAND_MADE)
    assert [(r["precision"], r["mode"], r["size"]) for r in rows] == [
        (r["precision"], r["mode"], r["size"]) for r in HAND_MADE
    ]
    by = {(r["precision"], r["mode"], r["size"]): r for r in rows}
    assert by["fp32", "eager", "64x64"]["speedup_vs_eager"] == pytest.approx(1.0)
    assert by["fp32", "compile", "64x64"]["speedup_vs_eager"] == pytest.approx(4.0)
    assert by["fp32", "regional", "64x64"]["speedup_vs_eager"] == pytest.approx(8 / 3)
    assert by["fp32", "compile", "64x64"]["speedup_image_vs_eager"] == pytest.approx(42 / 18)
    # bf16 compares with bf16 eager, and with fp32 eager in its own column
    assert by["bf16", "compile", "64x64"]["speedup_vs_eager"] == pytest.approx(2.5)
    assert by["bf16", "compile", "64x64"]["speedup_vs_fp32_eager"] == pytest.approx(2.0)
    assert by["bf16", "eager", "64x64"]["speedup_vs_fp32_eager"] == pytest.approx(0.8)
    # no baseline, or a failed configuration: no speedup, error kept
    assert by["fp32", "compile", "128x128"]["speedup_vs_eager"] is None
    assert by["bf16", "regional", "64x64"]["speedup_vs_eager"] is None
    assert by["bf16", "regional", "64x64"]["error"] == "InductorError: boom"
    assert by["fp32", "compile", "64x64"]["images_per_s"] == pytest.approx(1000 / 18)
    assert by["fp32", "compile", "64x64"]["warm_hit_ratio"] == pytest.approx(19 / 18)
    # compile: 30 s + nothing of warm-up, saves 24 ms per image -> paid back after 1250 images
    assert by["fp32", "compile", "64x64"]["break_even_images"] == 1250
    assert by["fp32", "eager", "64x64"]["break_even_images"] is None
    table = bench.markdown_table(rows)
    assert table.count("\n") == len(rows) + 1
    assert "4.00×" in table and "error: InductorError: boom" in table


def test_speedup_table_takes_engine_results_too():
    def engine_result(mode, step, total):
        return {"engine": "tiny-flux@cpu/fp32", "preset": "tiny-flux", "device": "cpu", "precision": "fp32",
                "mode": mode, "bucket": "64x64", "timings": {"median_step_ms": step, "total_ms": total}}

    rows = bench.speedup_table([engine_result("eager", 9.0, 60.0), engine_result("compile", 3.0, 30.0)])
    assert rows[1]["size"] == "64x64"
    assert rows[1]["speedup_vs_eager"] == pytest.approx(3.0)
    assert rows[1]["speedup_image_vs_eager"] == pytest.approx(2.0)


def test_ratios_and_targets_on_hand_made_results():
    extras = {
        "engine_overhead": {"ratio": 1.02, "pairs": 20},
        "cache_probe": {"ratio": 0.5, "cold_compile_s": 60.0, "warm_compile_s": 30.0},
    }
    ratios = bench.compute_ratios(HAND_MADE, extras)
    assert ratios["regional_compile_time"]["value"] == pytest.approx(10 / 30)
    assert ratios["regional_step"]["value"] == pytest.approx(1.5)
    # fp32 2/8 = 0.25 and bf16 4/10 = 0.4: the median of the pairs
    assert ratios["compiled_vs_eager_step"]["value"] == pytest.approx(0.325)
    assert ratios["compiled_vs_eager_step"]["n"] == 2
    assert ratios["compile_speedup"]["value"] == pytest.approx((4.0 + 2.5) / 2)
    warm = sorted(v["value"] for v in ratios["warm_hit"]["values"])
    assert warm == pytest.approx(sorted([19 / 18, 30 / 22, 25 / 26]))
    targets = {t["key"]: t for t in bench.evaluate_targets(ratios, "pipeline")}
    assert set(targets) == {t.key for t in bench.TARGETS if "pipeline" in t.kinds}
    assert targets["engine_overhead"]["status"] == "met"
    assert targets["regional_compile_time"]["status"] == "met"
    assert targets["regional_step"]["status"] == "MISSED"
    assert targets["persistent_cache"]["status"] == "MISSED"
    assert targets["compiled_vs_eager_step"]["status"] == "met"
    assert targets["recompiles"]["status"] == "met"
    assert targets["warm_hit"]["status"] == "met"

    # a recompile during timed runs, and missing measurements, are reported, not hidden
    results = [dict(r) for r in HAND_MADE]
    results[1]["recompiles"] = 1
    targets = {t["key"]: t for t in bench.evaluate_targets(bench.compute_ratios(results, {}), "pipeline")}
    assert targets["recompiles"]["status"] == "MISSED"
    assert targets["engine_overhead"]["status"] == "n/a"
    assert targets["persistent_cache"]["status"] == "n/a"
    denoiser = {t["key"] for t in bench.evaluate_targets(bench.compute_ratios(HAND_MADE), "denoiser")}
    assert {"compile_speedup", "matmul_fraction"} <= denoiser and "engine_overhead" not in denoiser


def test_markdown_report_marks_missed_targets():
    ratios = bench.compute_ratios(HAND_MADE, {})
    report = {
        "kind": "pipeline", "machine": bench.machine_info(devices.get_device("cpu")), "config": {"preset": "tiny-flux", "device": "cpu"},
        "command": "python -m bench bench", "table": bench.speedup_table(HAND_MADE),
        "targets": bench.evaluate_targets(ratios, "pipeline"), "notes": ["a note"],
    }
    text = bench.markdown_report(report)
    assert "**MISSED**" in text and "**met**" in text and "**n/a**" in text
    assert report["machine"]["cpu_model"] and "- a note" in text


def test_flux_flops_analytic_matches_flop_counter():
    from diffusers import FluxTransformer2DModel

    from engine.protocol import Size

    for guidance_embeds, size, text_len in ((True, Size(64, 64), 8), (False, Size(128, 64), 5)):
        cfg = {**TINY_FLUX, "in_channels": 64, "patch_size": 1, "guidance_embeds": guidance_embeds}
        counted = denoiser.count_flops_meta(FluxTransformer2DModel, denoiser.DenoiserShape("FluxPipeline", cfg, size, text_len), 3.5)
        assert counted == denoiser.flux_step_flops(cfg, size.width, size.height, text_len)
    # an instruction edit (Kontext): the reference's tokens join the image tokens of every layer
    cfg = {**TINY_FLUX, "in_channels": 64, "patch_size": 1, "guidance_embeds": True}
    edit = denoiser.DenoiserShape("FluxKontextPipeline", cfg, Size(64, 64), 8, references=(Size(64, 64),))
    counted = denoiser.count_flops_meta(FluxTransformer2DModel, edit, 2.5)
    assert counted == denoiser.flux_step_flops(cfg, 64, 64, 8, reference_tokens=16)
    assert counted > denoiser.flux_step_flops(cfg, 64, 64, 8)
    # the full FLUX.1-dev step at 1024x1024 (analytic only: nothing is built)
    from engine.config.presets import get_preset

    full = denoiser.flux_step_flops(get_preset("flux1-dev").denoiser_config, 1024, 1024, 512)
    assert 7.3e13 < full < 7.6e13


def test_denoiser_variants_are_built_by_the_engines_compile_denoiser(monkeypatch):
    calls = []

    def fake_compile_denoiser(module, mode, compile_kwargs):
        calls.append((module, mode, compile_kwargs))
        return "compiled"

    monkeypatch.setattr(runner, "compile_denoiser", fake_compile_denoiser)
    model, cpu = torch.nn.Linear(2, 2), devices.get_device("cpu")
    assert denoiser.denoiser_variant(model, "eager", EngineOptions(), cpu)[0] is model
    assert calls == []
    for name, engine_mode in (("compile", Mode.COMPILE), ("regional", Mode.REGIONAL), ("max-autotune", Mode.COMPILE)):
        variant, kwargs, _ = denoiser.denoiser_variant(model, name, EngineOptions(), cpu)
        assert variant == "compiled" and calls[-1][0] is model and calls[-1][1] is engine_mode
        assert calls[-1][2] == kwargs and kwargs["backend"] == cpu.compile_backend
        # max-autotune is compile with the option on: the compile kwargs carry it, nothing else does
        assert (kwargs.get("mode") == "max-autotune") == (name == "max-autotune")
    with pytest.raises(UnsupportedCombination, match="no denoiser-only variant"):
        denoiser.denoiser_variant(model, "defer-and-fuse", EngineOptions(), cpu)


def test_device_differences_come_from_the_spec():
    spec = dataclasses.replace(devices.get_device("cpu"), matmul_probe_sizes=(8, 16), matmul_probe_iters=2)
    rate = denoiser.measure_matmul_rate(spec, torch.float32)
    assert [row["n"] for row in rate["sizes"]] == [8, 16] and rate["tflops"] > 0
    # an accelerator names itself through the spec's hook; the cpu device's name is the host CPU's
    gpu = dataclasses.replace(devices.get_device("cpu"), device_name_fn=lambda: "Fake GPU 9000")
    assert bench.machine_info(gpu)["gpu"] == "Fake GPU 9000"
    assert bench.machine_info(devices.get_device("cpu"))["gpu"] is None


# ---- measuring -----------------------------------------------------------------------------------


def _plan(argv: list[str]):
    from bench.commands import build_parser

    args = build_parser().parse_args(["bench", *argv])
    return plan_from_args(args)


@pytest.mark.parametrize(
    "preset, override",
    [("flux1-dev", TINY_FLUX), ("sd35-medium", TINY_SD3), ("sdxl", TINY_SDXL)],
    ids=["flux", "sd3", "sdxl"],
)
def test_random_weights_denoiser_with_tiny_config(preset, override, cache_dir, tmp_path):
    plan = _plan([
        "--random-weights", "--preset", preset, "--device", "cpu", "--modes", "eager", "--precisions", "fp32",
        "--sizes", "64x64", "--steps", "2", "--runs", "1", "--text-len", "8", "--no-progress",
        "--denoiser-config-override", json.dumps(override), "--cache-dir", str(cache_dir), "--out", str(tmp_path),
        *(["--fuse-qkv", "--matmul-roofline"] if preset == "flux1-dev" else []),
    ])
    report = run_bench(plan)
    paths = bench.write_outputs(report, tmp_path, chart=False)
    assert report["kind"] == "denoiser"
    (r,) = report["results"]
    assert r["error"] is None, r["error"]
    assert set(bench.RESULT_FIELDS) <= set(r)
    assert len(r["samples"]["step_ms"]) == 2 and r["recompiles"] == 0
    assert r["parameters"] < 5_000_000  # the tiny override, never the full-size model
    assert r["flops_per_step"] and r["tflops"] > 0
    if preset == "flux1-dev":
        assert any("fused QKV" in n for n in report["notes"])
        assert report["extras"]["matmul"]["fp32"]["tflops"] > 0 and r["matmul_fraction"] > 0
        flops = report["extras"]["flops_per_step"]["64x64"]
        assert flops["analytic"] == flops["counted"]
    assert json.loads(Path(paths["json"]).read_text())["results"][0]["mode"] == "eager"


def test_random_weights_refuses_a_preset_without_config(cache_dir):
    from engine.errors import InvalidRequest

    plan = _plan(["--random-weights", "--preset", "tiny-flux", "--device", "cpu", "--modes", "eager",
                  "--no-progress", "--cache-dir", str(cache_dir)])
    with pytest.raises(InvalidRequest, match="denoiser_config"):
        run_bench(plan)


@pytest.mark.slow  # two fresh child processes, each compiling
def test_cache_probe_child_sees_its_own_inductor_cache(cache_dir, tiny_models):
    # Mode eager compiles nothing: this checks the plumbing (fresh processes, the folder set before the
    # child imports torch, the folder removed after), not a compile time.
    plan = _plan(["--preset", "tiny-flux", "--device", "cpu", "--precisions", "fp32", "--sizes", "64x64",
                  "--cache-dir", str(cache_dir), "--threads", "1"])
    probe = run_cache_probe(plan, "cpu", "eager")
    assert "error" not in probe, probe
    for label in ("cold", "warm"):
        child = probe[f"{label}_child"]
        assert child["env_cache_dir"] == probe["cache_dir"]
        assert Path(child["inductor_cache_dir"]) == Path(probe["cache_dir"])
    assert probe["cold_child"]["pid"] != probe["warm_child"]["pid"]
    assert not Path(probe["cache_dir"]).exists()


@pytest.mark.slow
def test_bench_command_on_tiny_flux(cache_dir, tiny_models, tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "bench", "bench", "--preset", "tiny-flux", "--device", "cpu",
        "--modes", "eager,regional", "--precisions", "fp32", "--sizes", "64x64", "--steps", "2", "--runs", "1",
        "--cache-probe", "off", "--threads", "1", "--cache-dir", str(cache_dir), "--out", str(out),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| precision | mode | size |" in proc.stdout and "| target | status |" in proc.stdout
    assert "bench tiny-flux@cpu" in proc.stderr  # the progress bar goes to stderr
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 1000 and (out / "bench.md").exists()
    assert [(r["mode"], r["size"]) for r in report["results"]] == [("eager", "64x64"), ("regional", "64x64")]
    for r in report["results"]:
        assert set(bench.RESULT_FIELDS) <= set(r)
        assert r["error"] is None, r["error"]
        assert r["recompiles"] == 0  # a warm bucket never compiles during the timed runs
        assert r["step_ms_median"] > 0 and r["image_ms_median"] > 0 and r["first_request_ms"] > 0
        assert r["load_s"] > 0 and r["warmup_s"] is not None and r["peak_memory_bytes"]
    eager, regional = report["results"]
    assert eager["compile_s"] is None and regional["compile_s"] > 0
    assert eager["speedup_vs_eager"] == pytest.approx(1.0)
    assert set(report["ratios"]) >= {t.key for t in bench.TARGETS}
    assert report["extras"]["engine_overhead"]["pairs"] == 2
    assert report["extras"]["engine_overhead"]["bare_recompiles"] == 0
    assert report["extras"]["cache_probe"] == {"skipped": "--cache-probe off"}
    statuses = {t["key"]: t["status"] for t in report["targets"]}
    assert statuses["persistent_cache"] == "n/a" and statuses["recompiles"] == "met"
    assert report["machine"]["torch"] and report["machine"]["torch_threads"] == 1


def test_time_budget_skips_configurations_and_keeps_them_in_the_report(cache_dir, tmp_path):
    plan = _plan([
        "--random-weights", "--preset", "flux1-dev", "--device", "cpu", "--modes", "eager,compile",
        "--precisions", "fp32", "--sizes", "64x64", "--steps", "1", "--runs", "1", "--text-len", "4",
        "--denoiser-config-override", json.dumps(TINY_FLUX), "--time-budget", "1e-9", "--no-progress",
        "--cache-dir", str(cache_dir), "--out", str(tmp_path),
    ])
    report = run_bench(plan)
    assert [r["error"].startswith("skipped: time budget") for r in report["results"]] == [True, True]
    assert any("time budget" in n for n in report["notes"])
    assert json.loads((tmp_path / "bench.json").read_text())["partial"] is True  # checkpoint written
    assert {t["status"] for t in report["targets"]} == {"n/a"}


# ---- aot, CUDA graphs and attention backends in the bench (additions) ------------------------------


def test_bench_modes_include_aot_and_cuda_graphs():
    assert bench.MODE_TABLE["aot"].engine is Mode.AOT and "aot" in bench.COMPILED_MODES
    assert bench.MODE_TABLE["cuda-graphs"].engine is Mode.COMPILE
    assert bench.MODE_TABLE["cuda-graphs"].overrides == {"cuda_graphs": True}


def _cold_start_children(ready_aot=6.0, rss_growth=1.05, first=21.0):
    def child(mode, ready, warm, origin=None):
        buckets = [{"size": s, "state": "warm", "origin": origin, "error": None,
                    "rss": int(600e6 * (1 + i * (rss_growth - 1) / 3))}
                   for i, s in enumerate(("64x64", "128x128", "64x128", "128x64"))]
        return {"mode": mode, "ready_s": ready, "warm_s": warm, "load_s": 1.0, "startup_s": 4.0, "buckets": buckets,
                "rss_loaded": int(580e6), "warm_compiles": 0, "inductor_cache_files": 0}

    aot = child("aot", ready_aot, 1.0, "loaded from package")
    aot.update(first_request_ms={"64x64": first, "128x128": 30.0, "64x128": 25.0, "128x64": 25.0},
               steady_ms={"64x64": 20.0, "128x128": 30.0, "64x128": 25.0, "128x64": 25.0}, request_recompiles=0)
    return {"compile_empty": child("compile", 200.0, 195.0), "compile_filled": child("compile", 25.0, 20.0),
            "aot": aot, "export_s": 400.0}


def test_aot_ratios_and_cold_start_targets():
    from bench.cold_start import _ratios

    results = [dict(r) for r in HAND_MADE] + [_result("fp32", "aot", "64x64", 2.1, compile_s=1.2, first_request_ms=19.0,
                                                      origin="loaded from package")]
    cold = _cold_start_children()
    _ratios(cold)
    assert cold["ratios"]["aot_cold_start_empty"] == pytest.approx(6 / 200)
    assert cold["ratios"]["aot_cold_start_filled"] == pytest.approx(6 / 25)
    assert cold["ratios"]["aot_warmup_filled"] == pytest.approx(1 / 20)
    assert cold["ratios"]["aot_first_request"] == pytest.approx(1.0)  # median over buckets (1.05, 1, 1, 1)
    assert "worst 64x64" in cold["notes"]["aot_first_request"]
    assert cold["ratios"]["aot_memory"] == pytest.approx(1.05)
    targets = {t["key"]: t for t in bench.evaluate_targets(bench.compute_ratios(results, {"cold_start": cold}))}
    assert targets["aot_step"]["value"] == pytest.approx(2.1 / 2.0) and targets["aot_step"]["status"] == "met"
    for key in ("aot_cold_start_empty", "aot_cold_start_filled", "aot_warmup_filled", "aot_first_request",
                "aot_memory", "aot_recompiles"):
        assert targets[key]["status"] == "met", key

    slow = _cold_start_children(ready_aot=15.0, rss_growth=1.3, first=40.0)
    slow["aot"]["first_request_ms"].update({"128x128": 60.0, "64x128": 50.0})  # three of four buckets slow
    _ratios(slow)
    targets = {t["key"]: t for t in bench.evaluate_targets(bench.compute_ratios(results, {"cold_start": slow}))}
    assert {k for k, t in targets.items() if t["status"] == "MISSED" and k.startswith("aot")} == {
        "aot_cold_start_filled", "aot_memory", "aot_first_request"}
    # A bucket that was built rather than loaded is an error of the probe, never a fast "cold start".
    built = _cold_start_children()
    built["aot"]["buckets"][1]["origin"] = "built now"
    _ratios(built)
    assert "ratios" not in built and "128x128 was not loaded from a package" in built["error"]
    targets = {t["key"]: t for t in bench.evaluate_targets(bench.compute_ratios(results, {"cold_start": built}))}
    assert targets["aot_cold_start_empty"]["status"] == "n/a" and "not loaded" in targets["aot_cold_start_empty"]["note"]


def test_table_shows_the_attention_backend_and_aot_origin():
    rows = bench.speedup_table([_result("fp32", "eager", "64x64", 8.0, attention_backend="_native_math"),
                                _result("fp32", "aot", "64x64", 2.0, origin="loaded from package")])
    assert rows[0]["attention_backend"] == "_native_math" and rows[1]["attention_backend"] == "native"
    table = bench.markdown_table(rows)
    assert "| attention |" in table and "_native_math" in table and "loaded from package" in table
    assert "attention_backend" in bench.RESULT_FIELDS and "origin" in bench.RESULT_FIELDS


def test_cuda_graphs_bench_mode_is_refused_off_cuda_with_the_reason():
    model, cpu = torch.nn.Linear(2, 2), devices.get_device("cpu")
    with pytest.raises(UnsupportedCombination, match="CUDA graphs .* need a CUDA GPU"):
        denoiser.denoiser_variant(model, "cuda-graphs", EngineOptions(), cpu)
    graphs = dataclasses.replace(cpu, cuda_graphs=True)
    assert denoiser.denoiser_variant(model, "cuda-graphs", EngineOptions(), graphs)[1]["mode"] == "reduce-overhead"
    neuron = dataclasses.replace(devices.get_device("neuron"), probe_fn=lambda: devices.Availability(True))
    with pytest.raises(UnsupportedCombination, match="NEFF"):
        denoiser.denoiser_variant(model, "aot", EngineOptions(), neuron, inputs={})


@pytest.mark.slow
def test_random_weights_denoiser_aot_package(cache_dir, tmp_path):
    plan = _plan([
        "--random-weights", "--preset", "flux1-dev", "--device", "cpu", "--modes", "eager,aot", "--precisions", "fp32",
        "--sizes", "64x64", "--steps", "2", "--runs", "1", "--text-len", "8", "--no-progress",
        "--denoiser-config-override", json.dumps(TINY_FLUX), "--cache-dir", str(cache_dir), "--out", str(tmp_path),
    ])
    report = run_bench(plan)
    eager, packaged = report["results"]
    assert packaged["error"] is None, packaged["error"]
    assert packaged["mode"] == "aot" and packaged["compile_s"] > 0 and packaged["recompiles"] == 0
    assert packaged["step_ms_median"] > 0
