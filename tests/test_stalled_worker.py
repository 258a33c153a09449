"""Issue 37: a stopped or stuck worker is detected and its requests fail with a message.

A SIGSTOPped worker hung every request on it for 92 s in the hostile run (it never exits, so its connection
never closes). The manager's watch kills a worker that has requests, says nothing and uses no CPU time for
WORKER_STALL_S; its requests fail naming why, and the engine restarts.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
from helpers import engine_manager, wait_until

from engine.config.request import ImageRequest
from engine.errors import EngineCrashed
from engine.protocol import EngineKey

pytestmark = pytest.mark.slow  # starts a worker process


def test_a_stopped_worker_fails_its_requests_with_the_reason_and_restarts(cache_dir, tiny_models, monkeypatch):
    import engine.serving.manager as manager_module

    monkeypatch.setattr(manager_module, "WORKER_STALL_S", 3.0, raising=False)
    with engine_manager(cache_dir) as manager:
        spec = dict(prompt="a red circle on a blue background", preset="tiny-shapes", device="cpu",
                    precision="fp32", mode="eager", size="64x64")
        manager.generate(ImageRequest(**spec, steps=2))  # the engine is up
        engine = manager.engine(EngineKey("tiny-shapes", "cpu", "fp32"))
        pid = engine.pid
        outcome: list = []

        def run():
            try:
                outcome.append(manager.generate(ImageRequest(**spec, steps=200, width=128, height=128)))
            except Exception as exc:  # noqa: BLE001 - what the test reads
                outcome.append(exc)

        threading.Thread(target=run, daemon=True).start()
        wait_until(engine.pending, 60)
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: outcome, 60, message="the request on the stopped worker never ended")
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert isinstance(outcome[0], EngineCrashed), outcome[0]
        assert "stuck" in str(outcome[0]) and "stopped" in str(outcome[0]), outcome[0]
        wait_until(lambda: manager.engine(EngineKey("tiny-shapes", "cpu", "fp32")).pid != pid, 60)
        assert manager.generate(ImageRequest(**spec, steps=2)).image is not None  # restarted, serving



def test_a_worker_whose_compilers_come_and_go_is_not_taken_for_stuck():
    """A worker compiling runs one C++ compiler after another: a long one, then short ones. Each one's CPU time
    still counts once it exits (its parent reaped it), so the worker never looks quiet because a compiler
    ended (the live processes' sum fell by the long one's time, and the short ones took seconds to pass it)."""
    import subprocess
    import sys

    from helpers import poll

    from engine.worker.client import ProcessClient

    def burn(seconds: float) -> str:
        return f"import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass"

    steps = [burn(2.0)] + [burn(0.1)] * 40
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys\n"
                               f"for code in {steps!r}:\n    subprocess.run([sys.executable, '-c', code])"])

    class Compiling(ProcessClient):  # the watch's view of a worker with one request and nothing to say
        def __init__(self):
            self._cpu_seen, self.last_heard = None, 0.0

        pid = property(lambda self: parent.pid)
        alive = property(lambda self: parent.poll() is None)

        def pending(self) -> int:
            return 1

    watched = Compiling()
    try:
        said = poll(lambda: watched.stalled(1.5) or (parent.poll() is not None and "ended"), timeout=20.0,
                    interval=0.1)
        assert not said or said == "ended", said
    finally:
        parent.kill()
        parent.wait()
