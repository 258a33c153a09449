"""Step caches, one registry entry each: its name, parameters and their ranges, the modes it runs in and why
not the others, and how it applies (the diffusers config `enable_cache` takes, with its keyword arguments).

`STEP_CACHES` is the only table: the vocabulary (`StepCacheKind`, `StepCache.parse`, `StepCache.forms()`), the
CLI's help, the UI's choices (engine/pipeline/stepcache.py's rows) and the refusals are all read from it.
A new cache is one `StepCacheEntry` here (a parameter named other than threshold, interval or warmup is also
one more `StepCache` field). Nothing here imports torch or diffusers: the config is named, and
engine/pipeline/stepcache.py builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.errors import InvalidRequest
from engine.protocol.vocabulary import MAX_STEPS, Mode, _coerce

BLOCKS = "blocks"  # hooks on whole transformer blocks
ATTENTION = "attention"  # hooks on attention layers inside the blocks


@dataclass(frozen=True)
class ParamRange:
    """What diffusers' hook runs with for one step-cache parameter: a whole number in low..high, or a
    number strictly between low and high."""

    low: float
    high: float
    whole: bool = True
    why: str = ""

    def holds(self, value) -> bool:
        return self.low <= value <= self.high if self.whole else self.low < value < self.high

    @property
    def span(self) -> str:
        return f"{self.low:g}..{self.high:g}" if self.whole else f"above {self.low:g} and below {self.high:g}"

    def __str__(self) -> str:
        return self.span + (f" ({self.why})" if self.why else "")


@dataclass(frozen=True)
class CacheParam:
    """One parameter of a cache's text ("taylorseer:3:2"), in order: its default and what it may be."""

    name: str
    default: float
    range: ParamRange


@dataclass(frozen=True)
class CacheRun:
    """What a cache's diffusers config is built with for one run (engine/pipeline/stepcache.py fills it)."""

    steps: int
    cfg: bool  # the preset runs classifier-free guidance
    timestep: Callable | None = None  # the running pipeline's current timestep
    mag_ratios: list | None = None  # magcache's calibrated ratios
    calibrate: bool = False  # the calibration run itself


# Why a mode cannot run a cache; "{regional}" is filled with the caches that do run under regional.
_WHOLE_GRAPH = {
    Mode.COMPILE: ("compile traces the whole denoiser into one graph, which cannot skip its own blocks per step: "
                   "diffusers runs its cache hooks under torch.compiler.disable, which a fullgraph compile cannot "
                   "trace; use regional ({regional}) or eager"),
    Mode.AOT: ("an aot package is one exported graph of the whole denoiser, which cannot skip its own blocks "
               "per step; use regional ({regional}) or eager"),
}
_INSIDE_BLOCKS = {
    **_WHOLE_GRAPH,
    Mode.REGIONAL: ("its hooks sit on the attention layers inside the repeated blocks that regional compiles, "
                    "and a compiled block cannot run them (diffusers disables compile for its hooks); use eager, "
                    "or {regional_or} with regional"),
}
REFUSED_MODES = {BLOCKS: _WHOLE_GRAPH, ATTENTION: _INSIDE_BLOCKS}  # per hook level, the modes it cannot run in


def _no_arguments(cache: StepCache, run: CacheRun) -> dict:
    return {}


@dataclass(frozen=True)
class StepCacheEntry:
    """One step cache. `config` names the diffusers config class; `arguments(cache, run)` its keyword arguments.
    `refused` (mode -> why not) defaults to what its hook level cannot run in (REFUSED_MODES)."""

    name: str
    summary: str
    params: tuple[CacheParam, ...] = ()
    config: str = ""
    level: str = BLOCKS
    arguments: Callable[[StepCache, CacheRun], dict] = _no_arguments
    calibrated: bool = False  # needs one calibration run per preset and step count (stored in the cache folder)
    refused: Mapping[Mode, str] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def form(self) -> str:
        """Its text form, e.g. "taylorseer[:INTERVAL][:WARMUP]"."""
        return self.name + "".join(f"[:{n.upper()}]" for n in self.names)

    def param(self, name: str) -> CacheParam:
        return next(p for p in self.params if p.name == name)

    def _refusal(self, mode: Mode) -> str:
        if self.name == NONE:
            return ""
        return (REFUSED_MODES[self.level] if self.refused is None else self.refused).get(mode, "")

    def mode_problem(self, mode: Mode) -> str:
        """Why this cache cannot run in `mode` ("" it can)."""
        why = self._refusal(mode)
        regional = [e.name for e in STEP_CACHES.values() if e.name != NONE and not e._refusal(Mode.REGIONAL)]
        return why.format(regional=", ".join(regional), regional_or=" / ".join(regional)) if why else ""


