"""The advisor's choice and its file, without measuring: rows in, pick out."""

from __future__ import annotations

import json
from types import SimpleNamespace

from engine.bench.advise import (
    AdvisePlan,
    Candidate,
    Measured,
    choose,
    final_entries,
    final_pick,
    load_pick,
    result_path,
    save,
    scan_rank,
    stronger,
)
from engine.config.presets import get_preset
from ui import views


def row(precision, mode, cache="none", ms=100.0, fidelity=0.94, psnr=None, diff=0, attention="native"):
    label = "/".join([precision, mode] + ([cache] if cache != "none" else []))
    return {"precision": precision, "mode": mode, "step_cache": cache, "attention": attention, "label": label,
            "s_per_image": ms / 1000, "fidelity": fidelity, "drift_psnr_db": psnr, "drift_max_diff": diff,
            "error": None}


def plan(**kw):
    return AdvisePlan(preset=get_preset("tiny-shapes"), device="cpu", size="64x64", steps=8, **kw)


def test_the_pick_is_the_fastest_within_two_fidelity_points():
    rows = [row("fp32", "eager"), row("fp32", "compile", ms=50, fidelity=0.92, psnr=86, diff=1),
            row("bf16", "compile", ms=40, fidelity=0.90, psnr=29, diff=144),  # 4 points lost: out
            row("int8dq", "eager", ms=45, fidelity=0.93, psnr=25, diff=90)]
    pick, rows = choose(rows, plan())
    assert pick["label"] == "int8dq/eager" and pick["speedup"] == 100 / 45
    assert not next(r for r in rows if r["label"] == "bf16/compile")["eligible"]
    # A PSNR floor set by the user rules int8dq out (25 dB), leaving compile
    pick, _ = choose([dict(r) for r in rows], plan(min_psnr_db=30))
    assert pick["label"] == "fp32/compile"


def test_a_step_cache_is_picked_only_where_it_measured_faster_than_without():
    rows = [row("fp32", "eager"), row("fp32", "regional", ms=70),
            row("fp32", "regional", "first-block:0.2", ms=72, fidelity=0.94, psnr=31, diff=20),
            row("fp32", "eager", "magcache:0.06", ms=60, fidelity=0.93, psnr=28, diff=40)]
    pick, rows = choose(rows, plan())
    assert pick["label"] == "fp32/eager/magcache:0.06"
    slower = next(r for r in rows if r["label"] == "fp32/regional/first-block:0.2")
    assert not slower["eligible"] and "no faster" in slower["why_not"]


def test_without_a_checker_the_bound_is_psnr_30_db():
    p = AdvisePlan(preset=get_preset("tiny-flux"), device="cpu", size="64x64", steps=4)
    rows = [row("fp32", "eager", fidelity=None), row("bf16", "eager", ms=50, fidelity=None, psnr=29.1, diff=5),
            row("fp32", "compile", ms=60, fidelity=None, psnr=86, diff=1)]
    pick, _ = choose(rows, p)
    assert p.psnr_bound() == 30 and pick["label"] == "fp32/compile"


def test_the_saved_file_drives_the_app_defaults_and_the_views(tmp_path):
    rows = [row("fp32", "eager"), row("fp32", "regional", "first-block:0.2", ms=40, psnr=31, diff=20),
            row("fp32", "regional", ms=60)]
    pick, rows = choose(rows, plan())
    report = {"preset": "tiny-shapes", "device": "cpu", "size": "64x64", "steps": 8, "pick": pick, "rows": rows,
              "skipped": [{"what": "precision fp8", "why": "needs CUDA"}], "elapsed_s": 12.0,
              "bound": {"fidelity_points": 2.0, "min_psnr_db": None}, "confirm": {"rounds": 8}}
    path = save(report, result_path(tmp_path, "tiny-shapes", "cpu", "64x64", 8))
    assert path.name == "tiny-shapes@cpu-64x64-8steps.json" and json.loads(path.read_text())["pick"]
    assert load_pick(path) == {"precision": "fp32", "mode": "regional", "step_cache": "first-block:0.2",
                               "attention": "native", "preset": "tiny-shapes", "device": "cpu", "size": "64x64",
                               "steps": 8}
    import app

    args = SimpleNamespace(config_from=str(path), preset="x", device="auto", precision="bf16", mode="compile",
                           attention_backend="native")
    assert app.apply_advice(args) == "first-block:0.2"
    assert (args.preset, args.device, args.precision, args.mode) == ("tiny-shapes", "cpu", "fp32", "regional")
    table = views.advisor_rows(report)
    assert table[0][0] == "fp32/regional/first-block:0.2" and table[0][-1] == "★ pick"
    assert table[-1][:2] == ["precision fp8", "skipped"]
    points = views.advisor_points(report)
    assert {p["verdict"] for p in points} == {"pick", "within bound"} and all(p["quality"] == 94 for p in points)
    assert "Pick: `fp32/regional/first-block:0.2`" in views.advisor_markdown(report)


