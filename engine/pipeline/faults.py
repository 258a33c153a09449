"""Test-only fault hooks: one-shot faults armed from outside, never triggered by request content.

An engine started with `EngineOptions(fault_injection=True)` accepts `InjectFault` messages (tests
send them through the same client protocol); the runner and the worker ask `take(fault)` at the one
place each fault can happen. Engines started by the app or the CLI refuse those messages.
"""

from __future__ import annotations

import threading

from engine.protocol import Fault


class FaultHooks:
    def __init__(self) -> None:
        self._armed: set[Fault] = set()
        self._lock = threading.Lock()

    def arm(self, fault: Fault) -> None:
        with self._lock:
            self._armed.add(Fault(fault))

    def take(self, fault: Fault) -> bool:
        """True once after `arm(fault)`: the caller then produces the fault."""
        with self._lock:
            if fault in self._armed:
                self._armed.discard(fault)
                return True
            return False
