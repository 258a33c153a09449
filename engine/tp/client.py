"""The app's side of the tensor-parallel sidecar: `SidecarClient(config).start()` is a ConnectionClient.

start() checks up front that the model splits N ways (when it is on local disk), writes a per-launch HMAC
token and the engine config into a private folder (0700 folder, 0600 files: nothing secret on a command
line), starts `torchrun` in its own session (engine/tp/launch.py builds argv and environment; no shell),
and returns at once; a thread connects to rank 0's loopback socket as soon as rank 0 listens. From then on
it is the ordinary worker protocol, so the manager, the board, the bench and the CLI cannot tell it from a
single-device worker.

Faults: if a rank dies, torchrun tears the group down (rank 0 usually first reports EngineCrashed for the
request in flight), rank 0's socket closes, the reader sees EOF and the engine goes "down" with torchrun's
root cause (which rank, which exit code/signal) and the log path; the manager restarts it. close() asks
for a clean shutdown, then SIGTERMs torchrun's process group (torchrun forwards it to the ranks, which run
in their own sessions), then SIGKILLs whatever is left; ranks also exit by themselves when torchrun or the
app is gone (engine/tp/group.py watch_parents).

By hand: `python -m engine.tp.client ADDRESS_FILE --prompt ...` talks to a sidecar started with
`python -m engine.tp.sidecar` (it prints the address file); `app.py --tp-address ADDRESS_FILE` serves one
(engine/tp/attach.py), on one machine or spanning several (engine/tp/nodes.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import field
from pathlib import Path

from engine import devices
from engine.config.flags import add_fields, from_args
from engine.config.resolve import resolve_source
from engine.errors import EngineCrashed, InvalidRequest, ModelLoadError, ShowcaseError
from engine.protocol import GenerateRequest, Mode, OnCold, RankExit, Size, params
from engine.protocol.flagfields import POSITIONAL, SWITCH, flag
from engine.tp import launch
from engine.tp.tokens import new_token, write_private
from engine.worker.client import ConnectionClient, EngineEvents

log = logging.getLogger(__name__)

KEEP_LOGS = 20


_FAILURE_FIELD = re.compile(r"^\s*(rank|exitcode)\s*:\s*(-?\d+)\b(.*?)$")


def rank_failures(log_text: str) -> list[tuple[int, int]]:
    """(rank, exit code) of every failed rank in torchrun's ChildFailedError report (all sections)."""
    if "FAILED" not in log_text:
        return []
    report = log_text.rsplit("FAILED", 1)[1]
    found: dict[int, int] = {}
    rank = None
    for line in report.splitlines():
        m = _FAILURE_FIELD.match(line)
        if not m:
            continue
        if m.group(1) == "rank":
            rank = int(m.group(2))
        elif rank is not None:
            found.setdefault(rank, int(m.group(2)))
            rank = None
    return sorted(found.items())


def _consequence(code: int) -> str | None:
    """What a rank did because *another* rank failed (RankExit.consequence), None for a root cause."""
    try:
        return RankExit(code).consequence
    except ValueError:
        return None


def root_cause(log_text: str) -> str | None:
    """Which rank failed and how, the real cause first: torchrun's own "first observed failure" often
    names rank 0, which only exited because another rank had died."""
    failures = rank_failures(log_text)
    if not failures:
        return None

    def describe(rank: int, code: int) -> str:
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"rank {rank} was killed by {name}"
        consequence = _consequence(code)
        if consequence:
            return f"rank {rank} {consequence} (exit code {code})"
        return f"rank {rank} exited with code {code}"

    ordered = sorted(failures, key=lambda f: (_consequence(f[1]) is not None, f[0]))
    return "; ".join(describe(rank, code) for rank, code in ordered)


