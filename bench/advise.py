"""The advisor: measure the configurations this engine can run here and name the fastest one within a
quality bound (`python -m bench advise`, the UI's Advisor tab).

The grid is precision x mode x step cache x attention backend (parallel layouts where ranks exist),
measured in this process on the bench's runner machinery (one runner per precision and attention
backend, weights loaded once each). What cannot run here is skipped with the reason; what would not fit
the time budget is skipped and said so. Eager configurations go first (no compile), then compiled modes
for the most promising precisions while the budget lasts.

Per configuration: seconds per image (median of a few timed images), drift of every quality sample
against eager fp32 without a step cache at the same prompts and seeds (PSNR, max pixel difference) and,
for a model with a pixel checker, fidelity (bench/quality.py, the bench's own code). A configuration
that times faster than the reference, and could still be the pick, has its quality checked right away, and
one is timed only while its quality check and the final round still fit the budget after it: the checks
get their share of the budget instead of what the scan leaves. The pick is the fastest configuration
within the bound; a step cache is picked only where it measured faster than the same configuration
without it. Finally the pick and the reference are timed again, interleaved, so the printed speedup
compares medians taken side by side. A budget too short to check any faster configuration names no pick
and the budget that would reach one (never the reference for lack of time).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import flags, quality
from bench.advise_choice import (
    CHECKER_MIN_PSNR,
    DEFAULT_FIDELITY_POINTS,
    DEFAULT_MIN_PSNR,
    FINALISTS,
    MIN_FINAL_ROUNDS,
    AdvisePlan,
    Candidate,
    Measured,
    apply_final_round,
    choose,
    final_entries,
    final_summary,
    plan_grid,
    scan_rank,
    short_budget,
    within_bound,
)
from bench.advise_report import ABSENT, REFERENCE, markdown, memory_frontier
from bench.paired import PairedTiming, current_marks, measure_round_robin
from engine.config.flags import from_args
from engine.metrics import median
from engine.protocol import BucketKey, BucketState, GenerateRequest, Mode, OnCold, Size

log = logging.getLogger(__name__)


def result_path(cache_dir: Path, preset: str, device: str, size, steps: int) -> Path:
    """Where a run's results live: one file per device, preset, size and steps."""
    return Path(cache_dir) / "advisor" / f"{preset.replace('/', '--')}@{device}-{size}-{steps}steps.json"


def edit_inputs(preset, mode: Mode, source) -> dict:
    """An edit request's image fields with `source` (PIL, at the output size) as its input image: the fields a
    warm-up at that bucket sends (engine/pipeline/warmup.py), so the advisor's requests run the bucket it warmed."""
    from engine.config.images import synthetic_inputs
    from engine.protocol.requests import PixelImage

    size = Size(source.width, source.height)
    fields = synthetic_inputs(preset, BucketKey(mode, size, refs=(size,) if preset.inputs.in_sequence else ()))
    return {**fields, "images": (PixelImage.from_pil(source.convert("RGB")),)}


# -- measuring --------------------------------------------------------------------------------------
class _Runners:
    """One runner per (precision, attention backend): weights load once each."""

    def __init__(self, plan: AdvisePlan, spec):
        self.plan, self.spec, self.runners = plan, spec, {}

    def get(self, c: Candidate):
        from bench.measure import build_runner
        from bench.modes import MODE_TABLE
        from engine import devices
        from engine.pipeline import attention

        key = (c.precision, c.attention, c.memory)
        if key not in self.runners:
            plan = dataclasses.replace(self.plan, options=dataclasses.replace(
                self.plan.options, attention_backend=c.attention, memory=c.memory))
            runner = build_runner(plan, self.spec, c.precision, MODE_TABLE["eager"])
            runner.load()
            self.runners[key] = runner
        runner = self.runners[key]
        devices.apply_precision(runner.precision)
        attention.activate(c.attention)  # process-wide in diffusers: else a native runner ran the last one loaded
        return runner


