"""Admitting visitors' requests: what one costs (token-steps, engine/serving/cost.py), what each visitor holds
queued and running (public mode's budget) and the Generates in flight per device, which a Compare's next
image yields to."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass

from engine.config.video import route_frames
from engine.errors import InvalidRequest
from engine.protocol import ModelPreset, Size
from engine.serving import cost
from engine.serving.cost import CostBudget

# A Compare's next image waits at most this long while other clients' Generates run on its device, so a
# steady stream of them delays it without stopping it.
COMPARE_YIELD_MAX_S = 30.0


@dataclass(frozen=True)
class Ticket:
    """A visitor's admitted cost (manager.admission): held until the block that took it ends. A Compare
    takes one for all its images; each image's generate() then runs on it instead of its own."""

    client: str
    cost: int


def price_compare(budget: CostBudget, preset: ModelPreset, size, steps: int, configurations: int, prompts: int,
                  guidance=None, num_frames=None) -> int:
    """A Compare's price in token-steps, or NotAllowed saying what fits; a video preset's clips priced at the frame
    bucket `num_frames` routes to (engine/config/video.py)."""
    size = size if isinstance(size, Size) else Size.parse(size) if size else preset.buckets[0]
    if guidance is not None and str(guidance).strip() != "":
        try:
            guidance = float(guidance)
        except (TypeError, ValueError):
            raise InvalidRequest(f"guidance must be a number, got {guidance!r}") from None
    else:
        guidance = None
    frames = route_frames(preset, num_frames)[0] if preset.video else 0
    return cost.check_compare(budget, preset, size, steps, configurations, prompts, guidance, frames)


class RequestFlow:
    """The visitors' held cost and the Generates in flight, under one condition notified when either drops."""

    def __init__(self):
        self._flow = threading.Condition()
        self._held: collections.Counter[str] = collections.Counter()  # visitor -> token-steps queued or running
        self._generates: dict[str, collections.Counter[str]] = {}  # device -> client -> Generates in flight

    @contextlib.contextmanager
    def hold(self, budget: CostBudget, client: str, price: int):
        """Hold `price` against the client's budget while the block runs; EngineBusy at once when it does not fit."""
        with self._flow:
            cost.check_visitor(budget, self._held[client], price)
            self._held[client] += price
        try:
            yield Ticket(client, price)
        finally:
            with self._flow:
                self._held[client] -= price
                if self._held[client] <= 0:
                    del self._held[client]

    def held(self, client: str) -> int:
        with self._flow:
            return self._held.get(client, 0)

    @contextlib.contextmanager
    def generate_in_flight(self, device: str, client: str):
        with self._flow:
            self._generates.setdefault(device, collections.Counter())[client] += 1
        try:
            yield
        finally:
            with self._flow:
                flights = self._generates[device]
                flights[client] -= 1
                if flights[client] <= 0:
                    del flights[client]
                self._flow.notify_all()

    def yield_to_generates(self, device: str, client: str) -> float:
        """Wait while other clients' Generates are queued or running on `device` (at most COMPARE_YIELD_MAX_S);
        returns the seconds waited."""
        start = time.monotonic()
        deadline = start + COMPARE_YIELD_MAX_S
        with self._flow:
            while any(n > 0 for c, n in self._generates.get(device, {}).items() if c != client):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._flow.wait(left)
        return time.monotonic() - start
