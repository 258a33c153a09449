"""The advisor's choice and its file, without measuring: rows in, pick out."""

from __future__ import annotations

import json
import random

from bench import advise_report
from bench.advise import load_pick, result_path, save
from bench.advise_choice import (
    CHECKER_MIN_PSNR,
    AdvisePlan,
    Candidate,
    Measured,
    apply_final_round,
    choose,
    final_entries,
    final_pick,
    final_summary,
    scan_rank,
    stronger,
)
from bench.advise_report import markdown
from bench.paired import PairedTiming
from engine.config.presets import get_preset
from ui import advisor_views


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
                               "attention": "native", "lora_fused": False, "preset": "tiny-shapes", "device": "cpu",
                               "size": "64x64", "steps": 8, "lora": "none"}
    import app

    engine = app.apply_advice(app.DefaultEngine(preset="x", device="auto", precision="bf16", mode="compile"),
                              str(path))
    assert engine.step_cache == "first-block:0.2" and engine.attention_backend == "native"
    assert (engine.preset, engine.device, engine.precision, engine.mode) == ("tiny-shapes", "cpu", "fp32", "regional")
    table = advise_report.table_rows(report)
    assert table[0][0] == "fp32/regional/first-block:0.2" and table[0][-1] == "★ pick"
    assert table[-1][:2] == ["precision fp8", "skipped"]
    points = advisor_views.advisor_points(report)
    assert {p["verdict"] for p in points} == {"pick", "within bound"} and all(p["quality"] == 94 for p in points)
    assert "Pick: `fp32/regional/first-block:0.2`" in advise_report.summary(report)
    # A run measured with a style: --config-from starts Generate at that style, fused as the pick ran it.
    fused = {**row("fp32", "eager", ms=60), "lora_fused": True, "label": "fp32/eager/lora-fused"}
    pick, rows = choose([row("fp32", "eager"), fused], plan())
    styled = save({**report, "pick": pick, "rows": rows, "lora": "swap"}, tmp_path / "styled.json")
    assert load_pick(styled)["lora"] == "swap:fused" and load_pick(styled)["lora_fused"] is True
    assert app.apply_advice(app.DefaultEngine("x", "auto", "bf16", "compile"), str(styled)).lora == "swap:fused"


def test_the_scan_times_compiled_modes_of_the_fastest_precisions_before_caches():
    measured = {("fp32", "eager", "none", "native", False): 0.20, ("bf16", "eager", "none", "native", False): 0.50,
                ("fp32", "compile", "none", "native", False): 0.08, ("int8dq", "eager", "none", "native", False): None}
    grid = [Candidate("fp32", "eager", "first-block:0.2"), Candidate("bf16", "compile"),
            Candidate("fp32", "regional"), Candidate("fp32", "compile"), Candidate("bf16", "eager"),
            Candidate("fp32", "eager"), Candidate("fp32", "compile", "none", "flex"), Candidate("int8dq", "regional"),
            Candidate("fp32", "eager", "first-block:0.4")]
    ranks = {c.label(): scan_rank(c, measured.get) for c in grid}
    order = [label for label, r in sorted(ranks.items(), key=lambda kv: kv[1] or (9,)) if r is not None]
    assert order == ["fp32/eager", "bf16/eager", "fp32/regional", "fp32/compile", "bf16/compile",
                     "fp32/compile/attn=flex", "fp32/eager/first-block:0.2", "fp32/eager/first-block:0.4"]
    assert ranks["int8dq/regional"] is None  # int8dq failed eagerly (or was not measured): nothing builds on it
    # a load that makes another precision read faster eagerly does not put its compiles before fp32's
    measured[("bf16", "eager", "none", "native", False)] = 0.19
    order = sorted((c for c in grid if scan_rank(c, measured.get)), key=lambda c: scan_rank(c, measured.get))
    assert [c.label() for c in order][2:5] == ["fp32/regional", "fp32/compile", "bf16/compile"]


def test_a_configuration_whose_quality_was_not_measured_is_never_picked():
    rows = [row("fp32", "eager"), row("fp32", "compile", ms=50, fidelity=None),
            row("fp32", "regional", ms=60, psnr=90, diff=1)]
    rows[1]["unscored"] = "slower than 4 configurations within the bound: quality not measured"
    pick, rows = choose(rows, plan())
    assert pick["label"] == "fp32/regional" and rows[1]["why_not"].endswith("quality not measured")
    report = {"pick": pick, "rows": rows}
    assert [p["configuration"] for p in advisor_views.advisor_points(report)] == ["fp32/eager", "fp32/regional"]
    table = {r[0]: r for r in advise_report.table_rows(report)}
    assert table["fp32/compile"][-1].startswith("no: slower than 4") and table["fp32/compile"][4] == "—"


