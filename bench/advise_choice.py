"""The advisor's choices, without measuring anything (torch-free): what it plans (AdvisePlan), the grid of
candidates this engine can run here, the order of the scan, the quality bound, the pick among measured
rows and the final round's verdict. bench/advise.py measures; bench/advise_report.py reads
the report out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import quality
from bench.advise_report import ABSENT, REFERENCE, is_reference
from bench.paired import PairedTiming
from engine.metrics import median
from engine.protocol import LoraChoice, Mode, StepCache

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
    lora: LoraChoice = LoraChoice()  # every configuration draws with this style; eager adds it fused
    max_memory_bytes: int | None = None  # the pick's measured peak must fit this (--max-memory)
    memory_levers: tuple[str, ...] = ()  # memory lever sets measured eagerly beside the grid

    @property
    def style(self) -> str | None:
        """The style images are checked as (None: no LoRA, or at scale 0)."""
        return self.lora.name if self.lora.name and self.lora.scale != 0 else None

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
    lora_fused: bool = False  # the run's LoRA folded into the weights (eager only)
    memory: str = ""  # memory levers (engine/protocol/memory.py): an engine of their own

    def label(self) -> str:
        parts = [self.precision, self.mode]
        if self.step_cache != "none":
            parts.append(self.step_cache)
        if self.attention != "native":
            parts.append(f"attn={self.attention}")
        if self.lora_fused:
            parts.append("lora-fused")
        if self.memory:
            parts.append(f"mem={self.memory}")
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
    peak_bytes: int | None = None  # its weights plus the most its timed images added (bench/advise.py)

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
                "unscored": self.unscored, "note": self.note, "peak_bytes": self.peak_bytes}


# -- the grid ---------------------------------------------------------------------------------------
def plan_grid(plan: AdvisePlan, spec) -> tuple[list[Candidate], list[dict]]:
    """Every candidate this engine can run here, and what was skipped with why (torch not needed)."""
    skipped: list[dict] = []
    precisions = _runnable_precisions(spec, skipped)
    modes = _runnable_modes(spec, skipped)
    grid = _cache_candidates(plan, spec, precisions, modes, skipped) + _attention_candidates(spec, skipped)
    if plan.lora.name is not None and "eager" in modes:  # fused runs eager only (engine/pipeline/lora.py)
        grid += [Candidate(p, "eager", lora_fused=True) for p in _fusable(precisions, skipped)]
    grid += _memory_candidates(plan, spec, skipped)
    skipped.append({"what": "parallel layouts (tensor/ulysses/ring)",
                    "why": "they run as a torchrun sidecar of several ranks, not in this process; compare them "
                           "on the Compare tab (Tensor-parallel ranks)"})
    return grid, skipped


def _runnable_precisions(spec, skipped: list[dict]) -> list[str]:
    from engine.devices import precision_support

    precisions = []
    for name, row in precision_support(spec).items():
        if row["status"] == "refused":
            skipped.append({"what": f"precision {name}", "why": row["reason"]})
        elif row.get("emulated"):
            skipped.append({"what": f"precision {name}", "why": f"{row['emulated']}: not timed"})
        elif row["status"] == "downgraded":
            skipped.append({"what": f"precision {name}", "why": f"runs as {row['runs_as']} here (measured as that)"})
        else:
            precisions.append(str(name))
    return precisions


def _fusable(precisions: list[str], skipped: list[dict]) -> list[str]:
    """The precisions a fused LoRA runs at (not the quantized ones: a fuse would re-quantize)."""
    from engine.protocol import Precision

    for name in precisions:
        if Precision(name).quantized:
            skipped.append({"what": f"{name}/eager/lora-fused", "why": f"a fused LoRA is not served on {name} "
                            "engines (it would re-quantize at every fuse); measured unfused"})
    return [name for name in precisions if not Precision(name).quantized]


def _runnable_modes(spec, skipped: list[dict]) -> list[str]:
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
    return modes


def _cache_candidates(plan: AdvisePlan, spec, precisions: list[str], modes: list[str],
                      skipped: list[dict]) -> list[Candidate]:
    """Each precision x mode with each usable step cache (and the cache loosened one notch)."""
    from engine.pipeline.stepcache import available_step_caches

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
    return grid


def _memory_candidates(plan: AdvisePlan, spec, skipped: list[dict]) -> list[Candidate]:
    """fp32 eager with each of the plan's memory lever sets (refused ones skipped with the reason)."""
    from engine.errors import ShowcaseError
    from engine.pipeline import memory

    grid = []
    for levers in plan.memory_levers:
        try:
            memory.check_levers(levers, spec)
            grid.append(Candidate("fp32", "eager", memory=levers))
        except ShowcaseError as exc:
            skipped.append({"what": f"memory levers {levers}", "why": str(exc)})
    return grid


def _attention_candidates(spec, skipped: list[dict]) -> list[Candidate]:
    from engine.pipeline.attention import attention_table

    grid: list[Candidate] = []
    for row in attention_table(spec, "fp32"):
        name = row.get("name")
        if name == "native":
            continue
        if row.get("usable"):
            grid.append(Candidate("fp32", "eager", "none", name))
        else:
            skipped.append({"what": f"attention {name}", "why": row.get("reason") or row.get("note") or "unusable"})
    return grid


def stronger(cache: str) -> str | None:
    """The cache with its reuse loosened one notch (threshold doubled, or one step more between full
    computations): faster where it reuses more, and the quality bound decides whether it may."""
    c = StepCache.parse(cache)
    if not c.enabled:
        return None
    if c.threshold is not None:
        return str(dataclasses.replace(c, threshold=round(c.threshold * 2, 4)))
    if c.interval is not None:
        return str(dataclasses.replace(c, interval=c.interval + 1))
    return None