class SidecarClient(ConnectionClient):
    """One tensor-parallel engine: torchrun with key.tp ranks, rank 0 behind an authenticated socket."""

    kind = "tp-sidecar"

    def __init__(
        self,
        config,
        *,
        nnodes: int = 1,
        rdzv_endpoint: str | None = None,
        dump_dir: str | Path | None = None,
        dist_timeout: float | None = None,
        connect_timeout: float = 300.0,
        env: dict[str, str] | None = None,
        events: EngineEvents | None = None,
    ):
        super().__init__(config.key, events)
        self.config = config
        self.nnodes = nnodes
        self.rdzv_endpoint = rdzv_endpoint
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.dist_timeout = dist_timeout
        self.connect_timeout = connect_timeout
        self.extra_env = dict(env or {})
        self.process: subprocess.Popen | None = None
        self.workdir: Path | None = None
        self.log_path: Path | None = None
        self._log_file = None
        self._token = b""
        self._exit_note: str | None = None

    # -- launch ----------------------------------------------------------------------------------
    def plan_launch(self) -> tuple[list[str], dict[str, str]]:
        """argv and environment for this node's ranks (no process is started)."""
        spec = devices.get_device(self.key.device)
        tp = self.key.tp
        if self.nnodes < 1 or tp % self.nnodes:
            raise InvalidRequest(f"tp={tp} ranks cannot be spread evenly over {self.nnodes} nodes")
        assert self.workdir is not None
        args = [
            "--config", str(self.workdir / "config.pkl"),
            "--device", spec.name,
            "--address-file", str(self.workdir / "address.json"),
            "--parent-pid", str(os.getpid()),
        ]
        if self.dump_dir is not None:
            args += ["--dump-dir", str(self.dump_dir)]
        if self.dist_timeout:
            args += ["--dist-timeout", str(self.dist_timeout)]
        argv, env = launch.build_launch(
            spec, launch.NodeLayout(tp // self.nnodes, self.nnodes, rdzv=self.rdzv_endpoint),
            cache_dir=self.config.cache_path(), sidecar_args=args, warm_modes=self.config.options.warm_modes,
        )
        env.update(self.extra_env)
        env[launch.TOKEN_FILE_VAR] = str(self.workdir / "token")
        return argv, env

    def start(self) -> SidecarClient:
        from engine.tp.plan import check_layout_if_local

        spec = devices.get_device(self.key.device)
        launch.check_tp_device(spec)
        check_layout_if_local(self.config.preset, resolve_source(self.config), self.key.tp, self.key.parallel,
                              self.config.options.attention_backend, spec)
        self.workdir = Path(tempfile.mkdtemp(prefix="showcase-tp-"))  # 0700
        self._token = new_token()
        write_private(self.workdir / "token", self._token)
        write_private(self.workdir / "config.pkl", pickle.dumps(self.config))
        argv, env = self.plan_launch()
        self.log_path = self._new_log_path()
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - torchrun writes to it for its lifetime
        log.info("starting tensor-parallel sidecar %s: %s (log %s)", self.key, argv, self.log_path)
        self.process = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            # Its own process group (killpg on close, no terminal signals) in the app's session: a session
            # of its own would be a scheduling autogroup of its own (see engine.worker.loop.join_own_process_group).
            process_group=0,
        )
        threading.Thread(target=self._connect, name=f"tp-connect-{self.key}", daemon=True).start()
        return self

    def _new_log_path(self) -> Path:
        folder = self.config.cache_path() / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(self.key)).strip("-")
        old = sorted(folder.glob("tp-*.log"), key=lambda p: p.stat().st_mtime)
        for path in old[: max(0, len(old) - KEEP_LOGS + 1)]:
            path.unlink(missing_ok=True)
        return folder / f"tp-{slug}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(2)}.log"

    def _connect(self) -> None:
        from multiprocessing import AuthenticationError
        from multiprocessing.connection import Client

        address_file = self.workdir / "address.json"
        deadline = time.monotonic() + self.connect_timeout
        while not self._closed:
            if address_file.exists():
                try:
                    info = json.loads(address_file.read_text())
                    conn = Client((info["host"], int(info["port"])), authkey=self._token)
                except (OSError, ValueError, KeyError, AuthenticationError) as exc:
                    self._fail_start(EngineCrashed(f"could not connect to the sidecar's rank 0: {exc}"))
                    return
                self.attach(conn)
                return
            if self.process.poll() is not None:
                self._fail_start(ModelLoadError(
                    f"tensor-parallel sidecar {self.key} exited before rank 0 listened ({self.describe_exit()})"))
                return
            if time.monotonic() > deadline:
                self._fail_start(EngineCrashed(
                    f"tensor-parallel sidecar {self.key}: rank 0 did not listen within {self.connect_timeout:.0f}s "
                    f"(log: {self.log_path})"))
                self._stop_process()
                return
            time.sleep(0.05)

    def _fail_start(self, error) -> None:
        if self.error is None and not self._closed:
            self.error = error
        self.ready.set()
        self._reap()

    # -- state -----------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return super().alive and self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def rank_pids(self) -> list[int]:
        return list(self.info.rank_pids) if self.info else []

    def describe_exit(self) -> str:
        if self._exit_note is not None:
            return self._exit_note
        if self.process is None:
            return "never started"
        try:
            code = self.process.wait(timeout=3)  # torchrun tears the other ranks down, then exits
        except subprocess.TimeoutExpired:
            code = None
        parts = ["the connection to rank 0 closed" if code is None else f"torchrun exited with code {code}"]
        try:
            cause = root_cause(self.log_path.read_text(errors="replace")) if self.log_path else None
        except OSError:
            cause = None
        if cause:
            parts.append(cause)
        parts.append(f"log: {self.log_path}")
        self._exit_note = "; ".join(parts)
        return self._exit_note

    def status(self) -> dict:
        status = super().status()
        status.update({
            "tp": self.key.tp,
            "parallel": str(self.key.parallel),
            "nnodes": self.nnodes,
            "pid": self.pid,
            "ranks": list(self.info.ranks) if self.info else [],
            "log": str(self.log_path) if self.log_path else None,
        })
        return status

    # -- shutdown --------------------------------------------------------------------------------
    def _went_down(self) -> None:
        super()._went_down()  # fails pending requests, records why, lets the manager restart
        self._reap()  # a crashed engine is dropped by the manager without close(): clean up here

    def _reap(self) -> None:
        """Make sure nothing of this launch is left: torchrun, its ranks, the private folder, the log handle."""
        if self.process is not None and self.process.poll() is None:
            self._stop_process()
        self._kill_leftover_ranks()
        if self._log_file is not None and not self._log_file.closed:
            self._log_file.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def close(self, timeout: float = 3.0) -> None:
        connected = self.conn is not None
        super().close()  # asks rank 0 for a clean shutdown
        if self.process is not None and self.process.poll() is None:
            if not connected:  # still starting: nobody to ask
                self._stop_process()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._stop_process()
        self.hang_up()
        self._reap()

    def _stop_process(self) -> None:
        """SIGTERM torchrun's process group (torchrun forwards it to the ranks), then SIGKILL."""
        for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
            if self.process.poll() is not None:
                return
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue

    def _kill_leftover_ranks(self) -> None:
        """Ranks run in their own sessions; after torchrun is gone, SIGKILL any of *our* ranks still alive
        (checked by command line, so a reused pid is never hit). They also exit on their own (watch_parents)."""
        for pid in self.rank_pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"engine.tp.sidecar" in cmdline:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def connect(address_file: str | Path, timeout: float = 600.0) -> ConnectionClient:
    """Attach to a sidecar started by hand (`python -m engine.tp.sidecar`): the address file it printed
    names the port and the token file. See engine/tp/attach.py for what each failure says."""
    from engine.tp.attach import connect as attach

    return attach(address_file, timeout)