def test_the_final_round_keeps_a_step_cache_only_where_it_beat_its_base_there():
    leaders = [row("fp32", "regional", "first-block:0.2", ms=40), row("fp32", "compile", ms=45)]
    rows = [row("fp32", "eager"), *leaders, row("fp32", "regional", ms=50)]
    entries = [c.label() for c in final_entries(leaders, rows)]
    assert entries == ["fp32/eager", "fp32/regional/first-block:0.2", "fp32/regional", "fp32/compile"]
    speedups = {"fp32/eager": 1.0, "fp32/regional/first-block:0.2": 2.44, "fp32/regional": 1.92, "fp32/compile": 2.27}
    assert final_pick(leaders, speedups) == "fp32/regional/first-block:0.2"
    speedups["fp32/regional"] = 2.5  # the cache no faster than its base in the final round: not picked
    assert final_pick(leaders, speedups) == "fp32/compile"


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


def test_on_a_model_with_a_checker_the_bound_also_has_a_psnr_floor():
    p = plan()
    assert p.psnr_bound() == CHECKER_MIN_PSNR
    # taylorseer keeps fidelity (the checker reads colour and shape) but draws a visibly different picture
    rows = [row("fp32", "eager"), row("bf16", "eager", "taylorseer:3:2", ms=30, fidelity=0.94, psnr=18.1, diff=232),
            row("bf16", "eager", ms=60, fidelity=0.94, psnr=31.0, diff=40),
            row("fp32", "regional", ms=70, fidelity=0.93, psnr=CHECKER_MIN_PSNR - 0.1, diff=60)]
    pick, rows = choose(rows, p)
    assert pick["label"] == "bf16/eager"
    verdicts = {r["label"]: r for r in rows}
    assert not verdicts["bf16/eager/taylorseer:3:2"]["eligible"]
    assert verdicts["bf16/eager/taylorseer:3:2"]["why_not"] == f"drift 18.1 dB < {CHECKER_MIN_PSNR:g} dB"
    assert not verdicts["fp32/regional"]["eligible"]
    # whatever the speeds, nothing below the floor is ever picked
    for ms in (1, 5, 20, 50, 99):
        rows = [row("fp32", "eager"), row("fp32", "compile", ms=ms, psnr=CHECKER_MIN_PSNR - 3, diff=80),
                row("fp32", "regional", ms=90, psnr=60, diff=2)]
        pick, _ = choose(rows, p)
        assert pick["label"] == "fp32/regional"
    # an SSIM floor, when set, counts beside them
    rows = [row("fp32", "eager"), row("fp32", "compile", ms=40, psnr=30, diff=50),
            row("fp32", "regional", ms=60, psnr=30, diff=50)]
    rows[1]["drift_ssim"], rows[2]["drift_ssim"] = 0.90, 0.99
    pick, rows = choose(rows, plan(min_ssim=0.95))
    assert pick["label"] == "fp32/regional" and rows[1]["why_not"] == "SSIM 0.900 < 0.95"