def is_default(cache: str) -> bool:
    return str(StepCache.parse(cache)) == str(StepCache.parse(cache.split(":")[0]))


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


def base_of(row: dict) -> tuple:
    """The key of the same configuration without a step cache."""
    return row["precision"], row["mode"], row["attention"], row.get("lora_fused", False)


def choose(rows: list[dict], plan: AdvisePlan) -> tuple[dict | None, list[dict]]:
    """The fastest row within the bound (rows: Measured.as_dict()), and every row with its verdict.

    Speed is the speedup over eager fp32: timed in alternation with it where measured so (paired_speedup),
    else the ratio of medians. A row with a step cache qualifies only if it measured faster than the same
    configuration without one."""
    ref = next((r for r in rows if is_reference(r) and not r.get("error")), None)
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
        # a peak not measured cannot be said to fit
        if ok and plan.max_memory_bytes and (r.get("peak_bytes") is None or r["peak_bytes"] > plan.max_memory_bytes):
            r["eligible"], r["why_not"] = False, over_memory(r, plan.max_memory_bytes)
    eligible = [r for r in rows if r["eligible"]]
    return (max(eligible, key=lambda r: r["speedup"]) if eligible else None), rows


def short_budget(pick: dict | None, needed_s: dict[str, float], max_minutes: float) -> dict | None:
    """When the budget, not a measurement, would leave eager fp32 as the pick (or no pick): that verdict
    instead, with the budget that would reach the first configuration cut for time; None otherwise.

    `needed_s`: label -> the run's length (s) at which that configuration's timing or quality check fits.
    The budget named is the one that reaches the first plain configuration (a precision and a mode: no step
    cache, whose drift usually fails the bound, nor another attention backend) where one was cut, a compiled
    one first: another precision run eagerly is cut sooner but is rarely what beats eager fp32."""
    if (pick is not None and not is_reference(pick)) or not needed_s:
        return None
    plain = {label: s for label, s in needed_s.items() if label.count("/") == 1}
    compiled = {label: s for label, s in plain.items() if not label.endswith("/eager")}
    first, seconds = min((compiled or plain or needed_s).items(), key=lambda kv: kv[1])
    minutes = max(max_minutes + 0.5, math.ceil(seconds / 30) / 2)  # the Advisor tab's slider moves by 0.5
    return {"needed_minutes": minutes, "first": first, "cut": sorted(needed_s, key=needed_s.get)}


def over_memory(row: dict, bound: int) -> str:
    if row.get("peak_bytes") is None:
        return "peak memory not measured: cannot say it fits --max-memory"
    return f"peak {row['peak_bytes'] / 2**30:.2f} GiB > --max-memory {bound / 2**30:.2f} GiB"


def scan_rank(c: Candidate, seconds: Callable[[tuple], float | None]) -> tuple | None:
    """Where `c` stands in the scan, from what is measured so far (lower goes first); None: not worth
    measuring (the configuration it builds on failed or was not measured).

    The reference; every precision eagerly; the compiled modes, the reference's precision first (it draws
    eager fp32's pictures, so its compiled modes are within any bound: under a load of 18 int8wo read
    fastest eagerly by noise and its compiles went first), then the precisions that measured fastest
    eagerly; then step caches and attention backends on the configurations that measured fastest first.
    `seconds((precision, mode, step_cache, attention))`: that configuration's s / image, None if unknown."""
    if is_reference(c.as_dict()):
        return (0,)
    if c.step_cache == "none" and c.attention == "native":
        if c.mode == "eager":
            return (1, c.lora_fused)
        eager = seconds((c.precision, "eager", "none", "native", False))
        return None if eager is None else (2, c.precision != REFERENCE["precision"], eager, MODES.index(c.mode))
    base = seconds((c.precision, c.mode, "none", "native", False))
    loosened = c.step_cache != "none" and not is_default(c.step_cache)
    return None if base is None else (3, base, loosened, c.attention != "native")



def final_entries(leaders: list[dict], rows: list[dict]) -> list[Candidate]:
    """The reference, the leaders, and the configuration without a cache of every leader with one."""
    def candidate(r: dict) -> Candidate:
        return Candidate(**{k: r.get(k, ABSENT.get(k)) for k in REFERENCE}, memory=r.get("memory", ""))

    by_key = {(r["precision"], r["mode"], r["step_cache"], r["attention"], r.get("lora_fused", False)): r
              for r in rows if r.get("s_per_image")}
    entries = [Candidate(**REFERENCE)]
    for r in leaders:
        base = (by_key.get((r["precision"], r["mode"], "none", r["attention"], r.get("lora_fused", False)))
                if r["step_cache"] != "none" else None)
        for c in (candidate(r), candidate(base) if base else None):
            if c is not None and c not in entries:
                entries.append(c)
    return entries


def final_pick(leaders: list[dict], speedups: dict[str, float | None]) -> str | None:
    """The leader with the largest speedup in the final round; a leader with a step cache only where it was
    faster there than the same configuration without the cache."""
    def base_label(r: dict) -> str:
        return Candidate(r["precision"], r["mode"], "none", r["attention"], r.get("lora_fused", False)).label()

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
            r.pop("paired_speedup", None)  # the scan's, kept as scan_speedup: one "speedup" per configuration
    return next((r for r in rows if r["label"] == confirm["pick"]), None)


MIN_FINAL_ROUNDS = 3


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
