"""The measuring discipline Compare, the Advisor and the bench share (bench/paired.py): pure, no model."""

from __future__ import annotations

import pytest

from bench import paired
from bench.paired import NO_DIFFERENCE, PairedTiming, measure_round_robin


def test_each_round_starts_one_configuration_further_along():
    labels = ["ref", "a", "b"]
    assert [paired.rotation(labels, r) for r in range(4)] == [
        ["ref", "a", "b"], ["a", "b", "ref"], ["b", "ref", "a"], ["ref", "a", "b"]]
    plan = PairedTiming(["a", "b"], reference="ref")
    assert plan.labels[0] == "ref"  # the reference is added when not among the labels


def _fake_clock():
    now = [0.0]

    def clock():
        return now[0]

    return now, clock


def test_every_configuration_is_warmed_before_any_is_timed_and_rounds_rotate():
    calls = []
    plan = PairedTiming(["ref", "a", "b"], reference="ref", min_rounds=3, max_rounds=3)
    measure_round_robin(plan, time_one=lambda label, r: calls.append(("time", label, r)) or 10.0,
                        warm=lambda label: calls.append(("warm", label)) or {"compile_s": 2.0})
    assert calls[:3] == [("warm", "ref"), ("warm", "a"), ("warm", "b")]
    timed = [c[1] for c in calls[3:]]
    assert timed == ["ref", "a", "b", "a", "b", "ref", "b", "ref", "a"]
    assert plan.warm["a"] == {"compile_s": 2.0}  # reported apart: no figure includes it
    assert plan.figure("a").s_per_image == pytest.approx(0.010)


def test_rounds_stop_once_the_spread_is_known():
    plan = PairedTiming(["ref", "a"], reference="ref", tolerance=0.05, min_rounds=3, max_rounds=20)
    measure_round_robin(plan, time_one=lambda label, r: 100.0 if label == "ref" else 50.0)
    assert plan.rounds == 3 and plan.stop_reason == "spread known"
    f = plan.figure("a")
    assert f.speedup == pytest.approx(2.0) and f.images == 3 and f.verdict == "faster"
    assert f.text() == "2.00× (2.00–2.00, 3 images)"


def test_a_noisy_ratio_gets_more_rounds_until_max_rounds():
    noise = [50.0, 80.0, 40.0, 70.0, 45.0, 90.0]
    plan = PairedTiming(["ref", "a"], reference="ref", tolerance=0.05, min_rounds=3, max_rounds=6)
    measure_round_robin(plan, time_one=lambda label, r: 100.0 if label == "ref" else noise[r])
    assert plan.rounds == 6 and plan.stop_reason == "6 rounds"
    assert plan.spread("a") > 0.05


def test_the_time_budget_ends_the_rounds():
    now, clock = _fake_clock()

    def time_one(label, r):
        now[0] += 1.0
        return 100.0 if label == "ref" else 50.0 + 30 * (r % 2)

    plan = PairedTiming(["ref", "a"], reference="ref", tolerance=0.01, min_rounds=2, max_rounds=50, budget_s=7.0)
    measure_round_robin(plan, time_one=time_one, clock=clock)
    # 2 s per round: a fourth round would end at 8 s > 7 s
    assert plan.rounds == 3 and plan.stop_reason == "time budget (7 s)"


def test_a_spread_across_one_says_no_measurable_difference():
    times = {0: 90.0, 1: 110.0, 2: 95.0, 3: 108.0}
    plan = PairedTiming(["ref", "a"], reference="ref", min_rounds=4, max_rounds=4)
    measure_round_robin(plan, time_one=lambda label, r: 100.0 if label == "ref" else times[r])
    f = plan.figure("a")
    assert f.low < 1.0 < f.high and f.verdict == NO_DIFFERENCE
    assert f.text().startswith(NO_DIFFERENCE) and "4 images" in f.text()
    assert plan.figure("ref").verdict == "reference"


def test_a_figure_is_marked_when_something_else_ran_during_its_images():
    calls = iter(range(100))  # marks are read before and after each image: round 1's images are calls 4-7

    def time_one(label, r):
        return 100.0 if label == "ref" else 50.0

    def marks():
        return ["compile running (e cpu compile 64x64)"] if 4 <= next(calls) <= 7 else []

    plan = PairedTiming(["ref", "a"], reference="ref", min_rounds=3, max_rounds=3)
    measure_round_robin(plan, time_one=time_one, marks=marks)
    assert "compile running" in plan.figure("a").text()
    assert plan.figure("a").as_dict()["marks"] == ["compile running (e cpu compile 64x64), 1 of 3 images"]
    quiet = PairedTiming(["ref", "a"], reference="ref", min_rounds=3, max_rounds=3)
    measure_round_robin(quiet, time_one=lambda label, r: 50.0, marks=lambda: [])
    assert quiet.figure("a").marks == [] and "marked" not in quiet.figure("a").text()


