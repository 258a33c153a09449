"""The app as a measuring command starts it: a subprocess of app.py on a free loopback port, in its own process
group, its output in a log file; stopped with SIGTERM and checked for orphans (every process it started must be
gone within 10 s of the signal), then its group killed whatever the verdict. The soak and the load bench use
it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine import settings
from engine.processes import pid_alive, process_tree

REPO = settings.REPO_ROOT
GRACE_S = 10.0  # a process the app started has this long from SIGTERM to be gone
APP_EXIT_S = 15.0  # how long the app itself is given to exit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class AppExit:
    """How the app went: seconds from SIGTERM to its exit (or to giving up), whether it exited by itself, and
    the processes still alive `GRACE_S` after the signal."""

    exit_s: float = 0.0
    exited: bool = False
    orphans: list[int] = field(default_factory=list)


class AppProcess:
    """One app subprocess. `args`: app.py's flags after `--port`; `log_path`: where its output goes; `label`
    prefixes the line that says where it listens."""

    def __init__(self, args: list[str], log_path: Path, label: str):
        self.args, self.log_path, self.label = args, Path(log_path), label
        self.process: subprocess.Popen | None = None
        self.url = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self) -> None:
        port = free_port()
        argv = [sys.executable, str(REPO / "app.py"), "--port", str(port), *self.args]
        env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - the app writes to it while it lives
        # Its own process group (the orphan check kills the group), in the caller's session: where Linux's
        # autogroup scheduling is on, CPU is shared between sessions first, and a probe that stands in for a
        # browser on another machine would queue for a core behind the app's own compile thread.
        self.process = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, process_group=0)
        self.url = f"http://127.0.0.1:{port}/"
        print(f"[{self.label}] app pid {self.process.pid} at {self.url} (log {self.log_path})", flush=True)

    def gone(self) -> bool:
        """The app was started here and has exited (False in a process that did not start it)."""
        return self.process is not None and self.process.poll() is not None

    def connect(self, make, timeout_s: float):
        """`make()` once the app answers (it raises until then); an error naming the log when the app exits or
        `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return make()
            except Exception:
                if self.gone() or time.monotonic() > deadline:
                    raise RuntimeError(f"the app at {self.url} did not come up; see {self.log_path}") from None
                time.sleep(0.5)

    def stop(self, seen: set[int] = frozenset()) -> AppExit:
        """SIGTERM, then the verdict: `seen` are pids of the app's tree seen while it ran (a sampler's), added to
        the tree as it is now."""
        result = AppExit()
        if self.process is None:
            return result
        app = self.process
        children = (set(seen) | set(process_tree(app.pid))) - {app.pid}
        start = time.monotonic()
        if app.poll() is None:
            app.send_signal(signal.SIGTERM)
        try:
            app.wait(timeout=APP_EXIT_S)
        except subprocess.TimeoutExpired:
            pass
        result.exit_s = time.monotonic() - start
        result.exited = app.poll() is not None
        while time.monotonic() - start < GRACE_S and any(pid_alive(pid) for pid in children):
            time.sleep(0.1)
        result.orphans = sorted(pid for pid in children if pid_alive(pid))
        if not result.exited:
            result.orphans.append(app.pid)
        try:
            os.killpg(app.pid, signal.SIGKILL)  # leave nothing behind, whatever the verdict
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()
        return result
