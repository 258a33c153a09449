"""The advisor: measure the configurations this engine can run here and name the fastest one within a
quality bound (`python -m engine advise`, the UI's Advisor tab).

The grid is precision x mode x step cache x attention backend (parallel layouts where ranks exist),
measured in this process on the bench's runner machinery (one runner per precision and attention
backend, weights loaded once each). What cannot run here is skipped with the reason; what would not fit
the time budget is skipped and said so. Eager configurations go first (no compile), then compiled modes
for the most promising precisions while the budget lasts.

Per configuration: seconds per image (median of a few timed images), drift of every quality sample
against eager fp32 without a step cache at the same prompts and seeds (PSNR, max pixel difference) and,
for a model with a pixel checker, fidelity (engine/bench/quality.py, the bench's own code). The pick is
the fastest configuration within the bound; a step cache is picked only where it measured faster than
the same configuration without it. Finally the pick and the reference are timed again, interleaved, so
the printed speedup compares medians taken side by side.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.bench import quality
from engine.bench.paired import PairedTiming, current_marks, measure_round_robin, row_speedup_text
from engine.metrics import median

log = logging.getLogger(__name__)

REFERENCE = {"precision": "fp32", "mode": "eager", "step_cache": "none", "attention": "native"}
MODES = ("eager", "regional", "compile")  # aot and defer-and-fuse: same graphs as compile, slower to build
DEFAULT_FIDELITY_POINTS = 2.0
DEFAULT_MIN_PSNR = 30.0
# On a model with a checker the checker cannot see a moved or blurred object: drift has its own floor there,
# below the worst bf16-vs-fp32 sample measured on tiny-shapes (docs/benchmarks.md, "PSNR floor").
CHECKER_MIN_PSNR = 25.0
FINALISTS = 4  # eligible configurations timed again against the reference at the end


@dataclass
class AdvisePlan:
    preset: object  # ModelPreset
    device: str
    size: object  # Size
    steps: int
    max_minutes: float = 5.0
    timing_images: int = 5
    quality_samples: int = 16  # fidelity prompts (a model with a checker) or drift samples
    confirm_pairs: int = 8
    fidelity_points: float | None = DEFAULT_FIDELITY_POINTS  # the bound on a model with a checker
    min_psnr_db: float | None = None  # None: DEFAULT_MIN_PSNR, or CHECKER_MIN_PSNR on a model with a checker
    min_ssim: float | None = None  # off unless set: SSIM against eager fp32's image of the same prompt and seed
    cache_dir: Path | None = None
    options: object = None  # EngineOptions
    allowed_roots: tuple[str, ...] = ()
    prompt: str = ""
    started: float | None = None  # time.perf_counter() when the run began (default: when advise() is called)

    def psnr_bound(self) -> float | None:
        if self.min_psnr_db is not None:
            return self.min_psnr_db
        return CHECKER_MIN_PSNR if quality.fidelity_checker(self.preset) else DEFAULT_MIN_PSNR


@dataclass
class Candidate:
    precision: str
    mode: str
    step_cache: str = "none"
    attention: str = "native"

    def label(self) -> str:
        parts = [self.precision, self.mode]
        if self.step_cache != "none":
            parts.append(self.step_cache)
        if self.attention != "native":
            parts.append(f"attn={self.attention}")
        return "/".join(parts)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Measured:
    candidate: Candidate
    image_ms: list[float] = field(default_factory=list)
    compile_s: float | None = None
    drift_psnr_db: float | None = None
    drift_max_diff: int | None = None
    drift_ssim: float | None = None
    fidelity: float | None = None
    cached_steps: float | None = None  # mean per image
    ref_ms: list[float] = field(default_factory=list)  # the reference's images, each timed next to one of these
    error: str | None = None
    scored: bool = False  # quality measured
    unscored: str | None = None  # why its quality was not measured
    note: str | None = None
    marks: list[str] = field(default_factory=list)  # what else ran while it was timed (host load)
    picture: str | None = None  # its image of the sample that differs most from eager fp32's (base64 PNG)
    diff_picture: str | None = None  # the heat map of that difference (base64 PNG)
    reference_picture: str | None = None  # eager fp32's image of that sample (base64 PNG)

    @property
    def s_per_image(self) -> float | None:
        return median(self.image_ms) / 1000 if self.image_ms else None

    def timing(self) -> PairedTiming:
        """Its images and the reference's timed next to them, as the shared paired plan."""
        label, ref = self.candidate.label(), Candidate(**REFERENCE).label()
        plan = PairedTiming([ref, label], reference=ref)
        for i, (mine, theirs) in enumerate(zip(self.image_ms, self.ref_ms, strict=False)):
            plan.record(i, label, mine, self.marks)
            plan.record(i, ref, theirs)
        return plan

    @property
    def paired_speedup(self) -> float | None:
        """The median of the reference's time ÷ this one's, over images timed in alternation with the reference's."""
        if not self.ref_ms or not self.image_ms:
            return None
        return self.timing().figure(self.candidate.label()).speedup

    def as_dict(self) -> dict:
        return {**self.candidate.as_dict(), "label": self.candidate.label(), "s_per_image": self.s_per_image,
                "image_ms": [round(x, 3) for x in self.image_ms], "compile_s": self.compile_s,
                "ref_ms": [round(x, 3) for x in self.ref_ms], "paired_speedup": self.paired_speedup,
                "drift_psnr_db": self.drift_psnr_db, "drift_max_diff": self.drift_max_diff,
                "drift_ssim": self.drift_ssim, "marks": list(self.marks), "picture_png": self.picture,
                "diff_png": self.diff_picture, "reference_png": self.reference_picture,
                "speedup_figure": self.timing().figure(self.candidate.label()).as_dict() if self.ref_ms else None,
                "fidelity": self.fidelity, "cached_steps": self.cached_steps, "error": self.error,
                "unscored": self.unscored, "note": self.note}


