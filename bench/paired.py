"""One way of timing configurations against a reference, shared by Compare, the Advisor and the bench.

Every configuration is warm before it is timed (its compile and warm-up are reported apart, never inside a
speedup). Then the configurations and the reference are timed round-robin, one image each per round, the
starting configuration rotating every round, so a load that drifts over a run hits all of them alike.
Each round gives one paired ratio per configuration (the reference's time in that round ÷ its own); rounds
are added until the spread of every ratio is known (its interquartile range within `tolerance` of its
median) or the time budget or `max_rounds` ends them. A figure is the median paired ratio with its
interquartile range and the number of images it rests on; a figure whose range includes 1.0× is "no
measurable difference here". A sample taken while a compile, another engine's request or a load spike
ran carries a mark, and so does every figure built on it.

Pure (no torch): the caller supplies the function that times one image and the one that says what else
ran; `measure_round_robin` drives them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.metrics import median, percentile

DEFAULT_TOLERANCE = 0.10  # interquartile range of a paired ratio, relative to its median, that ends the rounds
MIN_ROUNDS = 3
MAX_ROUNDS = 15
LOAD_SPIKE_PER_CORE = 1.0  # one-minute load average per core above which the host counts as busy
NO_DIFFERENCE = "no measurable difference here"


def rotation(labels: list[str], round_index: int) -> list[str]:
    """The order of one round: every label once, starting one further along each round."""
    if not labels:
        return []
    start = round_index % len(labels)
    return labels[start:] + labels[:start]


def summarise_marks(per_image: list[list[str]]) -> list[str]:
    """One line per kind of mark over a figure's images, with how many images it touched: the host's load
    as its highest reading ("host load up to 15.1 on 2 cores, 9 of 15 images")."""
    counts: dict[str, int] = {}
    loads: list[tuple[float, str]] = []
    load_images = 0
    for marks in per_image:
        seen_load = False
        for mark in dict.fromkeys(marks):
            if mark.startswith(LOAD_MARK):
                value, _, rest = mark[len(LOAD_MARK):].partition(" ")
                loads.append((float(value), rest))
                seen_load = True
            else:
                counts[mark] = counts.get(mark, 0) + 1
        load_images += seen_load
    n = len(per_image)
    out = [f"{mark}, {k} of {n} images" for mark, k in counts.items()]
    if loads:
        top, rest = max(loads)
        out.append(f"{LOAD_MARK}up to {top:.1f} {rest}, {load_images} of {n} images")
    return out


LOAD_MARK = "host load "


def load_marks(load_1min: float | None, cores: int | None) -> list[str]:
    """A mark when the host's one-minute load average is above LOAD_SPIKE_PER_CORE per core."""
    if load_1min is None or not cores:
        return []
    if load_1min > LOAD_SPIKE_PER_CORE * cores:
        return [f"{LOAD_MARK}{load_1min:.1f} on {cores} cores"]
    return []


def host_load() -> tuple[float | None, int | None]:
    """(one-minute load average, CPU cores); (None, None) where the host does not say."""
    try:
        return os.getloadavg()[0], os.cpu_count()
    except (AttributeError, OSError):
        return None, os.cpu_count()


def engine_marks(status: Iterable[dict], own_engines: Iterable[str] = (), compiles: dict | None = None) -> list[str]:
    """Marks from the engine manager's status() rows (and host_status()["compiles"], when given): a bucket
    compiling anywhere, and requests pending on an engine that is not one being measured."""
    own = {str(e) for e in own_engines}
    marks: list[str] = []
    # One spelling for both sources, the scheduler's bucket ("regional:64x64"), so one compile is one mark.
    compiling = sorted({f"{row.get('engine')} {b.get('mode', '')}:{b.get('size', '')}"
                        for row in status for b in row.get("buckets") or [] if b.get("state") == "compiling"})
    running = [f"{c.get('engine')} {c.get('bucket')}" for c in (compiles or {}).get("running", [])]
    for what in dict.fromkeys(compiling + running):
        marks.append(f"compile running ({what})")
    for row in status:
        if row.get("engine") not in own and (row.get("pending") or 0) > 0:
            marks.append(f"another engine's work ({row['engine']})")
    return marks


