"""Test-only faults, read in one place per process: the runner's `Faults`, built from `EngineOptions.testing`.

Production code asks it where each fault can happen and reads no flag of its own: the runner asks
`take(Fault.OOM)` before a run and `should_fail_compile()` where it compiles (aot builds included); the
worker loop (rank 0 of a tensor-parallel sidecar too) asks `take(Fault.CRASH)` as a request starts and
`crash()`es at its first step. One-shot faults are armed by `InjectFault` messages (tests send them through
the client protocol), which `arm` refuses unless the engine was started with `inject_faults`; the app and the
CLI never start one so, and nothing in a request arms one.
"""

from __future__ import annotations

import os
import threading
from typing import NoReturn

from engine.errors import InvalidRequest
from engine.protocol import Fault, RankExit, TestingOptions

COMPILE_FAILURE = "injected compile failure"


def failing_backend(graph_module, example_inputs):
    """The torch.compile backend under `fail_compiles`: every compile fails."""
    raise RuntimeError(COMPILE_FAILURE)


class Faults:
    def __init__(self, testing: TestingOptions | None = None) -> None:
        self.testing = testing or TestingOptions()
        self._armed: set[Fault] = set()
        self._lock = threading.Lock()

    def arm(self, fault: Fault) -> None:
        """Arm a one-shot fault; InvalidRequest where this engine takes none."""
        if not self.testing.inject_faults:
            raise InvalidRequest("fault injection is off in this engine")
        with self._lock:
            self._armed.add(Fault(fault))

    def take(self, fault: Fault) -> bool:
        """True once after `arm(fault)`: the caller then produces the fault."""
        with self._lock:
            if fault in self._armed:
                self._armed.discard(fault)
                return True
            return False

    def should_fail_compile(self) -> bool:
        return self.testing.fail_compiles

    @staticmethod
    def crash() -> NoReturn:
        """Fault.CRASH: the process dies mid-request."""
        os._exit(RankExit.INJECTED_CRASH)