def test_summary_table_and_json_show_one_speedup_per_configuration():
    rows = [row("fp32", "eager"), row("bf16", "eager", ms=50, psnr=31, diff=40),
            row("fp32", "regional", ms=70, psnr=60, diff=2)]
    rows[1]["paired_speedup"], rows[2]["paired_speedup"] = 1.80, 1.30  # the scan's figures
    pick, rows = choose(rows, plan())
    leaders = [r for r in rows if r["eligible"] and r["label"] != "fp32/eager"]
    timing = PairedTiming(["fp32/eager", "bf16/eager", "fp32/regional"], reference="fp32/eager")
    for i, (ref, bf16, regional) in enumerate([(100, 60, 80), (104, 62, 78), (98, 60, 79), (101, 61, 80)]):
        timing.record(i, "fp32/eager", ref)
        timing.record(i, "bf16/eager", bf16)
        timing.record(i, "fp32/regional", regional)
    confirm = final_summary(timing, leaders)
    pick = apply_final_round(rows, confirm)
    report = {"preset": "tiny-shapes", "device": "cpu", "size": "64x64", "steps": 8, "pick": pick, "rows": rows,
              "skipped": [], "elapsed_s": 30.0, "bound": {"fidelity_points": 2.0, "min_psnr_db": 25.0},
              "confirm": confirm, "quality_samples": 16, "measured_at": "now"}
    report = json.loads(json.dumps(report))  # what the Advisor tab reads from the child's JSON
    expected = timing.figure("bf16/eager")
    assert pick["label"] == "bf16/eager" and report["pick"]["speedup"] == expected.speedup == confirm["speedup"]
    text = f"{expected.speedup:.2f}× ({expected.low:.2f}–{expected.high:.2f}, 4 images)"
    assert text in advise_report.summary(report)
    table = {r[0]: r for r in advise_report.table_rows(report)}
    assert table["bf16/eager"][2].startswith(text) and "1.80" not in table["bf16/eager"][2]
    assert text in markdown(report)
    json_row = next(r for r in report["rows"] if r["label"] == "bf16/eager")
    assert json_row["speedup"] == expected.speedup and json_row["scan_speedup"] == 1.80
    assert "paired_speedup" not in json_row  # the saved JSON held 1.61 there beside the final round's 1.236
    # the pick says its margin over the quality floor (a pick sat at 25.0008 dB on a 25 dB floor)
    assert ", PSNR 31.0000 dB: 6.0 dB over its 25 dB floor" in advise_report.summary(report)
    thin = {**report, "pick": {**report["pick"], "drift_psnr_db": 25.0008}}
    assert "0.0008 dB over its 25 dB floor (a thin margin" in advise_report.summary(thin)


def test_each_card_shows_the_worst_sample_beside_eager_fp32_and_their_difference():
    import numpy as np

    from bench import quality
    from ui.advisor import advisor_cards_html

    ref = np.zeros((16, 16, 3), np.uint8)
    moved = ref.copy()
    moved[4:8, 4:8] = 255
    assert quality.worst_sample([ref, moved, ref], [ref, ref, ref]) == 1
    rows = [row("fp32", "eager"), row("bf16", "eager", ms=50, psnr=31, diff=40)]
    pick, rows = choose(rows, plan())
    rows[1].update(picture_png=quality.png_b64(moved), reference_png=quality.png_b64(ref),
                   diff_png=quality.png_b64(quality.diff_heatmap(moved, ref)), drift_ssim=0.9)
    cards = advisor_cards_html({"pick": pick, "rows": rows})
    assert cards.count('class="c-card"') == 1 and cards.count("data:image/png;base64,") == 3
    assert "★ pick" in cards and "31.0 dB PSNR, SSIM 0.900, max diff 40" in cards and "2.00× vs eager fp32" in cards


def test_when_nothing_beats_eager_fp32_the_summary_says_so_without_a_final_round():
    rows = [row("fp32", "eager"), row("bf16", "compile", ms=70, fidelity=None)]
    rows[1]["unscored"] = "time budget (3 min): quality not measured"
    pick, rows = choose(rows, plan())
    timing = PairedTiming(["fp32/eager"], reference="fp32/eager")
    pick = apply_final_round(rows, final_summary(timing, [pick]))
    report = {"preset": "tiny-shapes", "device": "cpu", "size": "64x64", "steps": 8, "pick": pick, "rows": rows,
              "skipped": [], "elapsed_s": 180.0, "bound": {}, "confirm": final_summary(timing, [pick]),
              "quality_samples": 16, "measured_at": "now"}
    assert pick["label"] == "fp32/eager"
    assert "Pick: `fp32/eager`** — no configuration within the bound measured faster than eager fp32." in markdown(report)
    assert "0 rounds" not in markdown(report)
    assert "no configuration within the bound measured faster than eager fp32" in advise_report.summary(report)


def test_with_a_lora_every_configuration_draws_the_style_and_eager_adds_it_fused():
    from bench.advise_choice import plan_grid
    from engine import devices
    from engine.protocol import LoraChoice

    styled = plan(lora=LoraChoice("swap"))
    grid, skipped = plan_grid(styled, devices.resolve_device("cpu"))
    fused = [c for c in grid if c.lora_fused]
    assert fused and {c.mode for c in fused} == {"eager"} and all(c.step_cache == "none" for c in fused)
    assert any(c.precision == "int8wo" for c in grid)  # unfused, a style runs beside quantized weights
    assert not any(c.precision.startswith("int8") for c in fused)  # fused would re-quantize at every fuse
    assert any("a fused LoRA is not served on int8" in s["why"] for s in skipped)
    assert not any(c.lora_fused for c in plan_grid(plan(), devices.resolve_device("cpu"))[0])
    assert styled.style == "swap" and plan(lora=LoraChoice("swap", 0.0)).style is None
    assert Candidate("fp32", "eager", lora_fused=True).label() == "fp32/eager/lora-fused"
    # The fused row is not the reference, and is measured right after it.
    rows = [row("fp32", "eager"), {**row("fp32", "eager", ms=60), "lora_fused": True,
                                   "label": "fp32/eager/lora-fused"}]
    pick, _ = choose(rows, plan())
    assert pick["label"] == "fp32/eager/lora-fused"
    assert scan_rank(Candidate("fp32", "eager", lora_fused=True), {}.get) == (1, True)