SLOWER_THAN_REFERENCE = 1.25  # after two timed images this much slower than eager fp32: not timed further
RECENT_REF_IMAGES = 5  # the reference's latest images: how loaded the host is now (Measurements.slowdown)
DEFAULT_COMPILE_ESTIMATE_S = 30.0  # before any compile has been measured
REF_KEY = tuple(REFERENCE.values())


def config_key(c: Candidate) -> tuple:
    """(precision, mode, step_cache, attention, lora_fused[, memory]): how measurements are filed."""
    return (c.precision, c.mode, c.step_cache, c.attention, c.lora_fused) + ((c.memory,) if c.memory else ())


class PeakAdded:
    """The most memory one generate added on the device (its peak less what was in use as it began): beside
    the runner's weights, a configuration's peak as if its engine ran alone (the advisor's process holds
    several runners, so the device's own peak would count them all)."""

    def __init__(self, spec):
        self.spec, self.most, self._before = spec, None, None

    def __enter__(self):
        self.spec.reset_peak_memory()
        self._before = self.spec.peak_memory_bytes()

    def __exit__(self, *exc):
        peak = self.spec.peak_memory_bytes()
        if peak is not None and self._before is not None:
            self.most = max(self.most or 0, peak - self._before)


class Measurements:
    """What an advisor run knows so far (each configuration measured, the longest compile per mode, the modes
    already compiled) and what it prices from it: seconds per image, speedups, what timing or checking a
    configuration costs, and what the scan keeps in reserve for the final round. `prompts`: how many quality
    samples a check draws."""

    def __init__(self, plan: AdvisePlan, prompts: int):
        self.plan, self.prompts = plan, prompts
        self.measured: dict[tuple, Measured] = {}  # config_key -> measurement, in the order measured
        self.compiles: dict[str, float] = {}  # mode -> the longest compile measured for it
        self.warm_modes: set[tuple] = set()

    def seconds(self, k: tuple) -> float | None:
        """Seconds per image of a measured configuration, in the reference's terms where it was timed beside
        it (the reference's median ÷ the paired speedup): load that came and went during the scan then does
        not reorder it (under a load of 8 on 2 cores, int8 eager read fastest and its compiles went first)."""
        m = self.measured.get(k)
        if m is None or m.error:
            return None
        ref = self.measured.get(REF_KEY)
        if m is not ref and m.paired_speedup and ref is not None and ref.s_per_image:
            return ref.s_per_image / m.paired_speedup
        return m.s_per_image

    def speedup(self, m: Measured) -> float | None:
        ref = self.measured.get(REF_KEY)
        if m.paired_speedup:
            return m.paired_speedup
        return ref.s_per_image / m.s_per_image if ref and ref.s_per_image and m.s_per_image else None

    def estimate_s(self, c: Candidate) -> float:
        """Seconds per image of `c`, before it is measured: its nearest measured relative's."""
        for k in (config_key(c), (c.precision, c.mode, "none", "native", False),
                  (c.precision, "eager", "none", "native", False), REF_KEY):
            if self.seconds(k):
                return self.seconds(k)
        return 1.0

    def needs_compile(self, c: Candidate) -> bool:
        return c.mode != "eager" and (c.precision, c.attention, c.mode) not in self.warm_modes

    def cost_s(self, c: Candidate) -> float:
        """About how long timing `c` takes (its images, the reference's beside them, its compile) and then
        checking its quality."""
        images = (1 + self.plan.timing_images) * self.estimate_s(c) \
            + self.plan.timing_images * (self.seconds(REF_KEY) or 0.0)
        compile_s = self.compiles.get(c.mode) or max(self.compiles.values(), default=DEFAULT_COMPILE_ESTIMATE_S)
        return images * 1.2 + (compile_s if self.needs_compile(c) else 0.0) \
            + self.prompts * self.estimate_s(c) * 1.2

    def score_s(self, m: Measured) -> float:
        """About how long checking `m`'s quality takes."""
        return self.prompts * (self.seconds(config_key(m.candidate)) or self.estimate_s(m.candidate)) * 1.2

    def fastest_s(self) -> float | None:
        """The fastest seconds per image measured, in the reference's terms (Measurements.seconds)."""
        times = [self.seconds(k) for k in self.measured]
        return min((t for t in times if t), default=None)

    def final_round_s(self) -> float:
        """The final round: an untimed image of each entry, then confirm_pairs rounds, at the host's load now
        (Measurements.slowdown)."""
        fastest = self.fastest_s()
        if not fastest:
            return 0.0
        return (self.plan.confirm_pairs + 1) * ((self.seconds(REF_KEY) or 0.0) + FINALISTS * fastest) \
            * self.slowdown()

    def reserve(self) -> float:
        """Kept free while scanning: the final round, and one more quality check at the fastest speed so far
        (the configuration now timed checks its own within its cost), both at the host's load now. What the
        scan times next is priced at the speeds measured, so a heavy spell costs it one configuration's
        overrun, not every compile (priced at the spell's load, each was cut)."""
        fastest = self.fastest_s()
        return self.prompts * fastest * 1.2 * self.slowdown() + self.final_round_s() if fastest else 0.0

    def slowdown(self) -> float:
        """How many times slower images run now than when the reference was first timed (at least 1): its
        latest images, each timed beside another configuration's, against its first median. The reserve scales
        by it, so a load that arrives mid-scan still leaves the final round its rounds."""
        ref = self.measured.get(REF_KEY)
        recent = [ms for m in reversed(self.measured.values()) for ms in reversed(m.ref_ms)][:RECENT_REF_IMAGES]
        if ref is None or not ref.s_per_image or not recent:
            return 1.0
        return max(1.0, median(recent) / 1000 / ref.s_per_image)