_THRESHOLD = ParamRange(0.0, 10.0, whole=False)
_INTERVAL = ParamRange(1, MAX_STEPS)  # diffusers' hooks take the step index modulo it
# TaylorSeer computes the steps before `warmup` and then predicts from the last computed one: with warmup 0 it
# predicts the very first step from nothing, and diffusers fails ("Cannot predict without prior
# initialization/update.").
_WARMUP = ParamRange(1, MAX_STEPS, why="the first step must be computed before any can be predicted from it")

NONE = "none"

STEP_CACHES: dict[str, StepCacheEntry] = {e.name: e for e in (
    StepCacheEntry(NONE, "every step computed in full"),
    StepCacheEntry(
        "first-block", "skip the remaining blocks while the first block's output barely changes",
        (CacheParam("threshold", 0.2, _THRESHOLD),), "FirstBlockCacheConfig", BLOCKS,
        lambda c, run: {"threshold": c.threshold}),
    StepCacheEntry(
        "taylorseer", "compute every INTERVAL-th step after WARMUP, predict attention outputs in between",
        (CacheParam("interval", 3, _INTERVAL), CacheParam("warmup", 2, _WARMUP)), "TaylorSeerCacheConfig", ATTENTION,
        lambda c, run: {"cache_interval": c.interval, "disable_cache_before_step": c.warmup,
                        "taylor_factors_dtype": None}),
    StepCacheEntry(
        "magcache", "skip steps by calibrated residual-magnitude ratios (one calibration run per preset and steps)",
        (CacheParam("threshold", 0.06, _THRESHOLD),), "MagCacheConfig", BLOCKS,
        lambda c, run: ({"calibrate": True, "num_inference_steps": run.steps} if run.calibrate else
                        {"threshold": c.threshold, "num_inference_steps": run.steps, "mag_ratios": run.mag_ratios}),
        calibrated=True),
    StepCacheEntry(
        "faster-cache", "reuse attention outputs, recomputed every INTERVAL steps in a timestep range",
        (CacheParam("interval", 2, _INTERVAL),), "FasterCacheConfig", ATTENTION,
        lambda c, run: {"spatial_attention_block_skip_range": c.interval, "current_timestep_callback": run.timestep,
                        "is_guidance_distilled": not run.cfg, "tensor_format": "BCHW"}),
    StepCacheEntry(
        "pyramid", "broadcast attention outputs, recomputed every INTERVAL steps in a timestep range",
        (CacheParam("interval", 2, _INTERVAL),), "PyramidAttentionBroadcastConfig", ATTENTION,
        lambda c, run: {"spatial_attention_block_skip_range": c.interval, "current_timestep_callback": run.timestep}),
)}


class _Registered(type):
    """`StepCacheKind.FIRST_BLOCK` is the entry "first-block" (iterate STEP_CACHES for every name)."""

    def __getattr__(cls, attr: str):
        name = attr.lower().replace("_", "-")
        if attr.isupper() and name in STEP_CACHES:
            return cls(name)
        raise AttributeError(attr)


