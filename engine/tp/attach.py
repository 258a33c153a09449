"""The app serving a sidecar it did not start: `app.py --tp-address FILE` (and `python -m engine.tp.client`).

A host starts the sidecar itself, one command per node (engine/tp/nodes.py); node 0's rank 0 writes the
address file (where it listens, which 0600 file holds the token, how it was started). The app reads that
file, dials rank 0, authenticates with the token and serves the engine through `EngineManager.adopt`: same
board, timings, cancel, compare and budget as any engine, but the app never restarts, evicts or stops it
(closing only disconnects; the sidecar then waits for the next app).

Every way it can fail says what to do: no address file, the sidecar still starting, connection refused
("not running: start it with <the command from the address file>"), a token that does not match (names the
token file), another app already attached (EngineBusy from the sidecar). `SidecarAttacher` keeps trying in
the background: when the sidecar goes down, the board shows it down with the reason the sidecar sent, the
app keeps serving its other engines, and it re-attaches by itself once the host restarts the sidecar (the
address file is read again each time, so a new port and a new token are picked up).
"""

from __future__ import annotations

import logging
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path

from engine.errors import EngineCrashed, InvalidRequest, ShowcaseError
from engine.protocol import EngineKey, RequestFailed
from engine.tp.tokens import read_address_info, read_token, token_path_for
from engine.worker.client import ConnectionClient

log = logging.getLogger(__name__)

RETRY_S = 2.0
READY_TIMEOUT_S = 3600.0  # a big model's shards load for minutes; rank 0 answers Ready after that


class SidecarNotRunning(ShowcaseError):
    """Nothing answers at the address the sidecar wrote (or it has not written one yet)."""


class SidecarTokenRefused(ShowcaseError):
    """The token file named by the address file does not open this sidecar."""


def start_hint(info: dict, address_file: Path) -> str:
    """How to start the sidecar again: the commands its launcher recorded in the address file."""
    command = info.get("command")
    if not command:
        return f"python -m engine.tp.sidecar ... --address-file {address_file} (see --help)"
    text = shlex.join(command)
    others = info.get("node_commands") or {}
    for node in sorted(others, key=int):
        text += f"; on node {node}: {shlex.join(others[node])}"
    return text


def dial_sidecar(address_file: str | Path, timeout_s: float = 10.0):
    """(authenticated connection, address info) to the rank 0 an address file names, or a ShowcaseError that
    says what to do."""
    from multiprocessing import AuthenticationError

    from engine.worker.wire import dial

    path = Path(address_file)
    if not path.exists():
        raise SidecarNotRunning(f"no sidecar address file at {path}: start the sidecar with --address-file {path} "
                                "(python -m engine.tp.sidecar --help)")
    info = read_address_info(path)
    host, port = info.get("host"), info.get("port")
    if info.get("state") == "starting" or not host or not port:
        raise SidecarNotRunning(f"the sidecar of {path} is starting (its nodes are joining, or rank 0 does not listen "
                                "yet); the app attaches as soon as it listens")
    address = f"{host}:{port}"
    if info.get("state") == "stopped":  # its launcher said so on the way out (a killed one cannot: see below)
        reason = f" (it stopped: {info['reason']})" if info.get("reason") else ""
        raise SidecarNotRunning(f"the sidecar at {address} is not running{reason}: start it with: "
                                f"{start_hint(info, path)}")
    token_path = token_path_for(path, info)
    try:
        token = read_token(token_path, private=False) if token_path else b""
    except InvalidRequest as exc:
        raise SidecarTokenRefused(f"cannot use the sidecar's token file {token_path} (named by {path}): {exc}; "
                                  "it is written when the sidecar starts, and removed when it stops") from None
    try:
        conn = dial(str(host), int(port), token, timeout_s)
    except ConnectionRefusedError:
        raise SidecarNotRunning(f"the sidecar at {address} is not running: start it with: "
                                f"{start_hint(info, path)}") from None
    except AuthenticationError:
        raise SidecarTokenRefused(
            f"the sidecar at {address} refused the token in {token_path} (HMAC authentication failed): that file is "
            f"not this sidecar's token (a stale address file or a token from another launch); use the address file "
            f"the running sidecar wrote ({path} is rewritten at every start)") from None
    except (OSError, EOFError) as exc:
        raise SidecarNotRunning(f"the sidecar at {address} cannot be reached ({type(exc).__name__}: {exc}); "
                                f"is it running? start it with: {start_hint(info, path)}") from None
    return conn, info


