"""Where an engine's requests run: the executor protocol, and the executor that runs them here.

An `Executor` generates a request, a batch, and warms a bucket. The worker loop (engine/worker/loop.py) is
given one: a PipelineRunner (engine/pipeline/runner.py) runs each call on this process's device; the in-process runtime's runs each
request inside a GPU call (engine/serving/inprocess.py); the tensor-parallel one broadcasts each operation
to every rank (engine/tp/runner.py). The runner is built of parts: `ModeRules` (the modes an engine
runs) here, `RequestPrep` and `CallRun` (engine/pipeline/callrun.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from engine import devices
from engine.errors import UnsupportedCombination
from engine.pipeline import memory, recipes
from engine.protocol import BucketInfo, BucketKey, GenerateRequest, GenerateResult, Mode


class Executor(Protocol):
    """What runs an engine's work: one request, requests sharing one call (engine/pipeline/batchrun.py says
    what each gets), and a bucket's compile and warm-up."""

    def generate(self, request: GenerateRequest, on_step=None, cancel: threading.Event | None = None
                 ) -> GenerateResult: ...

    def generate_batch(self, requests: list[GenerateRequest], on_step=None,
                       cancels: list[threading.Event] | None = None, on_leave=None, on_result=None) -> list: ...

    def warm_bucket(self, bucket: BucketKey) -> BucketInfo: ...


class ModeRules:
    """The modes an engine runs: its device's, minus what its options, memory levers, precision and layout
    rule out, and what its runtime refuses (`refused`: mode -> why)."""

    def __init__(self, config, spec, precision, refused: Callable[[Mode], str] | None = None):
        self.config, self.spec, self.precision = config, spec, precision
        self.refused = refused
        self._notices: dict[Mode, tuple[str, ...]] = {}

    def modes(self) -> tuple[Mode, ...]:
        return tuple(m for m in self.spec.modes if not self.excluded(m))

    def excluded(self, mode: Mode) -> str:
        """Why `mode` is ruled out ("" when it is not)."""
        if self.refused is not None and (why := self.refused(mode)):
            return why
        options, key = self.config.options, self.config.key
        if why := recipes.excluded_mode(options, mode) or memory.excluded_mode(key.memory, mode):
            return why
        if mode is Mode.AOT and self.precision.precision.quantized:
            # torch.export unwraps torchao's quantized tensors into parametrizations the package then looks
            # up by name on the engine's own (still quantized) model, where they do not exist.
            return (f"{self.precision.precision} weights are torchao tensor subclasses, which an aot package cannot "
                    "take from the engine's model (export unwraps them into other tensors)")
        if mode is Mode.AOT and self.config.preset.video:
            return "aot packages are exported per image bucket; a video bucket (size x frames) compiles or is regional"
        if mode is Mode.AOT and key.tp > 1:
            return "a tensor-parallel engine's weights are sharded DTensors, which aot packages do not take"
        return ""

    def check_mode(self, mode: Mode) -> tuple[str, ...]:
        """The device's notices for `mode`; refused with the reason where this engine cannot run it."""
        if mode in self._notices:  # checked on every request: remember the answer per mode
            return self._notices[mode]
        notices = devices.check_mode(self.spec, mode)
        notices += tuple(recipes.cuda_graphs_notices(self.config.options, self.spec, Mode.parse(mode, "mode")))
        if mode not in self.modes():
            raise UnsupportedCombination(
                f"mode {mode!r} is not available on this engine ({self.config.key}): "
                f"{self.excluded(Mode.parse(mode, 'mode'))}, so only {', '.join(self.modes())} can run"
            )
        self._notices[mode] = notices
        return notices