def test_the_scan_times_compiled_modes_of_the_fastest_precisions_before_caches():
    measured = {("fp32", "eager", "none", "native"): 0.20, ("bf16", "eager", "none", "native"): 0.50,
                ("fp32", "compile", "none", "native"): 0.08, ("int8dq", "eager", "none", "native"): None}
    grid = [Candidate("fp32", "eager", "first-block:0.2"), Candidate("bf16", "compile"),
            Candidate("fp32", "regional"), Candidate("fp32", "compile"), Candidate("bf16", "eager"),
            Candidate("fp32", "eager"), Candidate("fp32", "compile", "none", "flex"), Candidate("int8dq", "regional"),
            Candidate("fp32", "eager", "first-block:0.4")]
    ranks = {c.label(): scan_rank(c, measured.get) for c in grid}
    order = [label for label, r in sorted(ranks.items(), key=lambda kv: kv[1] or (9,)) if r is not None]
    assert order == ["fp32/eager", "bf16/eager", "fp32/regional", "fp32/compile", "bf16/compile",
                     "fp32/compile/attn=flex", "fp32/eager/first-block:0.2", "fp32/eager/first-block:0.4"]
    assert ranks["int8dq/regional"] is None  # int8dq failed eagerly (or was not measured): nothing builds on it


def test_a_configuration_whose_quality_was_not_measured_is_never_picked():
    rows = [row("fp32", "eager"), row("fp32", "compile", ms=50, fidelity=None),
            row("fp32", "regional", ms=60, psnr=90, diff=1)]
    rows[1]["unscored"] = "slower than 4 configurations within the bound: quality not measured"
    pick, rows = choose(rows, plan())
    assert pick["label"] == "fp32/regional" and rows[1]["why_not"].endswith("quality not measured")
    report = {"pick": pick, "rows": rows}
    assert [p["configuration"] for p in views.advisor_points(report)] == ["fp32/eager", "fp32/regional"]
    table = {r[0]: r for r in views.advisor_rows(report)}
    assert table["fp32/compile"][-1].startswith("no: slower than 4") and table["fp32/compile"][4] == "—"


def test_the_final_round_keeps_a_step_cache_only_where_it_beat_its_base_there():
    leaders = [row("fp32", "regional", "first-block:0.2", ms=40), row("fp32", "compile", ms=45)]
    rows = [row("fp32", "eager"), *leaders, row("fp32", "regional", ms=50)]
    entries = [c.label() for c in final_entries(leaders, rows)]
    assert entries == ["fp32/eager", "fp32/regional/first-block:0.2", "fp32/regional", "fp32/compile"]
    medians = {"fp32/eager": 100, "fp32/regional/first-block:0.2": 41, "fp32/regional": 52, "fp32/compile": 44}
    assert final_pick(leaders, medians) == "fp32/regional/first-block:0.2"
    medians["fp32/regional"] = 40  # the cache no faster than its base in the final round: not picked
    assert final_pick(leaders, medians) == "fp32/compile"


def test_speed_is_the_speedup_timed_next_to_the_reference_where_measured_so():
    # compile ran in a quiet spell (lower s/image) but, timed in alternation with eager fp32, regional gains more
    rows = [row("fp32", "eager", ms=200), row("fp32", "compile", ms=60), row("fp32", "regional", ms=80)]
    rows[1]["paired_speedup"], rows[2]["paired_speedup"] = 1.5, 1.7
    pick, rows = choose(rows, plan())
    assert pick["label"] == "fp32/regional" and pick["speedup"] == 1.7 and rows[0]["speedup"] == 1.0
    m = Measured(Candidate("fp32", "compile"), image_ms=[50.0, 60.0, 70.0], ref_ms=[100.0, 120.0])
    assert m.paired_speedup == 110 / 55  # the images timed next to the reference's only


def test_each_cache_is_also_tried_loosened_one_notch():
    assert [stronger(c) for c in ("first-block:0.2", "magcache:0.06", "taylorseer:3:2", "pyramid:2", "none")] == [
        "first-block:0.4", "magcache:0.12", "taylorseer:4:2", "pyramid:3", None]