class AttachedSidecarClient(ConnectionClient):
    """A sidecar the app attached to. Closing it disconnects; it never asks the sidecar to shut down."""

    kind = "tp-sidecar"
    evictable = False  # it belongs to whoever started it: never evicted or restarted by the app

    def __init__(self, address_file: str | Path, info: dict):
        super().__init__(EngineKey.unknown())  # the real key arrives with Ready
        self.address_file = Path(address_file)
        self.address_info = info
        self.address = f"{info.get('host')}:{info.get('port')}"
        self.last_failure: str | None = None  # the sidecar's own words for the last broken request

    def _on_error(self, message: RequestFailed) -> None:
        if isinstance(message.error, EngineCrashed):
            self.last_failure = str(message.error)
        super()._on_error(message)

    @property
    def key(self) -> EngineKey:
        return self.info.key if self.info is not None else self._key

    def describe_exit(self) -> str:
        text = f"the connection to the sidecar at {self.address} closed"
        return f"{text}: {self.last_failure}" if self.last_failure else text

    @property
    def pid(self) -> int | None:
        return self.info.pid if self.info else None

    def rank_pids(self) -> list[int]:
        return list(self.info.rank_pids) if self.info else []

    def status(self) -> dict:
        status = super().status()
        ranks = list(self.info.ranks) if self.info else []
        status.update({
            "tp": self.key.tp,
            "nnodes": len({r.get("node", 0) for r in ranks}) or None,
            "pid": self.pid,
            "ranks": ranks,
            "attached": True,
            "address": self.address,
            "address_file": str(self.address_file),
        })
        return status

    def close(self, timeout: float | None = None) -> None:
        """Disconnect (the sidecar belongs to whoever started it; it waits for the next app)."""
        self._closed = True
        self.hang_up()

    def shutdown_sidecar(self) -> None:
        """Ask the sidecar itself to stop (the by-hand client's --shutdown)."""
        ConnectionClient.close(self)


def connect(address_file: str | Path, timeout: float = 600.0) -> AttachedSidecarClient:
    """Attach to a running sidecar and wait until it is ready. Raises ShowcaseError saying what to do
    (not running, wrong token, another app attached, load failed)."""
    conn, info = dial_sidecar(address_file)
    engine = AttachedSidecarClient(address_file, info)
    engine.attach(conn)
    try:
        ready = engine.wait_ready(timeout)
    except ShowcaseError:
        engine.close()
        raise
    if not ready:
        engine.close()
        raise SidecarNotRunning(f"the sidecar at {engine.address} accepted the app but was not ready within "
                                f"{timeout:.0f} s (still loading?)")
    return engine


class SidecarAttacher:
    """Keeps one sidecar attached to a manager: attach, hand the engine to `adopt` (the manager's), notice it
    is down, attach again."""

    def __init__(self, adopt: Callable[[AttachedSidecarClient], None], address_file: str | Path,
                 retry_s: float = RETRY_S, ready_timeout_s: float = READY_TIMEOUT_S):
        self.adopt = adopt
        self.address_file = Path(address_file)
        self.retry_s = retry_s
        self.ready_timeout_s = ready_timeout_s
        self.engine: AttachedSidecarClient | None = None
        self.last_error: ShowcaseError | None = None
        self.attached = threading.Event()  # set while an attached engine is up
        self.tried = threading.Event()  # the first attempt is over (attached or not)
        self.attaches = 0
        self._stop = threading.Event()
        self._said: str | None = None

    def attach_once(self) -> AttachedSidecarClient:
        engine = connect(self.address_file, timeout=self.ready_timeout_s)
        if self._stop.is_set():  # the app is shutting down: do not hand the manager a new engine
            engine.close()
            raise SidecarNotRunning("the app is shutting down")
        self.adopt(engine)
        return engine

    def start(self) -> SidecarAttacher:
        threading.Thread(target=self._run, name="tp-attach", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()  # kept: the thread's own stop event, not a part; callers need no Event of ours

    def wait_attached(self, timeout: float) -> AttachedSidecarClient | None:
        """The engine once attached; None when the first attempt failed or `timeout` passed (still loading)."""
        self.tried.wait(timeout)
        return self.engine if self.attached.is_set() else None

    def _say(self, text: str) -> None:
        if text != self._said:  # each new state once, not every retry
            self._said = text
            print(f"[tp attach] {text}", flush=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            current = self.engine
            if current is not None and current.alive:
                self._stop.wait(self.retry_s / 2)
                continue
            if current is not None and self.attached.is_set():
                self.attached.clear()
                why = current.error or EngineCrashed(f"engine {current.key} stopped: {current.describe_exit()}")
                # The board keeps showing it, down, with the reason and what happens next.
                current.error = EngineCrashed(f"{why}; the app re-attaches when the sidecar at "
                                              f"{current.address} is back")
                self._say(f"the sidecar {current.key} at {current.address} is down: {why}")
            try:
                engine = self.attach_once()
            except ShowcaseError as exc:
                self.last_error = exc
                self._say(f"cannot attach to the sidecar of {self.address_file}: {exc}")
                self.tried.set()
                self._stop.wait(self.retry_s)
                continue
            self.engine, self.last_error = engine, None
            self.attaches += 1
            self.attached.set()
            self.tried.set()
            nodes = len({r.get("node", 0) for r in engine.info.ranks}) or 1
            self._say(f"{'re-' if self.attaches > 1 else ''}attached to the tensor-parallel sidecar {engine.key} at "
                      f"{engine.address} ({engine.key.tp} ranks on {nodes} node(s)) at {time.strftime('%H:%M:%S')}")
