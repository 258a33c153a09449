"""Step caches: the vocabulary, which cache runs in which mode, and diffusers' own hooks for real on the
trained tiny-shapes pipeline (cached steps counted, no leak into other variants, regional stays warm)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine import devices
from engine.config.presets import get_preset
from engine.config.request import ImageRequest
from engine.config.validation import build_request
from engine.errors import InvalidRequest, UnsupportedCombination, scrub_paths
from engine.pipeline import stepcache
from engine.pipeline.runner import PipelineRunner
from engine.protocol import (
    BucketKey,
    BucketState,
    EngineConfig,
    EngineKey,
    EngineOptions,
    GenerateRequest,
    GenerateResult,
    Mode,
    StepCache,
    StepCacheKind,
)
from training.shapes.fidelity import check

PRESET = get_preset("tiny-shapes")
CPU = devices.get_device("cpu")
STEPS = 12


# -- vocabulary ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, canonical", [
    ("none", "none"), ("", "none"), (None, "none"),
    ("first-block", "first-block:0.2"), ("First-Block:0.1", "first-block:0.1"),
    ("taylorseer", "taylorseer:3:2"), ("taylorseer:4", "taylorseer:4:2"), ("taylorseer:3:2", "taylorseer:3:2"),
    ("magcache", "magcache:0.06"), ("magcache:0.1", "magcache:0.1"),
    ("faster-cache", "faster-cache:2"), ("pyramid:3", "pyramid:3"),
])
def test_parse_and_canonical_text(text, canonical):
    cache = StepCache.parse(text)
    assert str(cache) == canonical
    assert StepCache.parse(str(cache)) == cache  # the canonical text round-trips


@pytest.mark.parametrize("text, says", [
    ("fbcache", "unknown step cache"), ("first-block:abc", "not a number"), ("first-block:0", "out of range"),
    ("taylorseer:0", "out of range"), ("taylorseer:3:2:1", "too many"), ("none:1", "too many"),
])
def test_bad_texts_name_the_valid_forms(text, says):
    with pytest.raises(InvalidRequest, match=says) as err:
        StepCache.parse(text)
    assert "first-block[:THRESHOLD]" in str(err.value) and "taylorseer[:INTERVAL][:WARMUP]" in str(err.value)


@pytest.mark.parametrize("text, says", [
    ("taylorseer:3:0", "warmup 0 is out of range: allowed 1..200 (the first step must be computed"),
    ("taylorseer:0", "interval 0 is out of range: allowed 1..200"),
    ("taylorseer:2.5", "interval '2.5' is not a whole number (allowed 1..200)"),
    ("pyramid:201", "interval 201 is out of range: allowed 1..200"),
    ("faster-cache:" + "9" * 400, "interval inf is out of range: allowed 1..200"),
    ("first-block:nan", "threshold nan is out of range: allowed above 0 and below 10"),
    ("magcache:-1", "threshold -1 is out of range: allowed above 0 and below 10"),
])
def test_parameters_diffusers_cannot_run_are_refused_naming_field_and_range(text, says):
    with pytest.raises(InvalidRequest) as err:
        StepCache.parse(text)
    assert says in str(err.value)
    with pytest.raises(InvalidRequest, match="out of range|not a whole number"):  # the same through a request
        build_request(PRESET, ImageRequest(PRESET.name, prompt="x", width=64, height=64, step_cache=text))


def test_request_and_result_carry_the_cache():
    request = GenerateRequest.checked("a red circle on a blue background", 64, 64, 8, 1.0, 0, step_cache="first-block:0.3")
    assert request.step_cache == StepCache(StepCacheKind.FIRST_BLOCK, threshold=0.3)
    built, _ = build_request(PRESET, ImageRequest(PRESET.name, prompt="x", width=64, height=64,
                                                  step_cache="taylorseer:4"))
    assert str(built.step_cache) == "taylorseer:4:2"
    with pytest.raises(InvalidRequest):
        build_request(PRESET, ImageRequest(PRESET.name, prompt="x", width=64, height=64, step_cache="bogus"))
    assert build_request(PRESET, ImageRequest(PRESET.name, prompt="x", width=64,
                                              height=64))[0].step_cache == StepCache()


# -- which cache runs where ------------------------------------------------------------------------
def _rows(preset, mode):
    return {r["name"]: r for r in stepcache.available_step_caches(preset, CPU, mode)}


def test_listing_per_mode():
    eager = _rows(PRESET, "eager")
    assert list(eager) == list(StepCacheKind.values())
    assert all(r["usable"] for r in eager.values())
    assert eager["taylorseer"]["params"] == {"interval": 3, "warmup": 2}
    regional = _rows(PRESET, "regional")
    assert regional["first-block"]["usable"] and regional["magcache"]["usable"]
    for name in ("taylorseer", "faster-cache", "pyramid"):
        assert not regional[name]["usable"] and "inside the repeated blocks" in regional[name]["why_not"]
    for mode in ("compile", "aot"):
        rows = _rows(PRESET, mode)
        assert rows["none"]["usable"]
        assert not any(r["usable"] for name, r in rows.items() if name != "none")
    unet = _rows(get_preset("tiny-sdxl"), "eager")
    assert not unet["first-block"]["usable"] and "CacheMixin" in unet["first-block"]["why_not"]
    tpu_only = _rows(PRESET, "defer-and-fuse")  # a mode the CPU does not run
    assert "does not run mode" in tpu_only["first-block"]["why_not"]


# -- for real: diffusers' hooks on the trained tiny pipeline ------------------------------------------
@pytest.fixture(scope="module")
def runner(cache_dir, tiny_models, tmp_path_factory):
    config = EngineConfig(EngineKey("tiny-shapes", "cpu", "fp32"), PRESET, EngineOptions(warm_steps=2),
                          str(cache_dir))
    r = PipelineRunner(config)
    r.load()
    # magcache calibrations go to a fresh folder: the first magcache request calibrates here
    r.step_caches.cache_dir = tmp_path_factory.mktemp("stepcache")
    return r


PROMPT = "a red circle on a blue background"


def _request(cache="none", mode="eager", steps=STEPS, seed=3) -> GenerateRequest:
    size = PRESET.buckets[0]
    return GenerateRequest.checked(PROMPT, size.width, size.height, steps, PRESET.guidance, seed, mode=mode, step_cache=cache)


def _run(runner, request) -> tuple[GenerateResult, list]:
    progress = []
    return runner.generate(request, on_step=progress.append), progress


def _pixels(result) -> np.ndarray:
    return np.asarray(result.image().convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def baseline(runner):
    return _run(runner, _request())[0]


@pytest.mark.parametrize("cache", ["first-block:0.2", "taylorseer:3:2", "magcache", "faster-cache", "pyramid"])
def test_each_cache_serves_steps_from_its_hooks(runner, baseline, cache):
    result, progress = _run(runner, _request(cache))
    assert str(result.step_cache) == str(StepCache.parse(cache))
    assert result.cached_steps, f"{cache} served no step from the cache"
    assert 1 not in result.cached_steps  # the first step has nothing to reuse
    assert result.computed_steps == STEPS - len(result.cached_steps) >= 1
    assert tuple(p.step for p in progress if p.cached) == result.cached_steps
    assert len(progress) == STEPS
    assert not np.array_equal(_pixels(result), _pixels(baseline))  # reused work changes the pixels a little
    assert check(np.asarray(result.image().convert("RGB")), PROMPT).correct
    out = result.as_dict()
    assert out["cached_steps"] == list(result.cached_steps) and out["computed_steps"] == result.computed_steps


# Each end of every parameter's range, run by diffusers' own hooks (an interval past the step count: no
# step is predicted, which is allowed).
@pytest.mark.parametrize("cache", ["taylorseer:1:1", "taylorseer:200:200", "faster-cache:1", "pyramid:1",
                                   "pyramid:200", "first-block:0.001", "first-block:9.99", "magcache:9.99"])
def test_the_ends_of_each_range_run_in_diffusers(runner, cache):
    result, progress = _run(runner, _request(cache, steps=4))
    assert str(result.step_cache) == str(StepCache.parse(cache)) and len(progress) == 4
    assert result.computed_steps + len(result.cached_steps) == 4 and 1 not in result.cached_steps


def test_just_below_the_warmup_range_diffusers_fails_and_no_visitor_reads_showcaseerror(runner):
    from engine.errors import ShowcaseError
    from ui.common import to_gradio_error

    cache = StepCache.parse("taylorseer:3:1")
    object.__setattr__(cache, "warmup", 0)  # what validation let through before: step 0 predicted from nothing
    with pytest.raises(ValueError, match="Cannot predict without prior initialization") as err:
        runner.generate(_request(cache, steps=4))
    # The worker sends a library's error on wrapped like this; the page titles it by what happened.
    shown = to_gradio_error(ShowcaseError(f"{type(err.value).__name__}: {err.value}"))
    assert shown.title == "Generation failed" and "ShowcaseError" not in f"{shown.title} {shown.message}"


def test_caches_never_leak_into_the_shared_denoiser(runner, baseline):
    _run(runner, _request("first-block:0.2"))
    _run(runner, _request("taylorseer:3:2"))
    shared = runner.pipe.transformer
    assert not getattr(shared, "_cache_config", None)
    for module in shared.modules():
        registry = getattr(module, "_diffusers_hook", None)
        assert registry is None or not registry.hooks, f"hook left on the shared denoiser: {registry.hooks}"
        assert "forward" not in module.__dict__
    again, progress = _run(runner, _request())
    assert again.cached_steps == () and not any(p.cached for p in progress)
    assert np.array_equal(_pixels(again), _pixels(baseline))  # the same pixels as before any cache ran


def test_a_cache_variant_is_reused_and_its_state_reset(runner):
    first, _ = _run(runner, _request("first-block:0.2", seed=5))
    second, _ = _run(runner, _request("first-block:0.2", seed=5))
    assert first.cached_steps == second.cached_steps
    assert np.array_equal(_pixels(first), _pixels(second))  # no state carried over from the last run


def test_magcache_calibrates_once_per_steps_and_stores_it(runner):
    path = runner.step_caches.calibration_path(6)
    assert not path.exists()
    first, _ = _run(runner, _request("magcache", steps=6))
    notice = next(n for n in first.notices if "magcache: calibrated" in n)
    assert str(runner.step_caches.cache_dir) not in notice and scrub_paths(notice) == notice  # no server path
    stored = json.loads(path.read_text())
    assert stored["steps"] == 6 and len(stored["mag_ratios"]) == 6 and stored["mag_ratios"][0] == 1.0
    other, _ = _run(runner, _request("magcache:0.1", steps=6))  # another threshold: a new variant, same ratios
    assert not any("magcache: calibrated" in n for n in other.notices)


def test_refused_where_the_mode_cannot_hold_the_cache():
    """The gate refuses it (engine/serving/gate.py) before a request reaches any engine."""
    for cache, mode, words in (("first-block", "compile", "one graph"), ("taylorseer", "regional", "attention layers")):
        with pytest.raises(UnsupportedCombination, match=words):
            stepcache.check_step_cache(cache, PRESET, CPU, Mode(mode))


@pytest.mark.parametrize("preset", ["tiny-shapes-edit", "tiny-shapes-inpaint", "tiny-shapes-img2img"])
@pytest.mark.parametrize("cache", ["first-block", "taylorseer"])
def test_refused_for_a_pipeline_that_sets_no_cache_context(preset, cache):
    """Those pipelines call the denoiser outside `cache_context(...)`: diffusers' hooks failed every step of
    them with a 500 ("No cache context is set"); the gate says why before a request reaches an engine."""
    with pytest.raises(UnsupportedCombination, match="outside a diffusers cache context"):
        stepcache.check_step_cache(cache, get_preset(preset), CPU, Mode.EAGER)
    assert stepcache.check_step_cache(cache, PRESET, CPU, Mode.EAGER)  # tiny-shapes' FluxPipeline sets one


@pytest.mark.slow  # compiles a regional bucket
def test_regional_keeps_its_warm_graphs_under_a_block_cache(runner, baseline):
    bucket = BucketKey(Mode.REGIONAL, PRESET.buckets[0])
    assert runner.warm_bucket(bucket).state is BucketState.WARM
    plain, _ = _run(runner, _request(mode="regional"))
    cached, progress = _run(runner, _request("first-block:0.2", mode="regional"))
    assert cached.warm and not cached.eager_fallback
    assert cached.recompiles == 0  # the hooks wrap the warm compiled blocks from outside
    assert cached.cached_steps and tuple(p.step for p in progress if p.cached) == cached.cached_steps
    assert plain.recompiles == 0 and plain.cached_steps == ()
    eager_cached, _ = _run(runner, _request("first-block:0.2"))
    assert eager_cached.cached_steps == cached.cached_steps  # the same decisions as eagerly
    assert np.abs(_pixels(eager_cached) - _pixels(cached)).max() <= 8


# -- the command line and the levers bench ---------------------------------------------------------------
def test_step_caches_command_lists_every_cache(capsys):
    from engine.cli import main

    assert main(["step-caches", "--device", "cpu", "--mode", "regional", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in out["caches"]}
    assert out["preset"] == "tiny-shapes" and set(rows) == set(StepCacheKind.values())
    assert rows["first-block"]["usable"] and not rows["pyramid"]["usable"]
    assert rows["taylorseer"]["ranges"]["warmup"].startswith("1..200 (the first step must be computed")
    assert main(["step-caches", "--device", "cpu", "--mode", "eager"]) == 0
    assert "(default taylorseer:3:2; INTERVAL 1..200, WARMUP 1..200)" in capsys.readouterr().out


def test_levers_targets_on_hand_made_rows():
    from types import SimpleNamespace

    from bench import levers

    def row(precision, mode, cache, ms, fidelity, error=None):
        return {"precision": precision, "mode": mode, "cache": cache, "image_ms": [ms] if ms else [],
                "cached_steps": 0, "error": error, "fidelity": fidelity, "recompiles": 0}

    raw = [row("fp32", "eager", "none", 300.0, 1.0), row("fp32", "eager", "first-block:0.2", 200.0, 0.98),
           row("fp32", "eager", "taylorseer:3:2", 100.0, 0.9),  # fastest, but loses 10 fidelity points
           row("fp32", "regional", "first-block:0.2", 150.0, 0.98),
           row("fp32", "compile", "first-block:0.2", None, None, "UnsupportedCombination: one graph")]
    plan = SimpleNamespace(steps=20, preset=PRESET)
    rows = {(r["precision"], r["mode"], r["cache"]): r for r in raw}
    results = [levers._finish(r, rows, plan) for r in raw]
    assert results[1]["cache_speedup"] == pytest.approx(1.5) and results[1]["computed_steps"] == 20
    # the paired figure (one round here) is the row's one speedup, in the JSON and the table
    assert results[2]["speedup_vs_reference"] == results[2]["speedup_figure"]["speedup"] == pytest.approx(3.0)
    assert results[2]["speedup_figure"]["images"] == 1 and results[4]["speedup_figure"] is None
    assert results[3]["speedup_vs_eager_same_cache"] == pytest.approx(200 / 150)
    targets = {t["key"]: t for t in levers._targets(plan, results)}
    speed = targets["step_cache_speedup"]
    assert speed["status"] == "met" and speed["by"] == "first-block:0.2"  # taylorseer is out: fidelity
    assert targets["offered_combinations_run"]["status"] == "met"  # a refusal is not a failure
    assert levers._targets(SimpleNamespace(steps=8, preset=PRESET), results)[0]["status"] == "n/a"
    slow = [dict(results[0]), {**results[1], "cache_speedup": 1.2}]
    assert levers._targets(plan, slow)[0]["status"] == "MISSED"
    assert "refused: one graph" in levers.markdown({
        "preset": "p", "device": "cpu", "size": "64x64", "steps": 20, "runs": 1, "quality_samples": 0,
        "results": results, "targets": levers._targets(plan, results)})


@pytest.mark.slow  # two engines, a small levers bench
def test_levers_bench_runs_caches_and_quantized_precisions(cache_dir, tiny_models, tmp_path):
    from bench import levers
    from bench.commands import build_parser
    from bench.plan import plan_from_args

    args = build_parser().parse_args([
        "bench", "--preset", "tiny-shapes", "--device", "cpu", "--caches", "none,first-block,FIRST-BLOCK:0.2",
        "--precisions", "fp32,int8dq", "--modes", "eager", "--steps", "8", "--runs", "1",
        "--quality-samples", "2", "--no-progress", "--cache-dir", str(cache_dir)])
    plan = plan_from_args(args)
    assert plan.caches == ("none", "first-block:0.2")  # canonical, duplicates dropped
    report = levers.run_levers_bench(plan)
    rows = {(r["precision"], r["mode"], r["cache"]): r for r in report["results"]}
    assert len(rows) == 4
    for key in [("fp32", "eager", "none"), ("fp32", "eager", "first-block:0.2"), ("int8dq", "eager", "none"),
                ("int8dq", "eager", "first-block:0.2")]:
        r = rows[key]
        assert r["error"] is None, r["error"]
        assert r["image_ms_median"] > 0 and r["fidelity"] is not None and r["drift_max_diff"] is not None
    assert rows[("fp32", "eager", "none")]["drift_max_diff"] == 0
    assert rows[("int8dq", "eager", "none")]["drift_max_diff"] > 0
    assert rows[("fp32", "eager", "first-block:0.2")]["cached_steps"] >= 1
    assert [t["status"] for t in report["targets"]] == ["n/a", "met", "met"]  # 8 steps: the speed target is n/a
    assert levers.write(report, tmp_path)["json"].endswith("levers.json")


@pytest.mark.slow  # starts a worker process
def test_through_the_manager_and_a_worker(manager):
    progress = []
    result = manager.generate(ImageRequest(preset="tiny-shapes", device="cpu", precision="fp32",
                                           prompt=PROMPT, steps=STEPS, seed=3,
                                           step_cache="first-block:0.2"), on_progress=progress.append)
    assert str(result.step_cache) == "first-block:0.2" and result.cached_steps
    assert tuple(p.step for p in progress if p.cached) == result.cached_steps
    with pytest.raises(InvalidRequest, match="valid forms"):
        manager.generate(ImageRequest(preset="tiny-shapes", device="cpu", precision="fp32", prompt=PROMPT,
                                      step_cache="fast"))
    engines = len(manager.residency.engines())
    with pytest.raises(UnsupportedCombination, match="one graph"):
        manager.generate(ImageRequest(preset="tiny-shapes", device="cpu", precision="int8wo", prompt=PROMPT,
                                      mode="compile", step_cache="first-block"))
    assert len(manager.residency.engines()) == engines  # refused before an int8wo engine started