def result_path(cache_dir: Path, preset: str, device: str, size, steps: int) -> Path:
    """Where a run's results live: one file per device, preset, size and steps."""
    return Path(cache_dir) / "advisor" / f"{preset.replace('/', '--')}@{device}-{size}-{steps}steps.json"


# -- the grid ---------------------------------------------------------------------------------------
def plan_grid(plan: AdvisePlan, spec) -> tuple[list[Candidate], list[dict]]:
    """Every candidate this engine can run here, and what was skipped with why (torch not needed)."""
    from engine.devices import precision_support
    from engine.pipeline.attention import attention_table
    from engine.pipeline.stepcache import available_step_caches
    from engine.protocol import Mode

    skipped: list[dict] = []
    precisions = []
    for name, row in precision_support(spec).items():
        if row["status"] == "refused":
            skipped.append({"what": f"precision {name}", "why": row["reason"]})
        elif row["status"] == "downgraded":
            skipped.append({"what": f"precision {name}", "why": f"runs as {row['runs_as']} here (measured as that)"})
        else:
            precisions.append(str(name))
    modes = []
    for m in MODES:
        if Mode(m) in spec.modes:
            modes.append(m)
        else:
            skipped.append({"what": f"mode {m}", "why": f"{spec.label} does not run it"})
    for m in spec.modes:
        if m.value not in MODES and m.value != "eager":
            skipped.append({"what": f"mode {m.value}", "why": "the same graphs as compile, built slower "
                            "(packages / fused passes): outside the advisor's time budget"})
    grid: list[Candidate] = []
    for precision in precisions:
        for mode in modes:
            for row in available_step_caches(plan.preset, spec, mode):
                if row["usable"]:
                    grid.append(Candidate(precision, mode, row["default"]))
                    if stronger(row["default"]):
                        grid.append(Candidate(precision, mode, stronger(row["default"])))
                elif precision == precisions[0]:
                    skipped.append({"what": f"step cache {row['name']} with {mode}", "why": row["why_not"]})
    for row in attention_table(spec, "fp32"):
        name = row.get("name")
        if name == "native":
            continue
        if row.get("usable"):
            grid.append(Candidate("fp32", "eager", "none", name))
        else:
            skipped.append({"what": f"attention {name}", "why": row.get("reason") or row.get("note") or "unusable"})
    skipped.append({"what": "parallel layouts (tensor/ulysses/ring)",
                    "why": "they run as a torchrun sidecar of several ranks, not in this process; compare them "
                           "on the Compare tab (Tensor-parallel ranks)"})
    return grid, skipped


def stronger(cache: str) -> str | None:
    """The cache with its reuse loosened one notch (threshold doubled, or one step more between full
    computations): faster where it reuses more, and the quality bound decides whether it may."""
    from engine.protocol import StepCache

    c = StepCache.parse(cache)
    if not c.enabled:
        return None
    if c.threshold is not None:
        return str(dataclasses.replace(c, threshold=round(c.threshold * 2, 4)))
    if c.interval is not None:
        return str(dataclasses.replace(c, interval=c.interval + 1))
    return None


def is_default(cache: str) -> bool:
    from engine.protocol import StepCache

    return str(StepCache.parse(cache)) == str(StepCache.parse(cache.split(":")[0]))