# -- the budget, on a fake clock: counted calls, no wall clock ----------------------------------------
class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeRunners:
    """Runners that cost fake seconds: `speeds[(precision, mode, cache family)]` per image, `compile_s` per
    compile. Compiled modes draw eager fp32's image; a step cache draws a noisy one (outside the bound).
    `load(t)`: how many times slower an image runs at fake time t; `jitter`: each image's time varies by up
    to this share (seeded), as a shared machine's do."""

    def __init__(self, clock, speeds, compile_s=27.0, load=None, jitter=0.0):
        self.clock, self.speeds, self.compile_s = clock, speeds, compile_s
        self.load, self.jitter, self.rng = load or (lambda t: 1.0), jitter, random.Random(41)
        self.calls: list[str] = []
        self.images: list[tuple[str, int]] = []  # (configuration, seed) of every image drawn
        self.requests: list = []  # every request drawn
        self.buckets: list = []  # every bucket compiled

    def get(self, c):
        return FakeRunner(self, c.precision)


class FakeRunner:
    def __init__(self, owner, precision):
        self.owner, self.precision = owner, precision

    def check_mode(self, mode):
        pass

    def weights_bytes(self):  # what the Advisor adds a run's peak to (--max-memory)
        return (2 if self.precision == "fp32" else 1) * 2**20

    def warm_bucket(self, bucket):
        from types import SimpleNamespace

        from engine.protocol import BucketState

        self.owner.clock.t += self.owner.compile_s
        self.owner.calls.append(f"compile {self.precision}/{bucket.mode}")
        self.owner.buckets.append(bucket)
        return SimpleNamespace(state=BucketState.WARM, error=None)

    def generate(self, request):
        import io
        from types import SimpleNamespace

        import numpy as np
        from PIL import Image

        cache = str(request.step_cache).split(":")[0]
        s = self.owner.speeds.get((self.precision, str(request.mode), cache)) or \
            self.owner.speeds[(self.precision, "eager", "none")]
        s *= self.owner.load(self.owner.clock.t) * (1 + self.owner.rng.uniform(-1, 1) * self.owner.jitter)
        self.owner.clock.t += s
        self.owner.calls.append(f"{self.precision}/{request.mode}/{cache}")
        self.owner.images.append((self.owner.calls[-1], request.seed))
        self.owner.requests.append(request)
        rng = np.random.default_rng(request.seed)
        pixels = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
        if cache != "none" or self.precision != "fp32":
            noise = np.random.default_rng(request.seed + 1).integers(0, 60, pixels.shape, dtype=np.uint8)
            pixels = pixels + noise
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        return SimpleNamespace(timings=SimpleNamespace(total_ms=s * 1000), image_png=buf.getvalue(), cached_steps=())


# 20 steps at 64x64 on this machine's CPU, roughly: compile fp32 1.7x, every step cache faster still but
# outside the 25 dB floor, bf16 and int8 slower eagerly
SPEEDS = {("fp32", "eager", "none"): 0.15, ("fp32", "compile", "none"): 0.088, ("fp32", "regional", "none"): 0.1,
          ("bf16", "eager", "none"): 0.3, ("int8wo", "eager", "none"): 0.4, ("int8dq", "eager", "none"): 0.35,
          **{(p, m, c): 0.07 for p in ("fp32", "bf16") for m in ("eager", "regional")
             for c in ("first-block", "magcache", "taylorseer", "faster-cache", "pyramid")}}


def run_advisor(minutes, progress=None, preset="tiny-shapes", **load):
    from bench.advise import Advisor
    from engine import settings
    from engine.protocol import Size

    clock = FakeClock()
    runners = FakeRunners(clock, SPEEDS, **load)
    p = AdvisePlan(preset=get_preset(preset), device="cpu", size=Size.parse("64x64"), steps=20,
                   max_minutes=minutes, quality_samples=6, prompt="a red circle", cache_dir=settings.cache_dir())
    report = Advisor(p, progress, clock=clock, runners=runners).run()
    return report, runners, clock


