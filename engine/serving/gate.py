"""The gate: every Generate is checked here, once, before anything runs.

`Gate.admit(spec)` resolves the engine key (the visitor's choices checked against what a public host
offers), validates the request and routes its size to a bucket (`build_request`), refuses what the key's
device or runtime cannot run, and prices a visitor's request from the request it built. What it returns,
an `Admitted`, is what the manager runs and what the worker trusts: nothing after the gate checks these
again (the worker asserts the invariants; it checks only what its engine alone knows: the modes its
options leave it, its LoRA adapters).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from engine import devices
from engine.config.request import Caller, ImageRequest
from engine.config.resolve import Catalog
from engine.config.validation import build
from engine.pipeline import stepcache
from engine.protocol import EngineKey, GenerateRequest, Mode, ModelPreset
from engine.serving import cost, fit, policy
from engine.serving.admission import Ticket
from engine.serving.hosting import HostPolicy, Runtime
from engine.worker.client import EngineClient


@dataclass(frozen=True)
class Admitted:
    """One Generate as the gate let it through: its engine's key, the worker's request (validated, at its
    bucket, its uploads decoded and fitted), the notices to show with its result, its price in token-steps (0:
    not priced, or a Compare's `ticket` holds it; `decode_cost` of it: decoding the uploads), who asked."""

    key: EngineKey
    request: GenerateRequest
    notices: tuple[str, ...]
    price: int
    caller: Caller
    ticket: Ticket | None = None
    decode_cost: int = 0

    def images(self, n: int) -> list[Admitted]:
        """n images of this request (seed, seed + 1, ...), each its own request id, sharing the one decode of the
        uploads (priced with the first): what one /v1 call of n images runs, admitted once."""
        request = self.request
        return [self] + [dataclasses.replace(self, price=self.price - self.decode_cost, decode_cost=0,
                                             request=request.replace(seed=request.seed + i,
                                                                     request_id=uuid.uuid4().hex[:12]))
                         for i in range(1, n)]

    def labels(self) -> dict:
        """The telemetry labels of this request (engine, mode, bucket)."""
        return {"engine": str(self.key), "mode": str(self.request.mode), "bucket": str(self.request.bucket.size)}


class Gate:
    """The checks of a request, made once. Takes what it reads: the catalog (presets, keys), the memory
    levers, the host's policy (read at each call: the bench may swap it for a run), the runtime, the engine
    loaded for a key (a visitor's aot request), and where a refusal is counted (`refused(labels, error=...)`)."""

    def __init__(self, catalog: Catalog, levers: fit.EngineLevers, host_policy: Callable[[], HostPolicy],
                 runtime: Runtime, loaded: Callable[[EngineKey], EngineClient | None],
                 refused: Callable[..., None]):
        self.catalog, self.levers, self.host_policy, self.runtime = catalog, levers, host_policy, runtime
        self.loaded, self.refused = loaded, refused

    # -- what a caller may choose ---------------------------------------------------------------------
    def priced(self, caller: Caller) -> bool:
        """Whether this caller's requests are priced against the host's cost budgets (visitors, public mode)."""
        return caller is Caller.VISITOR and self.host_policy().public

    def visitor_presets(self) -> list[str]:
        """The presets visitors may pick (public mode: the host's list)."""
        return policy.visitor_presets(self.host_policy(), self.catalog.presets)

    def check_visitor_choice(self, *, preset=None, precision=None, mode=None) -> None:
        """NotAllowed naming what is offered when a public host does not offer this choice to visitors."""
        policy.check_visitor_choice(self.host_policy(), self.visitor_presets(), preset=preset, precision=precision,
                                    mode=mode)

    def make_key(self, preset: str, device: str, precision: str, tp: int = 1,
                 caller: Caller = Caller.HOST, parallel: str = "tensor", levers: str | None = None) -> EngineKey:
        """Validate and resolve an engine key ("auto" -> the best available device); in public mode a
        visitor may only pick what the host offers. `levers`: memory levers (None: the host's default; their
        engine part goes into the key, refused with the reason where they cannot run)."""
        if caller is Caller.VISITOR:
            self.check_visitor_choice(preset=preset, precision=precision)
        memory = self.levers.wanted(levers, host_decides=caller is Caller.VISITOR and self.host_policy().public)
        key = self.catalog.make_key(preset, device, precision, tp, parallel, memory)
        return self.levers.settle(key, named=levers is not None)

    # -- one Generate -----------------------------------------------------------------------------------
    def admit(self, spec: ImageRequest, ticket: Ticket | None = None) -> Admitted:
        """The request checked, routed and priced, or the ShowcaseError saying what to change (counted as
        refused). `ticket`: the Compare's admission it runs on (charged to its client, priced with it)."""
        seen: dict = {}  # the labels of a refusal, as far as it got
        caller, price, decoding = spec.caller, 0, 0
        try:
            key = self.make_key(spec.preset, spec.device, spec.precision, spec.tp, caller=caller,
                                parallel=spec.parallel, levers=spec.memory)
            seen["engine"] = str(key)
            if caller is Caller.VISITOR:
                self.check_visitor_choice(mode=spec.mode)
            preset = self.catalog.preset(key.preset)
            client = ticket.client if ticket is not None else spec.client
            built = build(preset, spec.replace(client=client))
            request, notices = built.request, built.notices
            seen.update(mode=str(request.mode), bucket=str(request.bucket.size))
            notices += self._check_routable(key, preset, request)
            if self.priced(caller):
                host = self.host_policy()
                if ticket is None:
                    price = cost.check_generate(host.cost, preset, request.size, request.denoise_steps,
                                               request.guidance, request.refs, frames=request.num_frames,
                                               decoded_pixels=built.decoded_pixels)
                    decoding = cost.decode_price(built.decoded_pixels)
                if request.mode is Mode.AOT:
                    policy.check_visitor_aot(host, key, request.bucket, self.loaded(key))
        except BaseException as exc:
            self.refused(seen, error=exc)
            raise
        return Admitted(key, request, tuple(notices), price, caller, ticket, decoding)

    def _check_routable(self, key: EngineKey, preset: ModelPreset, request: GenerateRequest) -> tuple[str, ...]:
        """What the engine's device or runtime cannot run is refused before any engine starts; the step cache's
        notice comes with the result."""
        device = devices.get_device(key.device)
        devices.check_mode(device, request.mode)  # its notices: the engine's own (check_mode, per mode)
        policy.check_runtime(self.runtime, key, request.mode)
        if not request.step_cache.enabled:
            return ()
        return tuple(stepcache.check_step_cache(request.step_cache, preset, device, request.mode))

    def check_images(self, admitted: Admitted, images: int, held: int) -> None:
        """One call's `images` images (each then admitted alone): EngineBusy when together they do not fit the
        visitor's budget now (`held`: token-steps the visitor has queued or running)."""
        if images > 1 and self.priced(admitted.caller):
            together = images * admitted.price - (images - 1) * admitted.decode_cost  # one decode for them all
            cost.check_visitor(self.host_policy().cost, held, together)