class Advisor:
    """One advisor run: plan the grid, time each configuration (the reference first), measure the quality
    of the fastest, then the verdict (choose, final round). Its state is the measurements so far."""

    def __init__(self, plan: AdvisePlan, on_progress: Callable[[int, int, str], None] | None = None,
                 cancelled: Callable[[], bool] | None = None, *, clock: Callable[[], float] | None = None,
                 runners=None):
        """`clock` and `runners` (an object with `get(candidate)` -> a runner) stand in for the real ones in
        tests: the budget is then counted on the fake clock."""
        from engine import devices

        self.plan, self.on_progress, self.is_cancelled = plan, on_progress, cancelled
        self.clock = clock or time.perf_counter
        self.started = plan.started or self.clock()
        self.deadline = self.started + plan.max_minutes * 60
        self.spec = devices.resolve_device(plan.device)
        devices.apply_environment(self.spec, plan.cache_dir)
        import diffusers  # noqa: F401 - after the cache environment (see bench/pipeline.py)

        self.grid, self.skipped = plan_grid(plan, self.spec)
        if plan.preset.inputs.takes_images:  # every request edits a source: the quality samples' own
            self.prompts = quality.sample_edits(plan.preset, plan.quality_samples, seed=quality.PROMPT_SEED,
                                                fallback=plan.prompt, size=plan.size)
        else:
            self.prompts = quality.sample_prompts(plan.preset, plan.quality_samples, seed=quality.PROMPT_SEED,
                                                  fallback=plan.prompt)
        # what the timed images draw: the prompt, or the first sample's edit (an edit needs its source)
        self.timed = self.prompts[0] if plan.preset.inputs.takes_images and self.prompts else plan.prompt
        self.seeds = quality.image_seeds(len(self.prompts))
        self.runners = runners or _Runners(plan, self.spec)
        self.needed_s: dict[str, float] = {}  # cut for the budget: label -> the run length that fits it
        self.known = Measurements(plan, len(self.prompts))
        self.ref_images: list | None = None

    # -- the run, phase by phase
    def run(self) -> dict:
        self.scan()
        self.score_fastest()
        rows = [m.as_dict() for m in self.known.measured.values()]
        pick, rows = choose(rows, self.plan)
        short = short_budget(pick, self.needed_s, self.plan.max_minutes)
        confirm = None
        if short is not None:
            pick = None  # the reference only because nothing faster could be checked in time: no pick
        elif pick is not None and not self.cancelled():
            pick, confirm = self.final_round(rows)
        self.progress("done", finished=True)
        return {**self.report(pick, confirm, rows), "short_budget": short}

    def scan(self) -> None:
        """The speed of every configuration, in scan_rank's order, while the budget lasts."""
        pending = list(self.grid)
        while pending:
            ranked = [(scan_rank(c, self.known.seconds), i, c) for i, c in enumerate(pending)]
            ready = [r for r in ranked if r[0] is not None]
            if not ready:  # what is left builds on configurations that failed or were not measured
                for c in pending:
                    self.skip(c, "the configuration it builds on (same precision, mode eager or without a cache) "
                                 "failed or was not measured")
                return
            _, index, c = min(ready, key=lambda r: (r[0], r[1]))
            pending.pop(index)
            self.scan_one(c)

    def scan_one(self, c: Candidate) -> None:
        if self.cancelled():
            return self.skip(c, "cancelled")
        cost = self.known.cost_s(c)
        if self.known.measured and self.clock() + cost + self.known.reserve() > self.deadline:
            self.needed_s.setdefault(c.label(), self.elapsed() + cost + self.known.reserve())
            return self.skip(c, f"time budget ({self.plan.max_minutes:g} min): about {cost:.0f} s more"
                                f"{' with its compile' if self.known.needs_compile(c) else ''} and its quality check")
        self.progress(c.label() + (" (compiling)" if self.known.needs_compile(c) else ""))
        m = self.known.measured[config_key(c)] = Measured(c)
        self.attempt(self.time_it, c, m)
        if not m.error:
            self.score_if_contender(m)

    def score_if_contender(self, m: Measured) -> None:
        """The reference's pictures at once (every drift compares with them); another configuration's
        quality as soon as it is timed, if it could still be the pick."""
        if config_key(m.candidate) == REF_KEY:
            return self.attempt(self.score_it, m.candidate, m)
        ref = self.known.measured.get(REF_KEY)
        if ref is None or not ref.scored or ref.error or not self.known.speedup(m):
            return
        m.unscored = self.unscored_reason(m)
        if m.unscored is None:
            self.progress(f"quality of {m.candidate.label()} ({self.known.speedup(m):.2f}× eager fp32)")
            self.attempt(self.score_it, m.candidate, m)
        elif m.unscored.startswith("time budget"):
            self.needed_s.setdefault(m.candidate.label(), self.elapsed() + self.known.score_s(m) + self.known.final_round_s())

    def score_fastest(self) -> None:
        """After the scan: quality, fastest first, of what is faster than the reference and was not checked
        yet (what the scan's reserve leaves), until FINALISTS are within the bound."""
        ref = self.known.measured.get(REF_KEY)
        if ref is None or not ref.scored or ref.error:
            return
        for m in sorted((m for m in self.known.measured.values() if self.known.speedup(m) and not m.error and not m.scored),
                        key=self.known.speedup, reverse=True):
            m.unscored = self.unscored_reason(m)
            if m.unscored is None:
                self.needed_s.pop(m.candidate.label(), None)
                self.progress(f"quality of {m.candidate.label()} ({self.known.speedup(m):.2f}× eager fp32)")
                self.attempt(self.score_it, m.candidate, m)

    def within_faster(self, m: Measured) -> int:
        """How many configurations already checked within the bound are faster than `m`."""
        ref_row = self.known.measured[REF_KEY].as_dict()
        return sum(1 for o in self.known.measured.values() if o is not m and o.scored and not o.error
                   and (self.known.speedup(o) or 0) > (self.known.speedup(m) or 0)
                   and within_bound(o.as_dict(), ref_row, self.plan)[0])

    def unscored_reason(self, m: Measured) -> str | None:
        """Why `m`'s quality is not worth measuring (None: measure it)."""
        c = m.candidate
        base = self.known.measured.get((c.precision, c.mode, "none", c.attention, c.lora_fused))
        if self.known.speedup(m) <= 1.0:
            return "no faster than eager fp32: quality not measured"
        if self.within_faster(m) >= FINALISTS:
            return f"slower than {FINALISTS} configurations within the bound: quality not measured"
        if c.step_cache != "none" and base is not None and self.known.speedup(base) \
                and self.known.speedup(m) <= self.known.speedup(base):
            return f"the step cache measured no faster than {base.candidate.label()}"
        if self.cancelled():
            return "cancelled"
        if self.clock() + self.known.score_s(m) + self.known.final_round_s() > self.deadline:
            return f"time budget ({self.plan.max_minutes:g} min): quality not measured"
        return None

    def final_round(self, rows: list[dict]) -> tuple[dict | None, dict]:
        # A shared machine's load moves one configuration's timings and not another's: the leaders are
        # timed again round-robin with the reference, and the pick and its speedup come from those rounds.
        leaders = sorted((r for r in rows if r["eligible"]), key=lambda r: -r["speedup"])[:FINALISTS]
        self.progress(f"final round: {', '.join(r['label'] for r in leaders)} against eager fp32")
        confirm = final_summary(self.time_final_round(leaders, rows), leaders)
        return apply_final_round(rows, confirm), confirm

    def time_final_round(self, leaders: list[dict], rows: list[dict]) -> PairedTiming:
        """The leaders (and their configurations without a cache) and the reference timed again, round-robin
        (the starting one rotates each round). Rounds past the deadline are dropped (MIN_FINAL_ROUNDS are
        always run)."""
        entries = {c.label(): c for c in final_entries(leaders, rows)}
        # One untimed image each first: whatever one of them pays once after the others ran (a graph that
        # recompiles, caches refilled) stays out of the timed rounds.
        for c in entries.values():
            self.image_ms(c, 499)
        plan = self.plan
        timing = PairedTiming(list(entries), reference=Candidate(**REFERENCE).label(),
                              min_rounds=min(MIN_FINAL_ROUNDS, plan.confirm_pairs), max_rounds=max(plan.confirm_pairs, 1),
                              budget_s=max(0.0, self.deadline - self.clock()))
        measure_round_robin(timing, lambda label, i: self.image_ms(entries[label], 500 + i), marks=current_marks,
                            clock=self.clock)
        return timing

    def report(self, pick: dict | None, confirm: dict | None, rows: list[dict]) -> dict:
        plan = self.plan
        return {
            "preset": plan.preset.name, "device": self.spec.name, "size": str(plan.size), "steps": plan.steps,
            "bound": {"fidelity_points": plan.fidelity_points, "min_psnr_db": plan.psnr_bound(),
                      "min_ssim": plan.min_ssim, "max_memory_bytes": plan.max_memory_bytes},
            "quality_samples": len(self.prompts), "timing_images": plan.timing_images,
            "reference": REFERENCE, "lora": plan.lora.text(), "pick": pick, "confirm": confirm, "rows": rows,
            "memory_frontier": [r["label"] for r in memory_frontier({"rows": rows})],
            "skipped": self.skipped,
            "elapsed_s": self.elapsed(), "max_minutes": plan.max_minutes,
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }

    # -- measuring one configuration
    def time_it(self, c: Candidate, m: Measured) -> None:
        runner = self.runners.get(c)
        runner.check_mode(Mode(c.mode))
        if self.known.needs_compile(c):
            self.compile(c, m, runner)
        # A warm-up image first (first calls at the shape, the allocator, the cache's hooks and calibration),
        # so the timed images measure the configuration's steady state.
        runner.generate(self.request(c, self.timed, 99))
        reference = Candidate(**REFERENCE) if config_key(c) != REF_KEY else None
        cached = []
        added = PeakAdded(self.spec)
        for i in range(self.plan.timing_images):
            # Each image next to one of the reference's, in alternating order: a shared machine's load
            # drifts over a scan and would otherwise favour whichever configuration ran in a quiet spell.
            if reference and i % 2 == 0:
                m.ref_ms.append(self.image_ms(reference, 100 + i))
            marks = current_marks()
            with added:
                res = self.runners.get(c).generate(self.request(c, self.timed, 100 + i))
            m.image_ms.append(res.timings.total_ms)
            m.marks = list(dict.fromkeys([*m.marks, *marks, *current_marks()]))
            cached.append(len(getattr(res, "cached_steps", ()) or ()))
            if reference and i % 2 == 1:
                m.ref_ms.append(self.image_ms(reference, 100 + i))
            if reference and i == 1 and m.paired_speedup < 1 / SLOWER_THAN_REFERENCE:
                m.note = f"{m.paired_speedup:.2f}× eager fp32 over 2 pairs: not timed further"
                break
        m.cached_steps = sum(cached) / len(cached) if cached else None
        m.peak_bytes = runner.weights_bytes() + added.most if added.most is not None else None

    def compile(self, c: Candidate, m: Measured, runner) -> None:
        t0 = self.clock()
        info = runner.warm_bucket(self.request(c, self.timed, 0).bucket)  # an edit's has its reference's size
        if info.state != BucketState.WARM:
            raise RuntimeError(info.error or f"bucket is {info.state.value}")
        m.compile_s = self.clock() - t0
        self.known.compiles[c.mode] = max(self.known.compiles.get(c.mode, 0.0), m.compile_s)
        self.known.warm_modes.add((c.precision, c.attention, c.mode))

    def image_ms(self, c: Candidate, seed: int) -> float:
        return self.runners.get(c).generate(self.request(c, self.timed, seed)).timings.total_ms

    def score_it(self, c: Candidate, m: Measured) -> None:
        runner = self.runners.get(c)
        images = [runner.generate(self.request(c, p, s)).image_png
                  for p, s in zip(self.prompts, self.seeds, strict=True)]
        is_ref = config_key(c) == REF_KEY
        if is_ref:
            self.ref_images = images
        ref_images = self.ref_images
        row = quality.score(images, self.prompts, None if is_ref else ref_images, self.plan.preset, self.plan.style)
        m.drift_psnr_db, m.drift_max_diff, m.drift_ssim = row["drift_psnr_db"], row["drift_max_diff"], row["drift_ssim"]
        worst = 0 if is_ref else quality.worst_sample(images, ref_images)
        m.picture = quality.png_b64(images[worst])
        if not is_ref:
            m.diff_picture = quality.png_b64(quality.diff_heatmap(images[worst], ref_images[worst]))
            m.reference_picture = quality.png_b64(ref_images[worst])
        m.fidelity = row.get("fidelity")
        m.scored = True

    def attempt(self, step: Callable[[Candidate, Measured], None], c: Candidate, m: Measured) -> None:
        try:
            step(c, m)
        except Exception as exc:  # one configuration failing must not end the run
            log.warning("%s failed: %s", c.label(), exc)
            m.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def request(self, c: Candidate, sample, seed: int, steps: int | None = None) -> GenerateRequest:
        """`sample`: a prompt, or an EditSample (its instruction and its source as the input image)."""
        cache = {"step_cache": c.step_cache} if c.step_cache != "none" else {}
        plan = self.plan
        prompt, inputs = sample, {}
        if isinstance(sample, quality.EditSample):
            prompt, inputs = sample.prompt, edit_inputs(plan.preset, Mode(c.mode), sample.source)
        return GenerateRequest.checked(prompt=prompt, width=plan.size.width, height=plan.size.height,
                               steps=steps or plan.steps, guidance=plan.preset.guidance, seed=seed,
                               mode=Mode(c.mode), on_cold=OnCold.EAGER,
                               lora=dataclasses.replace(plan.lora, fused=c.lora_fused), **cache, **inputs)

    # -- bookkeeping
    def elapsed(self) -> float:
        return self.clock() - self.started

    def cancelled(self) -> bool:
        return bool(self.is_cancelled and self.is_cancelled())

    def skip(self, c: Candidate, why: str) -> None:
        self.skipped.append({"what": c.label(), "why": why})

    def progress(self, desc: str, finished: bool = False) -> None:
        """Seconds of the budget used (out of the budget): it moves with every configuration, whatever is
        skipped at the end; the text counts what was timed and checked."""
        if not self.on_progress:
            return
        budget = max(1, round(self.plan.max_minutes * 60))
        timed = sum(1 for m in self.known.measured.values() if m.image_ms)
        checked = sum(1 for m in self.known.measured.values() if m.scored)
        done = budget if finished else min(budget - 1, max(0, round(self.elapsed())))
        self.on_progress(done, budget, f"{desc} · {timed} timed, {checked} quality-checked")