def test_marks_are_summarised_per_kind_with_the_images_they_touched():
    per_image = [["host load 3.1 on 2 cores"], [], ["host load 4.5 on 2 cores", "compile running (x)"],
                 ["host load 3.9 on 2 cores"]]
    assert paired.summarise_marks(per_image) == ["compile running (x), 1 of 4 images",
                                                 "host load up to 4.5 on 2 cores, 3 of 4 images"]


def test_engine_and_load_marks():
    status = [{"engine": "mine", "pending": 1, "buckets": [{"mode": "eager", "size": "64x64", "state": "warm"}]},
              {"engine": "other", "pending": 2, "buckets": [{"mode": "compile", "size": "64x64",
                                                             "state": "compiling"}]}]
    marks = paired.engine_marks(status, own_engines=["mine"])
    assert marks == ["compile running (other compile:64x64)", "another engine's work (other)"]
    # the scheduler's word for the same compile is the same mark, spelt once (cards showed both spellings)
    both = paired.engine_marks(status, own_engines=["mine"],
                               compiles={"running": [{"engine": "other", "bucket": "compile:64x64"}]})
    assert both == marks
    assert paired.engine_marks(status[:1], own_engines=["mine"]) == []
    assert paired.load_marks(3.5, 2) == ["host load 3.5 on 2 cores"]
    assert paired.load_marks(1.5, 2) == []


def test_a_configuration_that_fails_is_left_out_and_the_others_are_timed():
    def warm(label):
        if label == "broken":
            raise RuntimeError("step cache first-block cannot run in mode compile\ntraceback...")

    plan = PairedTiming(["ref", "broken", "a"], reference="ref", min_rounds=3, max_rounds=3)
    measure_round_robin(plan, time_one=lambda label, r: 100.0 if label == "ref" else 25.0, warm=warm)
    assert plan.warm["broken"]["error"] == "RuntimeError: step cache first-block cannot run in mode compile"
    assert plan.figure("broken").images == 0 and plan.figure("a").speedup == pytest.approx(4.0)


def _figures(**speedups):
    plan = PairedTiming(list(speedups), reference="eager/fp32", min_rounds=3, max_rounds=3)
    measure_round_robin(plan, time_one=lambda label, r: 100.0 / speedups[label])
    return {label: f.as_dict() for label, f in plan.figures().items()}


def test_the_repeatability_bench_compares_both_runs_and_the_ranking():
    from bench import repeat

    first = _figures(**{"eager/fp32": 1.0, "compile/fp32": 1.6, "eager/bf16": 1.2, "regional/fp32": 1.4})
    steady = _figures(**{"eager/fp32": 1.0, "compile/fp32": 1.7, "eager/bf16": 1.15, "regional/fp32": 1.35})
    c = repeat.compare_runs(first, steady)
    assert c["same_ranking"] and c["all_within"]
    assert c["ranking_first"] == ["compile/fp32", "regional/fp32", "eager/bf16"]
    flipped = _figures(**{"eager/fp32": 1.0, "compile/fp32": 1.1, "eager/bf16": 1.2, "regional/fp32": 1.4})
    c = repeat.compare_runs(first, flipped)
    assert not c["same_ranking"] and not c["all_within"] and not c["ranking_held_but_ties"]
    assert c["swapped"] == ["compile/fp32 / regional/fp32", "compile/fp32 / eager/bf16"]
    row = next(r for r in c["rows"] if r["label"] == "compile/fp32")
    assert row["ratio"] == pytest.approx(1.1 / 1.6) and not row["within"]
    report = {"preset": "tiny-shapes", "device": "cpu", "size": "64x64", "steps": 8, "threads": 1,
              "load_before": [0.5, 0.4, 0.3], "load_after": [0.6, 0.4, 0.3], "comparison": c,
              "runs": [{"rounds": 3, "stop_reason": "spread known", "elapsed_s": 4.0,
                        "warm": {"compile/fp32": {"compile_s": 12.0, "warmup_s": 0.2}}}] * 2}
    text = repeat.markdown(report)
    assert "| compile/fp32 | 1.60× (1.60–1.60, 3 images) | 1.10× (1.10–1.10, 3 images) | 0.69 | NO |" in text
    assert "Same ranking: NO (swapped: compile/fp32 / regional/fp32; compile/fp32 / eager/bf16; held apart from " \
        "ties: NO)" in text and "compile/fp32 12.0 s compile + 0.20 s warm-up" in text


def test_a_swap_between_overlapping_ranges_is_a_tie_not_a_changed_ranking():
    from bench import repeat

    def fig(speedup, low, high):
        return {"speedup": speedup, "iqr": [low, high]}

    first = {"eager/fp32": fig(1.0, 1.0, 1.0), "a": fig(1.09, 0.98, 1.17), "b": fig(1.07, 0.97, 1.11)}
    second = {"eager/fp32": fig(1.0, 1.0, 1.0), "a": fig(1.05, 1.01, 1.15), "b": fig(1.10, 0.94, 1.22)}
    c = repeat.compare_runs(first, second)
    assert not c["same_ranking"] and c["ranking_held_but_ties"] and c["swapped"] == ["a / b (a tie: ranges overlap)"]