def test_a_faster_configuration_has_its_quality_checked_as_it_is_timed_and_is_picked():
    """Dozens of fast step caches outside the bound must not use up the budget before compile's quality is
    checked (the reference was picked at 1.00x when checks came after the scan)."""
    report, runners, _ = run_advisor(5)
    assert report["pick"]["label"] == "fp32/compile" and report["short_budget"] is None
    compiled = runners.calls.index("compile fp32/compile")
    # its quality samples (6 prompts) run right after its timing, before the next configuration is timed
    after = runners.calls[compiled + 1:]
    nxt = next(i for i, call in enumerate(after) if call not in ("fp32/compile/none", "fp32/eager/none"))
    assert after[:nxt].count("fp32/compile/none") == 1 + 5 + 6  # warm-up, timed, quality samples
    assert not any(r["precision"] == "fp16" for r in report["rows"])
    assert any(s["what"] == "precision fp16" and "emulated" in s["why"] for s in report["skipped"])


def test_the_shortest_budget_never_names_the_reference():
    for minutes in (1, 0.75, 0.5, 0.25):
        report, _, _ = run_advisor(minutes)
        assert report["pick"] is None or report["pick"]["label"] != "fp32/eager", minutes


def test_a_budget_too_short_for_any_check_says_so_and_what_budget_would_do():
    seen = []
    report, _, clock = run_advisor(0.25, progress=lambda done, total, desc: seen.append((done, total, desc)))
    assert report["pick"] is None
    short = report["short_budget"]
    assert short["first"] == "fp32/regional" and short["needed_minutes"] > 0.25
    text = advise_report.summary({**report, "elapsed_s": clock.t})
    assert "budget" in text and f"{short['needed_minutes']:g} min" in text and "eager fp32 stays" not in text
    # the bar moves with each configuration, not from one phase to the next
    done = [d for d, _, _ in seen]
    assert len(set(done)) >= 4 and done == sorted(done) and done[-1] == seen[-1][1] == 15
    # nothing to apply: Generate keeps its (faster) configuration
    from ui.advisor import AdvisorHandlers

    apply_button = AdvisorHandlers.render_advice(None, {**report, "elapsed_s": clock.t})[3]
    assert apply_button["interactive"] is False and apply_button["value"] == "Apply in Generate"
    # with more time, the budget named reaches the pick
    report, _, _ = run_advisor(short["needed_minutes"])
    assert report["pick"] is not None and report["pick"]["label"] != "fp32/eager"


def test_a_load_that_arrives_mid_scan_still_leaves_the_final_round_its_rounds():
    """Two runs in a row at 5 minutes, the second while the host's load rose from 2 to 12 on 2 cores: its scan
    budgeted the final round at the quiet speeds, left it 4 s, and the pick's 3 rounds read "no measurable
    difference" 148 s past the budget. The reserve follows the reference's latest images, so the scan stops
    in time for the final round's rounds."""
    # quiet; 12x slower from the first minute; 8x from 15 s, right after the reference was timed (priced at that
    # load, every compile would have been cut)
    for load in (lambda t: 1.0, lambda t: 1.0 if t < 60 else 12.0, lambda t: 1.0 if t < 15 else 8.0):
        report, runners, clock = run_advisor(5, load=load, jitter=0.05)
        confirm, pick = report["confirm"], report["pick"]
        assert pick["label"] == "fp32/compile" and pick["speedup"] >= 1.6, pick["speedup"]
        assert confirm["stop_reason"] in ("spread known", "8 rounds"), confirm["stop_reason"]  # not the budget
        assert clock.t <= 5 * 60 * 1.02  # within the budget: the final round was reserved at this load
        # one untimed image of each entry before the rounds (seed 499; the rounds' from 500): a graph that
        # recompiles does so outside them
        final = [(call, seed) for call, seed in runners.images if 499 <= seed < 600]
        entries = {call for call, _ in final}
        assert len(entries) >= 2 and [seed for _, seed in final[:len(entries)]] == [499] * len(entries)
        assert sorted(seed for _, seed in final[len(entries):]) == sorted(
            500 + r for r in range(confirm["rounds"]) for _ in entries)