def current_marks(status: Callable[[], list[str]] | None = None) -> list[str]:
    """What ran besides the measurement now: the engine's own marks (`status`, when given) and the host's load."""
    return [*(status() if status else []), *load_marks(*host_load())]


@dataclass
class Figure:
    """One configuration's speedup over the reference, as every table, card and JSON shows it."""

    label: str
    speedup: float | None  # median of the paired ratios (reference time ÷ this one's, same round)
    low: float | None  # interquartile range of the paired ratios
    high: float | None
    min: float | None
    max: float | None
    images: int  # timed images of this configuration behind the figure
    s_per_image: float | None  # median of its timed images
    reference: bool = False
    marks: list[str] = field(default_factory=list)  # what else ran during its images or the paired ones

    @property
    def verdict(self) -> str:
        if self.reference:
            return "reference"
        if self.speedup is None:
            return "not measured"
        if self.low is not None and self.low <= 1.0 <= self.high:
            return NO_DIFFERENCE
        return "faster" if self.speedup > 1.0 else "slower"

    def text(self) -> str:
        """'1.62× (1.55–1.70, 8 images)', 'no measurable difference here (0.95–1.08×, 8 images)', with
        '· marked: ...' when something else ran."""
        if self.reference:
            body = f"1.00× (reference, {self.images} images)"
        elif self.speedup is None:
            body = "—"
        elif self.verdict == NO_DIFFERENCE:
            body = f"{NO_DIFFERENCE} ({self.low:.2f}–{self.high:.2f}×, {self.images} images)"
        else:
            body = f"{self.speedup:.2f}× ({self.low:.2f}–{self.high:.2f}, {self.images} images)"
        return body + (f" · marked: {'; '.join(self.marks)}" if self.marks else "")

    def as_dict(self) -> dict:
        return {"label": self.label, "speedup": self.speedup, "iqr": [self.low, self.high],
                "range": [self.min, self.max], "images": self.images, "s_per_image": self.s_per_image,
                "verdict": self.verdict, "marks": list(self.marks), "text": self.text()}


@dataclass
class PairedTiming:
    """The plan and the samples of one round-robin measurement: `labels` with the reference among them."""

    labels: list[str]
    reference: str
    tolerance: float = DEFAULT_TOLERANCE
    min_rounds: int = MIN_ROUNDS
    max_rounds: int = MAX_ROUNDS
    budget_s: float | None = None  # seconds of timing rounds; None: only max_rounds ends them
    times: dict[str, dict[int, float]] = field(default_factory=dict)  # label -> round -> ms
    marks: dict[str, dict[int, list[str]]] = field(default_factory=dict)  # label -> round -> marks
    warm: dict[str, dict] = field(default_factory=dict)  # label -> what warming it cost (reported apart)
    rounds: int = 0
    stop_reason: str | None = None

    def __post_init__(self):
        if self.reference not in self.labels:
            self.labels = [self.reference, *self.labels]
        if self.min_rounds < 1 or self.max_rounds < self.min_rounds:
            raise ValueError(f"rounds: need 1 <= min_rounds <= max_rounds, got {self.min_rounds}, {self.max_rounds}")

    def order(self, round_index: int) -> list[str]:
        return rotation([label for label in self.labels if label not in self.failed()], round_index)

    def failed(self) -> set[str]:
        return {label for label, w in self.warm.items() if w.get("error")}

    def record(self, round_index: int, label: str, ms: float, marks: Iterable[str] = ()) -> None:
        self.times.setdefault(label, {})[round_index] = float(ms)
        if marks:
            self.marks.setdefault(label, {})[round_index] = list(marks)
        self.rounds = max(self.rounds, round_index + 1)

    def ratios(self, label: str, against: str | None = None) -> list[float]:
        """The reference's (or `against`'s) time ÷ this label's, one per round in which both were timed."""
        mine, ref = self.times.get(label, {}), self.times.get(against or self.reference, {})
        return [ref[r] / mine[r] for r in sorted(mine) if r in ref and mine[r] > 0]

    def spread(self, label: str) -> float | None:
        """The interquartile range of the paired ratios relative to their median; None before there are any."""
        ratios = self.ratios(label)
        if not ratios:
            return None
        return (percentile(ratios, 0.75) - percentile(ratios, 0.25)) / median(ratios)

    def settled(self, label: str) -> bool:
        spread = self.spread(label)
        return len(self.ratios(label)) >= self.min_rounds and spread is not None and spread <= self.tolerance

    def another_round(self, elapsed_s: float, round_s: float | None = None) -> bool:
        """Whether to time one more round, after `elapsed_s` seconds of rounds, each taking about
        `round_s`; sets stop_reason when not."""
        others = [label for label in self.order(0) if label != self.reference]
        if self.rounds < self.min_rounds and others:
            return True
        if not others or all(self.settled(label) for label in others):
            self.stop_reason = "spread known" if others else "nothing to time"
            return False
        if self.rounds >= self.max_rounds:
            self.stop_reason = f"{self.max_rounds} rounds"
            return False
        if self.budget_s is not None and elapsed_s + (round_s or 0.0) > self.budget_s:
            self.stop_reason = f"time budget ({self.budget_s:g} s)"
            return False
        return True

    def figure(self, label: str, against: str | None = None) -> Figure:
        """`label`'s speedup over the reference (or over `against`, another label: a chip's own reference)."""
        against = against or self.reference
        ratios = self.ratios(label, against)
        mine = self.times.get(label, {})
        per_image = [[*self.marks.get(label, {}).get(r, []), *self.marks.get(against, {}).get(r, [])]
                     for r in sorted(mine)]
        marks = summarise_marks(per_image) if any(per_image) else []
        is_ref = label == against
        return Figure(
            label=label, reference=is_ref, images=len(mine),
            s_per_image=median(mine.values()) / 1000 if mine else None,
            speedup=1.0 if is_ref and mine else median(ratios),
            low=1.0 if is_ref and mine else percentile(ratios, 0.25),
            high=1.0 if is_ref and mine else percentile(ratios, 0.75),
            min=min(ratios) if ratios else None, max=max(ratios) if ratios else None,
            marks=marks,
        )

    def figures(self) -> dict[str, Figure]:
        return {label: self.figure(label) for label in self.labels}

    def as_dict(self) -> dict:
        return {"reference": self.reference, "rounds": self.rounds, "stop_reason": self.stop_reason,
                "tolerance": self.tolerance, "warm": self.warm,
                "figures": {label: f.as_dict() for label, f in self.figures().items()}}