def order_grid(grid: list[Candidate]) -> list[Candidate]:
    """The reference first, then eager (no compile), then compiled modes."""
    rank = {m: i for i, m in enumerate(MODES)}
    ref = [c for c in grid if c.as_dict() == REFERENCE]
    rest = [c for c in grid if c.as_dict() != REFERENCE]
    rest.sort(key=lambda c: (rank[c.mode], c.attention != "native", c.step_cache != "none"))
    return ref + rest


# -- choosing ---------------------------------------------------------------------------------------
def within_bound(row: dict, ref: dict, plan: AdvisePlan) -> tuple[bool, str]:
    if row.get("error") or row.get("s_per_image") is None:
        return False, row.get("error") or "not measured"
    if row.get("unscored"):
        return False, row["unscored"]
    if plan.fidelity_points is not None and ref.get("fidelity") is not None:
        if row.get("fidelity") is None or row["fidelity"] < ref["fidelity"] - plan.fidelity_points / 100 - 1e-9:
            return False, (f"fidelity {(row.get('fidelity') or 0) * 100:.0f} % < eager fp32's "
                           f"{ref['fidelity'] * 100:.0f} % - {plan.fidelity_points:g} points")
    bound = plan.psnr_bound()
    if bound is not None and row.get("drift_max_diff"):
        if row.get("drift_psnr_db") is None or row["drift_psnr_db"] < bound:
            return False, f"drift {row.get('drift_psnr_db') or 0:.1f} dB < {bound:g} dB"
    if plan.min_ssim is not None and row.get("drift_max_diff"):
        if row.get("drift_ssim") is None or row["drift_ssim"] < plan.min_ssim:
            return False, f"SSIM {row.get('drift_ssim') or 0:.3f} < {plan.min_ssim:g}"
    return True, ""


def is_reference(row: dict) -> bool:
    return {k: row.get(k) for k in REFERENCE} == REFERENCE


def base_of(row: dict) -> tuple:
    """The key of the same configuration without a step cache."""
    return row["precision"], row["mode"], row["attention"]


def choose(rows: list[dict], plan: AdvisePlan) -> tuple[dict | None, list[dict]]:
    """The fastest row within the bound (rows: Measured.as_dict()), and every row with its verdict.

    Speed is the speedup over eager fp32: timed in alternation with it where measured so (paired_speedup),
    else the ratio of medians. A row with a step cache qualifies only if it measured faster than the same
    configuration without one."""
    ref = next((r for r in rows if {k: r[k] for k in REFERENCE} == REFERENCE and not r.get("error")), None)
    if ref is None:
        return None, rows
    for r in rows:
        r["speedup"] = 1.0 if r is ref else r.get("paired_speedup") or (
            ref["s_per_image"] / r["s_per_image"] if r.get("s_per_image") else None)
    no_cache = {base_of(r): r for r in rows if r["step_cache"] == "none"}
    for r in rows:
        ok, why = within_bound(r, ref, plan)
        if ok and r["step_cache"] != "none":
            base = no_cache.get(base_of(r))
            if base and base.get("speedup") and r["speedup"] <= base["speedup"]:
                ok, why = False, f"the step cache measured no faster than {base['label']}"
        r["eligible"], r["why_not"] = ok, why
    eligible = [r for r in rows if r["eligible"]]
    return (max(eligible, key=lambda r: r["speedup"]) if eligible else None), rows


def scan_rank(c: Candidate, seconds: Callable[[tuple], float | None]) -> tuple | None:
    """Where `c` stands in the scan, from what is measured so far (lower goes first); None: not worth
    measuring (the configuration it builds on failed or was not measured).

    The reference; every precision eagerly; the compiled modes, precisions that measured fastest eagerly
    first; then step caches and attention backends on the configurations that measured fastest first.
    `seconds((precision, mode, step_cache, attention))`: that configuration's s / image, None if unknown."""
    if c.as_dict() == REFERENCE:
        return (0,)
    if c.step_cache == "none" and c.attention == "native":
        if c.mode == "eager":
            return (1,)
        eager = seconds((c.precision, "eager", "none", "native"))
        return None if eager is None else (2, eager, MODES.index(c.mode))
    base = seconds((c.precision, c.mode, "none", "native"))
    loosened = c.step_cache != "none" and not is_default(c.step_cache)
    return None if base is None else (3, base, loosened, c.attention != "native")