def test_each_runner_runs_its_own_attention_backend(monkeypatch):
    """diffusers keeps one attention backend per process, the last one a model set, and a model left at native
    follows it: after the advisor loaded its flex runner, the native runners ran flex and fp32/compile
    recompiled on its next image (measured: 24-106 s, inside the final round's first round)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from bench import advise, measure
    from engine import devices
    from engine.protocol import EngineOptions

    class Loaded:
        def __init__(self, attention):
            self.attention, self.precision = attention, None

        def load(self):  # what diffusers' set_attention_backend does to the process
            _AttentionBackendRegistry.set_active_backend(AttentionBackendName(self.attention))

    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", _AttentionBackendRegistry._active_backend)
    monkeypatch.setattr(measure, "build_runner", lambda plan, spec, precision, mode: Loaded(
        "native" if plan.options.attention_backend == "native" else plan.options.attention_backend))
    monkeypatch.setattr(devices, "apply_precision", lambda precision: None)

    runners = advise._Runners(plan(options=EngineOptions()), spec=None)
    for attention in ("native", "flex", "native", "_native_math", "native"):
        runners.get(Candidate("fp32", "compile", attention=attention))
        assert _AttentionBackendRegistry.get_active_backend()[0] == AttentionBackendName(attention)


def test_the_advisor_bar_moves_with_the_clock_between_the_childs_messages(monkeypatch):
    """The bar read "28/60 steps" for as long as a compile ran: the child says nothing meanwhile. Between its
    messages the bar moves on in seconds, saying how long the current step has taken."""
    from helpers import FakeClock

    from ui import advisor

    clock, seen = FakeClock(100.0), []
    monkeypatch.setattr(advisor, "time", clock)
    bar = advisor.AdvisorBar(lambda value, desc="", unit="": seen.append((value, desc, unit)))
    assert bar.show({"tick": True}) == "starting"  # no budget known yet: no bar
    assert bar.show({"progress": 28, "total": 60, "desc": "fp32/regional (compiling)"}) == \
        "28 s of 60 s: fp32/regional (compiling)"
    clock.sleep(5)
    assert bar.show({"tick": True}) == "33 s of 60 s: fp32/regional (compiling) (5 s on it)"
    assert seen[-1] == ((33, 60), "advisor: fp32/regional (compiling) (5 s on it)", "s")
    clock.sleep(100)
    assert seen[-1][0] != (60, 60) and bar.show({"tick": True}).startswith("60 s of 60 s")  # never past its budget


# -- edits (issue 48: the Advisor on edits) ---------------------------------------------------------------
def test_on_an_edit_preset_every_request_edits_a_source_and_compiles_its_reference_bucket():
    report, runners, _ = run_advisor(10, preset="tiny-shapes-edit")
    assert runners.requests and all(len(r.images) == 1 and r.images_in_sequence for r in runners.requests)
    assert all(r.images[0].size == r.size for r in runners.requests)
    prompts = {r.prompt for r in runners.requests}
    assert "a red circle" not in prompts and any(p.startswith(("make the", "turn the")) for p in prompts)
    assert runners.buckets and all(b.refs == (b.size,) for b in runners.buckets), runners.buckets
    # the fake draws noise: scored by the edit checker (every sample an edit of its grammar), never right
    scored = [r for r in report["rows"] if r.get("fidelity") is not None]
    assert scored and all(r["fidelity"] == 0.0 for r in scored)


def test_the_edit_checker_scores_the_edit_done_right_and_not_the_source_left_alone():
    from bench.quality import edit_sample, fidelity_checker, sample_edits
    from engine.protocol import Size
    from training.shapes.grammar import render

    preset = get_preset("tiny-shapes-edit")
    samples = sample_edits(preset, 12, seed=5, fallback="", size=Size(64, 64))
    assert len({s.prompt for s in samples}) > 3 and all(s.edit is not None for s in samples)
    check = fidelity_checker(preset)
    for i, sample in enumerate(samples):
        done = render(sample.edit.target, 64, 64, rng=5 + i)  # the same box, the edit applied
        assert check(done, sample) is True, sample.prompt
        assert check(sample.source, sample) is False, sample.prompt
        # a source the user sends is read by the checker, and the instruction parsed against what it shows
        assert edit_sample(preset, sample.prompt, sample.source).edit == sample.edit
    assert check(samples[0].source, "a red circle on a blue background") is None  # a plain prompt: not scored
    assert edit_sample(preset, "paint it like Monet", samples[0].source).edit is None