def measure_round_robin(plan: PairedTiming, time_one: Callable[[str, int], float],
                        warm: Callable[[str], dict | None] | None = None,
                        marks: Callable[[], list[str]] | None = None,
                        clock: Callable[[], float] = time.perf_counter,
                        cancelled: Callable[[], bool] | None = None) -> PairedTiming:
    """Warm every label (`warm(label)` -> what it cost, e.g. {"compile_s", "warmup_s"}; an exception there
    marks the label failed and it is not timed), then time rounds until `plan.another_round` says stop.
    `time_one(label, round)` -> milliseconds of one image; `marks()` -> what else runs now (sampled before
    and after each image)."""
    for label in plan.labels:
        try:
            plan.warm[label] = dict((warm(label) if warm else None) or {})
        except Exception as exc:  # one configuration failing must not end the measurement
            plan.warm[label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    if plan.reference in plan.failed():
        plan.stop_reason = "the reference failed"
        return plan
    started = clock()
    round_index = 0
    while True:
        if cancelled and cancelled():
            plan.stop_reason = "cancelled"
            break
        elapsed = clock() - started
        if not plan.another_round(elapsed, elapsed / round_index if round_index else None):
            break
        for label in plan.order(round_index):
            before = marks() if marks else []
            try:
                ms = time_one(label, round_index)
            except Exception as exc:  # it stops being timed; the others go on
                plan.warm.setdefault(label, {})["error"] = \
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if label == plan.reference:
                    plan.stop_reason = "the reference failed"
                    return plan
                continue
            after = marks() if marks else []
            plan.record(round_index, label, ms, dict.fromkeys(before + after))
        round_index += 1
    return plan


def row_speedup_text(r: dict) -> str:
    """A row's one speedup as every view shows it: median, spread and images where measured in pairs."""
    if r.get("speedup") is None:
        return "—"
    figure = r.get("speedup_figure")
    if figure and figure.get("text") and figure.get("speedup") == r["speedup"]:
        return figure["text"] + (" (final round)" if r.get("speedup_source") == "final round" else "")
    return f"{r['speedup']:.2f}×"