# `python -m engine.tp.client`: the sidecar to reach and the one request to send it (the request's flags from
# their declarations, engine/protocol/params.py, with this smoke client's defaults).
ClientFlags = dataclasses.make_dataclass("ClientFlags", [
    ("address_file", Path | None, field(default=None, metadata=flag(kind=POSITIONAL, check=Path))),
    *params.cli_fields(("prompt", "size", "steps", "guidance", "seed", "mode"), own={
        "prompt": ("a red fox in the snow", "what to draw (default: a red fox in the snow)"),
        "size": ("64x64", "WIDTHxHEIGHT, a bucket of the sidecar's preset (default: 64x64)"),
        "steps": (4, "denoising steps (default: 4)"),
        "guidance": (3.5, "guidance scale (default: 3.5)")}),
    ("out", str | None, field(default=None, metadata=flag("write the PNG here"))),
    ("shutdown", bool, field(default=False, metadata=flag(
        "stop the sidecar afterwards (default: leave it serving)", kind=SWITCH))),
], frozen=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.tp.client",
                                description="Send one request to a sidecar started with python -m engine.tp.sidecar")
    add_fields(p, ClientFlags)
    args = from_args(ClientFlags, p.parse_args(argv))
    try:
        engine = connect(args.address_file)
        size = Size.parse(args.size)
        mode = Mode.parse(args.mode, "mode")
        result = engine.generate(GenerateRequest.checked(prompt=args.prompt, width=size.width, height=size.height,
                                                 steps=args.steps, guidance=args.guidance, seed=args.seed,
                                                 mode=mode, on_cold=OnCold.WAIT))
    except ShowcaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict()))
    if args.out:
        Path(args.out).write_bytes(result.image_png)
    if args.shutdown:
        engine.shutdown_sidecar()  # asks the sidecar to exit
    else:
        engine.close()  # just disconnect: a sidecar started by hand waits for the next client
    return 0


if __name__ == "__main__":
    sys.exit(main())
