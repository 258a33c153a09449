"""The bench's mode vocabulary: every engine `Mode`, plus bench-only configurations of one of them.

A bench mode is what `--modes` accepts and what the results are labelled with. Most are the engine's
own modes; a bench-only one runs an engine mode with some `EngineOptions` changed (max-autotune is
mode compile with `torch.compile(mode="max-autotune")`, cuda-graphs with `mode="reduce-overhead"`), so the pipeline path builds one more engine
with those options and the denoiser path asks `recipes.compile_kwargs` for them. Defined here once, as
data, so the parser, planning, both measuring paths and the ratios all speak of the same modes.

No torch: the parser and the pure statistics import this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.protocol import Mode

BASELINE_MODE = Mode.EAGER.value


@dataclass(frozen=True)
class BenchMode:
    name: str
    engine: Mode  # the engine mode that runs it
    overrides: dict = field(default_factory=dict)  # EngineOptions fields changed for it

    @property
    def compiled(self) -> bool:
        return self.engine.compiled

    @property
    def options_key(self) -> tuple:
        """Hashable form of `overrides`: bench modes with the same key share one engine (weights load once)."""
        return tuple(sorted(self.overrides.items()))


# Bench-only configurations: name -> (engine mode, option overrides).
BENCH_ONLY: dict[str, tuple[Mode, dict]] = {
    "max-autotune": (Mode.COMPILE, {"max_autotune": True}),
    "cuda-graphs": (Mode.COMPILE, {"cuda_graphs": True}),  # mode="reduce-overhead"; refused off CUDA
}

MODE_TABLE: dict[str, BenchMode] = {
    **{m.value: BenchMode(m.value, m) for m in Mode},
    **{name: BenchMode(name, mode, dict(overrides)) for name, (mode, overrides) in BENCH_ONLY.items()},
}

BENCH_MODES: tuple[str, ...] = tuple(MODE_TABLE)
COMPILED_MODES: tuple[str, ...] = tuple(name for name, m in MODE_TABLE.items() if m.compiled)