class StepCacheKind(str, metaclass=_Registered):
    """A step cache's name, one of STEP_CACHES (a closed vocabulary read from the registry, so an entry added
    there is a name here). Members are interned: `kind is StepCacheKind.NONE` holds."""

    _interned: dict[str, StepCacheKind] = {}

    def __new__(cls, value):
        value = str(value)
        if value not in STEP_CACHES:
            raise ValueError(f"{value!r} is not a valid StepCacheKind")
        kind = cls._interned.get(value)
        if kind is None:
            kind = cls._interned[value] = super().__new__(cls, value)
        return kind

    def __str__(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"StepCacheKind({str.__str__(self)!r})"

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def entry(self) -> StepCacheEntry:
        return STEP_CACHES[self.value]

    @classmethod
    def parse(cls, value, what: str | None = None) -> StepCacheKind:
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise InvalidRequest(f"unknown {what or 'stepcachekind'} {value!r}: choose one of "
                                 f"{', '.join(cls.values())}") from None

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(STEP_CACHES)


def _param_value(value, whole: bool):
    """A step-cache parameter as a number: whole ones refuse fractions ("2.5") rather than truncate them."""
    if isinstance(value, bool):
        raise ValueError
    number = float(value)
    if not whole or number in (float("inf"), float("-inf")):
        return number  # out of every range: refused as such
    if not number.is_integer():
        raise ValueError
    return int(number)


def step_cache_forms() -> str:
    """Every cache's text form: "none, first-block[:THRESHOLD], taylorseer[:INTERVAL][:WARMUP], ..."."""
    return ", ".join(e.form for e in STEP_CACHES.values())


@dataclass(frozen=True)
class StepCache:
    """A step cache and its parameters; `parse("first-block:0.2")`, `str()` gives the canonical text.

    Each entry of STEP_CACHES says which parameters its text takes, in order: threshold (first-block,
    magcache: relative change below which a step is reused), interval (taylorseer: full compute every
    `interval` steps; faster-cache / pyramid: attention recomputed every `interval` steps), warmup
    (taylorseer: steps always computed first).
    """

    kind: StepCacheKind = StepCacheKind(NONE)
    threshold: float | None = None
    interval: int | None = None
    warmup: int | None = None

    PARAMS = ("threshold", "interval", "warmup")  # the parameter names an entry may take

    def __post_init__(self):
        _coerce(self, "kind", StepCacheKind)
        entry = self.kind.entry
        for name in self.PARAMS:
            value = getattr(self, name)
            if name not in entry.names:
                if value is not None:
                    raise InvalidRequest(f"step cache {self.kind} takes no {name}; {StepCache.forms()}")
                continue
            param = entry.param(name)
            object.__setattr__(self, name, self._checked(name, param.default if value is None else value,
                                                         param.range))

    def _checked(self, name: str, value, allowed: ParamRange):
        try:
            value = _param_value(value, allowed.whole)
        except (TypeError, ValueError, OverflowError):
            kind = "whole number" if allowed.whole else "number"
            raise InvalidRequest(f"step cache {self.kind}: {name} {str(value)[:40]!r} is not a {kind} "
                                 f"(allowed {allowed}); {StepCache.forms()}") from None
        if not allowed.holds(value):
            raise InvalidRequest(f"step cache {self.kind}: {name} {value:g} is out of range: allowed {allowed}; "
                                 f"{StepCache.forms()}")
        return value

    @staticmethod
    def forms() -> str:
        """The valid texts, for error messages and help."""
        return "valid forms: " + step_cache_forms()

    @classmethod
    def parse(cls, text) -> StepCache:
        if isinstance(text, StepCache):
            return text
        if text is None or (isinstance(text, StepCacheKind) and text == NONE):
            return cls()
        parts = [p.strip() for p in str(text).strip().lower().split(":")]
        if not parts[0]:
            return cls()
        if parts[0] not in STEP_CACHES:
            raise InvalidRequest(f"unknown step cache {str(text)!r}; {cls.forms()}")
        kind = StepCacheKind(parts[0])
        names = kind.entry.names
        values = parts[1:]
        if len(values) > len(names):
            raise InvalidRequest(f"step cache {str(text)!r} has too many parameters; {cls.forms()}")
        return cls(kind, **{n: v for n, v in zip(names, values, strict=False) if v != ""})

    @property
    def enabled(self) -> bool:
        return self.kind != NONE

    def __str__(self) -> str:
        return ":".join([self.kind.value, *(f"{getattr(self, n):g}" for n in self.kind.entry.names)])


NO_STEP_CACHE = StepCache()
