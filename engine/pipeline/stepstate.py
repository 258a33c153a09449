"""A stepped request between its steps (engine/pipeline/stepping.py): its own module, so the families' step
functions and the stepper both import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.protocol import GenerateRequest, Pause


@dataclass
class StepState:
    """One request between its steps: its run copy (with its own scheduler), latents, timesteps and the
    step it is at; `own` are its per-sample denoiser inputs, `shared` the bucket's (equal for every request
    that can share its call). The rest is the engine's bookkeeping: its clock, notices, pauses and the batch
    size of each step."""

    request: GenerateRequest
    run: object
    latents: object
    timesteps: list
    own: dict
    shared: dict
    index: int = 0
    clock: object = None
    notices: list[str] = field(default_factory=list)
    eager_fallback: bool = False
    key: tuple = ()  # which states can share a step (the variant, the step function's batch key)
    step_batches: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # each step's own time, pauses left out
    recompiles: int = 0  # graphs compiled by the steps it ran in (0 at a warm bucket and batch size)
    pauses: list[Pause] = field(default_factory=list)
    paused_since: float | None = None
    paused_for: set[str] = field(default_factory=set)  # the requests that stepped while it waited

    @property
    def done(self) -> bool:
        return self.index >= len(self.timesteps)

    @property
    def remaining(self) -> int:
        return len(self.timesteps) - self.index

    def nbytes(self) -> int:
        """Device memory the paused request holds: its latents and its own denoiser inputs."""
        tensors = [self.latents, *self.own.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def pause(self, now: float) -> None:
        if self.paused_since is None:
            self.paused_since = now

    def waited_for(self, request_ids) -> None:
        if self.paused_since is not None:
            self.paused_for.update(request_ids)

    def resume(self, now: float) -> None:
        """Runs again: the pause is recorded (the steps' own times leave it out; the total keeps it)."""
        if self.paused_since is None:
            return
        if self.paused_for:
            self.pauses.append(Pause(after_step=self.index, ms=(now - self.paused_since) * 1000,
                                     for_requests=len(self.paused_for)))
        self.paused_since, self.paused_for = None, set()