# -- measuring --------------------------------------------------------------------------------------
class _Runners:
    """One runner per (precision, attention backend): weights load once each."""

    def __init__(self, plan: AdvisePlan, spec):
        self.plan, self.spec, self.runners = plan, spec, {}

    def get(self, c: Candidate):
        from engine import devices
        from engine.bench.measure import build_runner
        from engine.bench.modes import MODE_TABLE

        key = (c.precision, c.attention)
        if key not in self.runners:
            plan = dataclasses.replace(self.plan, options=dataclasses.replace(
                self.plan.options, attention_backend=c.attention))
            runner = build_runner(plan, self.spec, c.precision, MODE_TABLE["eager"])
            runner.load()
            self.runners[key] = runner
        runner = self.runners[key]
        devices.apply_precision(runner.precision)
        return runner


SLOWER_THAN_REFERENCE = 1.25  # after two timed images this much slower than eager fp32: not timed further
DEFAULT_COMPILE_ESTIMATE_S = 30.0  # before any compile has been measured


def advise(plan: AdvisePlan, on_progress: Callable[[int, int, str], None] | None = None,
           cancelled: Callable[[], bool] | None = None) -> dict:
    """Measure the grid within plan.max_minutes and pick; the report (JSON-ready).

    Speed first: every configuration is timed (a warm-up image, then plan.timing_images), in scan_rank's
    order while the budget lasts. Quality (plan.quality_samples images each) is then measured for the
    reference and, fastest first, for the configurations faster than it, until FINALISTS are within the
    bound: a configuration slower than one already within the bound can never be the pick, so its quality
    is not measured (it says so). Last, the final round times the finalists against the reference."""
    from engine import devices
    from engine.protocol import BucketKey, BucketState, GenerateRequest, Mode, OnCold

    started = plan.started or time.perf_counter()
    deadline = started + plan.max_minutes * 60
    spec = devices.resolve_device(plan.device)
    devices.apply_environment(spec, plan.cache_dir)
    import diffusers  # noqa: F401 - after the cache environment (see engine/bench/pipeline.py)

    grid, skipped = plan_grid(plan, spec)
    prompts = quality.sample_prompts(plan.preset, plan.quality_samples, seed=7, fallback=plan.prompt)
    seeds = [1000 + i for i in range(len(prompts))]
    runners = _Runners(plan, spec)
    total = len(grid) + 2  # the scan, the quality phase, the final round
    done = 0
    report = lambda desc: on_progress and on_progress(done, total, desc)  # noqa: E731
    ref_key = tuple(REFERENCE.values())
    measured: dict[tuple, Measured] = {}  # (precision, mode, step_cache, attention) -> measurement, in order
    compiles: dict[str, float] = {}  # mode -> the longest compile measured for it
    warm_modes: set[tuple] = set()
    ref_images: list | None = None

    def key(c: Candidate) -> tuple:
        return c.precision, c.mode, c.step_cache, c.attention

    def seconds(k: tuple) -> float | None:
        m = measured.get(k)
        return None if m is None or m.error else m.s_per_image

    def speedup(m: Measured) -> float | None:
        ref = measured.get(ref_key)
        if m.paired_speedup:
            return m.paired_speedup
        return ref.s_per_image / m.s_per_image if ref and ref.s_per_image and m.s_per_image else None

    def estimate_s(c: Candidate) -> float:
        """Seconds per image of `c`, before it is measured: its nearest measured relative's."""
        for k in (key(c), (c.precision, c.mode, "none", "native"), (c.precision, "eager", "none", "native"), ref_key):
            if seconds(k):
                return seconds(k)
        return 1.0

    def compile_estimate(c: Candidate) -> float:
        return compiles.get(c.mode) or max(compiles.values(), default=DEFAULT_COMPILE_ESTIMATE_S)

    def needs_compile(c: Candidate) -> bool:
        return c.mode != "eager" and (c.precision, c.attention, c.mode) not in warm_modes

    def final_round_s() -> float:
        times = [m.s_per_image for m in measured.values() if m.s_per_image and not m.error]
        return plan.confirm_pairs * ((seconds(ref_key) or 0.0) + FINALISTS * min(times)) if times else 0.0

    def reserve() -> float:
        """What the quality phase and the final round need at least, at the speeds measured so far."""
        times = [m.s_per_image for m in measured.values() if m.s_per_image and not m.error]
        return 2 * len(prompts) * min(times) + final_round_s() if times else 0.0

    def request(c: Candidate, prompt: str, seed: int, steps: int | None = None) -> GenerateRequest:
        cache = {"step_cache": c.step_cache} if c.step_cache != "none" else {}
        return GenerateRequest(prompt=prompt, width=plan.size.width, height=plan.size.height,
                               steps=steps or plan.steps, guidance=plan.preset.guidance, seed=seed,
                               mode=Mode(c.mode), on_cold=OnCold.EAGER, **cache)

    def time_it(c: Candidate, m: Measured) -> None:
        runner = runners.get(c)
        mode = Mode(c.mode)
        runner.check_mode(mode)
        if needs_compile(c):
            t0 = time.perf_counter()
            info = runner.warm_bucket(BucketKey(mode, plan.size))
            if info.state != BucketState.WARM:
                raise RuntimeError(info.error or f"bucket is {info.state.value}")
            m.compile_s = time.perf_counter() - t0
            compiles[c.mode] = max(compiles.get(c.mode, 0.0), m.compile_s)
            warm_modes.add((c.precision, c.attention, c.mode))
        # A warm-up image first (first calls at the shape, the allocator, the cache's hooks and calibration),
        # so the timed images measure the configuration's steady state.
        runner.generate(request(c, plan.prompt, 99))
        reference = Candidate(**REFERENCE) if key(c) != ref_key else None

        def ref_image(seed: int) -> None:
            m.ref_ms.append(runners.get(reference).generate(request(reference, plan.prompt, seed)).timings.total_ms)

        cached = []
        for i in range(plan.timing_images):
            # Each image next to one of the reference's, in alternating order: a shared machine's load
            # drifts over a scan and would otherwise favour whichever configuration ran in a quiet spell.
            if reference and i % 2 == 0:
                ref_image(100 + i)
            marks = current_marks()
            res = runners.get(c).generate(request(c, plan.prompt, 100 + i))
            m.image_ms.append(res.timings.total_ms)
            m.marks = list(dict.fromkeys([*m.marks, *marks, *current_marks()]))
            cached.append(len(getattr(res, "cached_steps", ()) or ()))
            if reference and i % 2 == 1:
                ref_image(100 + i)
            if reference and i == 1 and m.paired_speedup < 1 / SLOWER_THAN_REFERENCE:
                m.note = f"{m.paired_speedup:.2f}× eager fp32 over 2 pairs: not timed further"
                break
        m.cached_steps = sum(cached) / len(cached) if cached else None

    def score_it(c: Candidate, m: Measured) -> None:
        nonlocal ref_images
        runner = runners.get(c)
        images = [runner.generate(request(c, p, s)).image_png for p, s in zip(prompts, seeds, strict=True)]
        is_ref = key(c) == ref_key
        if is_ref:
            ref_images = images
        row = quality.score(images, prompts, None if is_ref else ref_images, plan.preset)
        m.drift_psnr_db, m.drift_max_diff, m.drift_ssim = row["drift_psnr_db"], row["drift_max_diff"], row["drift_ssim"]
        worst = 0 if is_ref else quality.worst_sample(images, ref_images)
        m.picture = quality.png_b64(images[worst])
        if not is_ref:
            m.diff_picture = quality.png_b64(quality.diff_heatmap(images[worst], ref_images[worst]))
            m.reference_picture = quality.png_b64(ref_images[worst])
        m.fidelity = row.get("fidelity")
        m.scored = True

    def attempt(step: Callable[[Candidate, Measured], None], c: Candidate, m: Measured) -> None:
        try:
            step(c, m)
        except Exception as exc:  # one configuration failing must not end the run
            log.warning("%s failed: %s", c.label(), exc)
            m.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    # The scan: speed of every configuration, in scan_rank's order, while the budget lasts.
    pending = list(grid)
    while pending:
        ranked = [(scan_rank(c, seconds), i, c) for i, c in enumerate(pending)]
        ready = [r for r in ranked if r[0] is not None]
        if not ready:  # what is left builds on configurations that failed or were not measured
            for c in pending:
                skipped.append({"what": c.label(), "why": "the configuration it builds on (same precision, "
                                "mode eager or without a cache) failed or was not measured"})
            done += len(pending)
            break
        _, index, c = min(ready, key=lambda r: (r[0], r[1]))
        pending.pop(index)
        if cancelled and cancelled():
            skipped.append({"what": c.label(), "why": "cancelled"})
            done += 1
            continue
        report(f"{c.label()}")
        cost = ((1 + plan.timing_images) * estimate_s(c) + plan.timing_images * (seconds(ref_key) or 0.0)) * 1.2 \
            + (compile_estimate(c) if needs_compile(c) else 0.0)
        if measured and time.perf_counter() + cost + reserve() > deadline:
            skipped.append({"what": c.label(), "why": f"time budget ({plan.max_minutes:g} min): about "
                            f"{cost:.0f} s more{' with its compile' if needs_compile(c) else ''}"})
            done += 1
            continue
        m = measured[key(c)] = Measured(c)
        attempt(time_it, c, m)
        if key(c) == ref_key and not m.error:
            attempt(score_it, c, m)
        done += 1

    # Quality, fastest first, of what is faster than the reference, until FINALISTS are within the bound.
    ref = measured.get(ref_key)
    within = 0
    if ref is not None and ref.scored and not ref.error:
        ref_row = ref.as_dict()
        report("quality of the fastest configurations")
        for m in sorted((m for m in measured.values() if speedup(m) and not m.error and not m.scored),
                        key=speedup, reverse=True):
            c = m.candidate
            base = measured.get((c.precision, c.mode, "none", c.attention))
            if speedup(m) <= 1.0:
                m.unscored = "no faster than eager fp32: quality not measured"
            elif within >= FINALISTS:
                m.unscored = f"slower than {FINALISTS} configurations within the bound: quality not measured"
            elif c.step_cache != "none" and base is not None and speedup(base) and speedup(m) <= speedup(base):
                m.unscored = f"the step cache measured no faster than {base.candidate.label()}"
            elif cancelled and cancelled():
                m.unscored = "cancelled"
            elif time.perf_counter() + len(prompts) * m.s_per_image * 1.2 + final_round_s() > deadline:
                m.unscored = f"time budget ({plan.max_minutes:g} min): quality not measured"
            else:
                attempt(score_it, c, m)
                if m.scored and within_bound(m.as_dict(), ref_row, plan)[0]:
                    within += 1
    done += 1

    rows = [m.as_dict() for m in measured.values()]
    pick, rows = choose(rows, plan)
    confirm = None
    if pick is not None and not (cancelled and cancelled()):
        # A shared machine's load moves one configuration's timings and not another's: the leaders are
        # timed again round-robin with the reference, and the pick and its speedup come from those rounds.
        leaders = sorted((r for r in rows if r["eligible"]), key=lambda r: -r["speedup"])[:FINALISTS]
        report(f"final round: {', '.join(r['label'] for r in leaders)} against eager fp32")
        confirm = _final_round(plan, runners, leaders, rows, request, deadline)
        pick = apply_final_round(rows, confirm)
    done = total
    report("done")
    return {
        "preset": plan.preset.name, "device": spec.name, "size": str(plan.size), "steps": plan.steps,
        "bound": {"fidelity_points": plan.fidelity_points, "min_psnr_db": plan.psnr_bound(), "min_ssim": plan.min_ssim},
        "quality_samples": len(prompts), "timing_images": plan.timing_images,
        "reference": REFERENCE, "pick": pick, "confirm": confirm, "rows": rows, "skipped": skipped,
        "elapsed_s": time.perf_counter() - started, "max_minutes": plan.max_minutes,
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def final_entries(leaders: list[dict], rows: list[dict]) -> list[Candidate]:
    """The reference, the leaders, and the configuration without a cache of every leader with one."""
    def candidate(r: dict) -> Candidate:
        return Candidate(**{k: r[k] for k in REFERENCE})

    by_key = {(r["precision"], r["mode"], r["step_cache"], r["attention"]): r for r in rows if r.get("s_per_image")}
    entries = [Candidate(**REFERENCE)]
    for r in leaders:
        base = by_key.get((r["precision"], r["mode"], "none", r["attention"])) if r["step_cache"] != "none" else None
        for c in (candidate(r), candidate(base) if base else None):
            if c is not None and c not in entries:
                entries.append(c)
    return entries


def final_pick(leaders: list[dict], speedups: dict[str, float | None]) -> str | None:
    """The leader with the largest speedup in the final round; a leader with a step cache only where it was
    faster there than the same configuration without the cache."""
    def base_label(r: dict) -> str:
        return Candidate(r["precision"], r["mode"], "none", r["attention"]).label()

    timed = [r for r in leaders if speedups.get(r["label"])]
    fair = [r for r in timed if r["step_cache"] == "none" or not speedups.get(base_label(r))
            or speedups[r["label"]] > speedups[base_label(r)]]
    return max((r["label"] for r in fair), key=lambda label: speedups[label], default=None)


def apply_final_round(rows: list[dict], confirm: dict) -> dict | None:
    """Every configuration timed in the final round takes its speedup (and spread) from there, so the
    summary, the table, the cards and the JSON show one figure per configuration; the pick, from `rows`."""
    for r in rows:
        figure = confirm["figures"].get(r["label"])
        r["final_ms_median"] = confirm["medians"].get(r["label"])
        if figure and figure.get("speedup") is not None and not r.get("error"):
            r["scan_speedup"] = r.get("speedup")
            r["speedup"], r["speedup_figure"], r["speedup_source"] = figure["speedup"], figure, "final round"
    return next((r for r in rows if r["label"] == confirm["pick"]), None)


MIN_FINAL_ROUNDS = 3


def _final_round(plan: AdvisePlan, runners: _Runners, leaders: list[dict], rows: list[dict], request,
                 deadline: float) -> dict:
    """The leaders (and their configurations without a cache) and the reference timed again, round-robin
    (the starting one rotates each round): medians side by side, final_pick's choice, its speedup against
    the reference's median. Rounds past the deadline are dropped (MIN_FINAL_ROUNDS are always run)."""
    entries = {c.label(): c for c in final_entries(leaders, rows)}
    ref_label = Candidate(**REFERENCE).label()
    timing = PairedTiming(list(entries), reference=ref_label, min_rounds=min(MIN_FINAL_ROUNDS, plan.confirm_pairs),
                          max_rounds=max(plan.confirm_pairs, 1),
                          budget_s=max(0.0, deadline - time.perf_counter()))

    def time_one(label: str, i: int) -> float:
        c = entries[label]
        return runners.get(c).generate(request(c, plan.prompt, 500 + i)).timings.total_ms

    measure_round_robin(timing, time_one, marks=current_marks)  # every entry is warm from the scan
    return final_summary(timing, leaders)


def final_summary(timing: PairedTiming, leaders: list[dict]) -> dict:
    """The final round's record: per configuration its figure (median paired speedup, spread, images)."""
    figures = {label: f.as_dict() for label, f in timing.figures().items()}
    medians = {label: (f["s_per_image"] or 0) * 1000 or None for label, f in figures.items()}
    speedups = {label: f["speedup"] for label, f in figures.items()}
    speedups[timing.reference] = 1.0  # eager fp32 stays the pick where nothing beats it
    best = final_pick(leaders, speedups)
    return {"rounds": timing.rounds, "stop_reason": timing.stop_reason, "medians": medians, "figures": figures,
            "pick": best, "pick_ms_median": medians.get(best), "reference_ms_median": medians.get(timing.reference),
            "speedup": figures[best]["speedup"] if best else None}


# -- output -----------------------------------------------------------------------------------------
def fmt_row(r: dict) -> list[str]:
    def pct(v):
        return "—" if v is None else f"{v * 100:.0f} %"

    if r.get("error"):
        return [r["label"], "failed", "", "", "", r["error"]]
    return [r["label"], f"{r['s_per_image'] * 1000:.1f} ms", row_speedup_text(r),
            quality.fmt_drift(r.get("drift_psnr_db"), r.get("drift_max_diff"))
            + ("" if r.get("drift_ssim") is None else f", SSIM {r['drift_ssim']:.3f}"), pct(r.get("fidelity")),
            "pick" if r.get("picked") else ("yes" if r.get("eligible") else f"no: {r.get('why_not', '')}")]


def markdown(report: dict) -> str:
    pick = report.get("pick")
    threads = f", {report['threads']} CPU thread{'s' if report['threads'] > 1 else ''}" if report.get("threads") else ""
    lines = [f"Advisor: {report['preset']} on {report['device']} at {report['size']}, {report['steps']} steps "
             f"({report['measured_at']}, {report['elapsed_s']:.0f} s, {report['quality_samples']} quality samples"
             f"{threads})",
             "", "| configuration | s/image (median) | × eager fp32 (timed in alternation) | drift vs eager fp32 | "
                 "fidelity | within bound |",
             "|---|---|---|---|---|---|"]
    for r in sorted(report["rows"], key=lambda r: -(r.get("speedup") or 0)):
        r = {**r, "picked": pick is not None and r["label"] == pick["label"]}
        lines.append("| " + " | ".join(fmt_row(r)) + " |")
    if report["skipped"]:
        lines += ["", "Skipped:"] + [f"- {s['what']}: {s['why']}" for s in report["skipped"]]
    lines.append("")
    if pick is None:
        lines.append("No configuration within the bound (eager fp32 stays).")
    elif is_reference(pick):
        lines.append("Pick: eager fp32 — no configuration within the bound measured faster than it.")
    else:
        c = report["confirm"] or {}
        lines.append(f"Pick: {pick['label']} — {pick['s_per_image'] * 1000:.1f} ms per image, "
                     f"in the grid; {row_speedup_text(pick)} eager fp32 "
                     f"({(c.get('pick_ms_median') or 0):.1f} vs {(c.get('reference_ms_median') or 0):.1f} ms, medians of "
                     f"{c.get('rounds')} round-robin rounds); fidelity "
                     + ("—" if pick.get("fidelity") is None else f"{pick['fidelity'] * 100:.0f} %")
                     + ("" if report['rows'][0].get('fidelity') is None else
                        f" (eager fp32 {report['rows'][0]['fidelity'] * 100:.0f} %)")
                     + f", drift {quality.fmt_drift(pick.get('drift_psnr_db'), pick.get('drift_max_diff'))}")
    return "\n".join(lines)


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
    return {**{k: pick[k] for k in REFERENCE}, "preset": pick["preset"], "device": pick["device"],
            "size": pick["size"], "steps": pick["steps"]}


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
    from engine.protocol import Size

    started = time.perf_counter()  # the budget covers loading torch too
    preset = get_preset(args.preset)
    spec = devices.resolve_device(args.device)
    size = Size.parse(args.size) if args.size else preset.buckets[0]
    route_size(preset, size.width, size.height, snap=False)  # must be one of the buckets
    threads = args.threads or serving_threads(spec)
    if threads:
        import torch

        torch.set_num_threads(threads)
    cache_dir = Path(args.cache_dir) if args.cache_dir else settings.cache_dir()
    plan = AdvisePlan(
        preset=preset, device=spec.name, size=size, steps=args.steps or preset.steps, max_minutes=args.max_minutes,
        timing_images=args.timing_images, quality_samples=args.quality_samples, confirm_pairs=args.confirm_pairs,
        fidelity_points=args.fidelity_points, min_psnr_db=args.min_psnr, min_ssim=args.min_ssim, cache_dir=cache_dir,
        options=options_from_args(args, warm_sizes=(), warm_modes=()),
        allowed_roots=tuple(str(r) for r in model_roots_from_args(args)), prompt=preset.example_prompt,
        started=started,
    )

    def on_progress(done: int, total: int, desc: str) -> None:
        if args.progress_json:
            print(json.dumps({"progress": done, "total": total, "desc": desc}), flush=True)
        else:
            print(f"[{done}/{total}] {desc}", file=sys.stderr, flush=True)

    report = advise(plan, on_progress)
    report["threads"] = threads
    path = save(report, args.out or result_path(cache_dir, preset.name, spec.name, size, plan.steps))
    report["saved"] = str(path)
    if args.progress_json:
        print(json.dumps({"result": report}), flush=True)
    else:
        print(markdown(report))
        print(f"wrote {path}", file=sys.stderr)
    return 0 if report["pick"] else 1


def add_advise_parser(subparsers):
    """Register `advise` on the CLI's subparsers (engine/cli.py calls this); imports no torch."""
    from engine.config.flags import add_engine_arguments

    a = subparsers.add_parser(
        "advise", help="measure precision x mode x step cache x attention here; pick the fastest within a "
                       "quality bound", description=__doc__.split("\n\n")[0])
    a.add_argument("--preset", default="tiny-shapes")
    a.add_argument("--device", default="auto")
    a.add_argument("--size", default=None, help="WxH bucket (default: the preset's first)")
    a.add_argument("--steps", type=int, default=None, help="default: the preset's")
    a.add_argument("--max-minutes", type=float, default=5.0, help="time budget; what does not fit is skipped")
    a.add_argument("--timing-images", type=int, default=5, help="timed images per configuration (median)")
    a.add_argument("--quality-samples", type=int, default=16,
                   help="fidelity prompts (a model with a checker) / drift samples per configuration")
    a.add_argument("--confirm-pairs", type=int, default=8,
                   help="final round: the leaders and eager fp32 timed this many times each, round-robin")
    a.add_argument("--fidelity-points", type=float, default=DEFAULT_FIDELITY_POINTS,
                   help="bound: fidelity at most this many points below eager fp32 (models with a checker)")
    a.add_argument("--min-psnr", type=float, default=None,
                   help=f"bound: drift PSNR against eager fp32 (default {DEFAULT_MIN_PSNR:g} dB, "
                        f"{CHECKER_MIN_PSNR:g} dB on models with a checker, beside --fidelity-points)")
    a.add_argument("--min-ssim", type=float, default=None,
                   help="bound: drift SSIM against eager fp32 (0-1; default off: PSNR and fidelity bound)")
    a.add_argument("--out", type=Path, default=None,
                   help="results JSON (default: <cache dir>/advisor/<preset>@<device>-<size>-<steps>steps.json)")
    a.add_argument("--progress-json", action="store_true", help="progress and the result as JSON lines on stdout")
    a.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default on a CPU: the app's per-worker share of the cores)")
    add_engine_arguments(a)
    a.set_defaults(func=cmd_advise)
    return a