def advise(plan: AdvisePlan, on_progress: Callable[[int, int, str], None] | None = None,
           cancelled: Callable[[], bool] | None = None) -> dict:
    """Measure the grid within plan.max_minutes and pick; the report (JSON-ready).

    Speed first: every configuration is timed (a warm-up image, then plan.timing_images), in scan_rank's
    order while the budget lasts. Quality (plan.quality_samples images each) is then measured for the
    reference and, fastest first, for the configurations faster than it, until FINALISTS are within the
    bound: a configuration slower than one already within the bound can never be the pick, so its quality
    is not measured (it says so). Last, the final round times the finalists against the reference."""
    return Advisor(plan, on_progress, cancelled).run()


def save(report: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    return path


def load_pick(path: Path) -> dict:
    """The configuration an advisor file names (precision, mode, step_cache, attention, and the preset,
    device, size and steps it was measured for); ValueError when the file names none."""
    from engine.config.validation import advice_pick, read_json_file

    pick = advice_pick(read_json_file(path, str(path)), str(path))
    return {**{k: pick.get(k, ABSENT.get(k)) for k in REFERENCE}, "preset": pick["preset"], "device": pick["device"],
            "size": pick["size"], "steps": pick["steps"], "lora": pick["lora"]}


def serving_threads(spec) -> int | None:
    """The CPU threads the app's worker for this device gets (None: not the host's CPU). Timed with torch's
    default of one per core instead, a busy machine's OpenMP waits for a descheduled thread inflate eager
    images many times over and not the app's."""
    if not spec.host_memory_is_device_memory:
        return None
    from engine.serving.manager import cpu_worker_threads

    return cpu_worker_threads(spec.max_engines)


# -- the CLI sub-command ----------------------------------------------------------------------------
def cmd_advise(args) -> int:
    import sys

    from engine import devices, settings
    from engine.config.flags import model_roots_from_args, options_from_args
    from engine.config.presets import get_preset, route_size
    from engine.config.validation import check_lora

    started = time.perf_counter()  # the budget covers loading torch too
    opts = from_args(AdviseOptions, args)
    preset = get_preset(opts.preset)
    spec = devices.resolve_device(opts.device)
    size = Size.parse(opts.size) if opts.size else preset.buckets[0]
    route_size(preset, size.width, size.height, snap=False)  # must be one of the buckets
    threads = opts.threads or serving_threads(spec)
    if threads:
        import torch

        torch.set_num_threads(threads)
    cache_dir = Path(args.cache_dir) if args.cache_dir else settings.cache_dir()
    lora = check_lora(preset, opts.lora)  # unfused: the fused configurations are added to the grid
    if lora.fused:
        raise SystemExit("--lora: name the style without ':fused'; the advisor measures it unfused and fused")
    plan = AdvisePlan(
        preset=preset, device=spec.name, size=size, steps=opts.steps or preset.steps, max_minutes=opts.max_minutes,
        timing_images=opts.timing_images, quality_samples=opts.quality_samples, confirm_pairs=opts.confirm_pairs,
        fidelity_points=opts.fidelity_points, min_psnr_db=opts.min_psnr, min_ssim=opts.min_ssim, cache_dir=cache_dir,
        options=options_from_args(args, warm_sizes=(), warm_modes=(), **({"loras": True} if lora.name else {})),
        allowed_roots=tuple(str(r) for r in model_roots_from_args(args)), prompt=preset.example_prompt,
        started=started, lora=lora, **memory_plan(opts),
    )

    def on_progress(done: int, total: int, desc: str) -> None:
        if opts.progress_json:
            print(json.dumps({"progress": done, "total": total, "desc": desc}), flush=True)
        else:
            print(f"[{done}/{total} s] {desc}", file=sys.stderr, flush=True)

    report = advise(plan, on_progress)
    report["threads"] = threads
    path = save(report, opts.out or result_path(cache_dir, preset.name, spec.name, size, plan.steps))
    report["saved"] = str(path)
    if opts.progress_json:
        print(json.dumps({"result": report}), flush=True)
    else:
        print(markdown(report))
        print(f"wrote {path}", file=sys.stderr)
    return 0 if report["pick"] else 1


# Lever sets measured when --max-memory names a bound and --memory-levers none (those a device cannot run
# are listed as skipped, with the reason).
DEFAULT_LEVER_SETS = ("layerwise:fp8", "group:block:1", "model-offload", "sequential-offload")


def memory_plan(opts: AdviseOptions) -> dict:
    """AdvisePlan's memory fields from --max-memory and --memory-levers."""
    from engine.serving.budget import parse_size

    bound = parse_size(opts.max_memory) if opts.max_memory else None
    sets = tuple(s.strip() for s in (opts.memory_levers or "").split(";") if s.strip())
    return {"max_memory_bytes": bound, "memory_levers": sets or (DEFAULT_LEVER_SETS if bound else ())}


@dataclass(frozen=True)
class AdviseOptions:
    """`advise`'s flags (the engine flags follow them)."""

    preset: str = flags.preset("tiny-shapes")
    device: str = flags.device("auto")
    size: str | None = flags.size(None, "WxH bucket (default: the preset's first)")
    steps: int | None = flags.steps(None, "default: the preset's")
    max_minutes: float = flags.number(5.0, 0.0, flags.MAX_SECONDS / 60, "time budget; what does not fit is skipped")
    timing_images: int = flags.count(5, "timed images per configuration (median)")
    quality_samples: int = flags.count(16, "fidelity prompts (a model with a checker) / drift samples per "
                                           "configuration")
    confirm_pairs: int = flags.count(8, "final round: the leaders and eager fp32 timed this many times each, "
                                        "round-robin")
    fidelity_points: float = flags.number(DEFAULT_FIDELITY_POINTS, 0.0, 100.0, "bound: fidelity at most this many "
                                          "points below eager fp32 (models with a checker)")
    min_psnr: float | None = flags.number(None, 0.0, 1000.0, f"bound: drift PSNR against eager fp32 (default "
                                          f"{DEFAULT_MIN_PSNR:g} dB, {CHECKER_MIN_PSNR:g} dB on models with a "
                                          "checker, beside --fidelity-points)")
    min_ssim: float | None = flags.number(None, 0.0, 1.0, "bound: drift SSIM against eager fp32 (0-1; default off: "
                                                          "PSNR and fidelity bound)")
    out: Path | None = flags.out(None, "results JSON (default: <cache dir>/advisor/<preset>@<device>-<size>-"
                                       "<steps>steps.json)", check=Path)
    progress_json: bool = flags.switch("progress and the result as JSON lines on stdout")
    lora: str | None = flags.text(None, "one of the preset's LoRA styles: every configuration draws with it "
                                        "(fidelity checked as the style implies), and eager also runs it fused into "
                                        "the weights", metavar="NAME[:SCALE]")
    max_memory: str | None = flags.text(None, "pick the fastest configuration whose measured peak (weights + what "
                                              "an image adds) fits, e.g. 16GiB; memory lever sets are measured too",
                                        metavar="SIZE")
    memory_levers: str | None = flags.text(None, "memory lever sets to measure (fp32 eager), separated by ';', e.g. "
                                                 "'layerwise:fp8;group:block:1:disk' (default with --max-memory: "
                                                 f"{'; '.join(DEFAULT_LEVER_SETS)})", metavar="SETS")
    threads: int | None = flags.threads("torch CPU threads (default on a CPU: the app's per-worker share of the "
                                        "cores)")


def add_advise_parser(subparsers):
    """Register `advise` on the CLI's subparsers (bench/commands.py calls this); imports no torch."""
    return flags.add_command(subparsers, "advise", AdviseOptions, cmd_advise, engine=True,
                             description=__doc__.split("\n\n")[0],
                             help="measure precision x mode x step cache x attention here; pick the fastest within "
                                  "a quality bound")
