"""torchrun command lines and environments for the tensor-parallel sidecar (pure functions).

Nothing here starts a process, probes a device or imports a vendor package (a device that needs launch
variables, like tpu, supplies them through its spec's `launch_env`, whose vendor function can be
injected), so tests check the argv and the environment for every device without hardware.

argv is always a list for `subprocess.Popen(argv)` without a shell. The few values a user can choose
(rank count, node count, node rank, rendezvous endpoint) are validated here before they reach argv.

Single node: `--standalone` (a private c10d rendezvous on a free port, so several sidecars and test runs
never collide). Several nodes: the *static* rendezvous (`--rdzv-backend static --rdzv-endpoint HOST:PORT
--node-rank K`), because it honours --node-rank: global rank 0 — the one that serves the socket — is always
on node 0. Static rendezvous is a TCPStore that node 0's torchrun hosts on the endpoint's port; it waits
`--rdzv-conf timeout=S` seconds (torchrun's default: 900) for every node's torchrun to connect, then fails
with "Timed out after S seconds waiting for clients. J/N clients joined" (the sidecar's `--join-timeout`
sets S and names the missing nodes). `sidecar_command(...)` is the one command to run on node K.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine import devices
from engine.errors import InvalidRequest, UnsupportedCombination
from engine.tp.torchrun import STORE_HOST_FLAG, STORE_HOST_VAR

SIDECAR_MODULE = "engine.tp.sidecar"
TORCHRUN_MODULE = "engine.tp.torchrun"
LOOPBACK = "127.0.0.1"
# Rank 0 reads the per-launch token from this file (0600); the token never appears on a command line.
TOKEN_FILE_VAR = "SHOWCASE_TP_TOKEN_FILE"
# How often torchrun checks its ranks: a dead rank tears the group down within about this long.
MONITOR_INTERVAL_S = 0.2
MAX_RANKS = 4096
_ENDPOINT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}[A-Za-z0-9])?):(\d{1,5})$")

# Collective timeout (seconds). Short enough that a wedged collective fails instead of hanging for
# gloo's 30 minutes; longer on static-shape compilers, whose first call of a graph can compile for
# minutes on one rank while the others already wait in its first collective.
DIST_TIMEOUT_S = 180
DIST_TIMEOUT_STATIC_SHAPES_S = 1800
# How long node 0 waits for the other nodes to join (and they for node 0): nodes are started by hand, on
# machines that may still be pulling an image, so minutes; a short one makes a slow node look missing.
JOIN_TIMEOUT_S = 600
# torchrun waits this long (default 30) for ranks to exit after SIGTERM before it SIGKILLs them.
SHUTDOWN_TIMEOUT_S = 5
_HOST = re.compile(r"^(?:[0-9A-Fa-f:.]+|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}[A-Za-z0-9])?)$")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def dist_timeout_s(spec: devices.DeviceSpec) -> int:
    return DIST_TIMEOUT_STATIC_SHAPES_S if spec.static_shapes else DIST_TIMEOUT_S


def check_rdzv_endpoint(endpoint: str) -> str:
    text = str(endpoint).strip()
    m = _ENDPOINT.match(text)
    if not m or not 0 < int(m.group(1)) < 65536:
        raise InvalidRequest(f"rendezvous endpoint {endpoint!r} is not HOST:PORT (e.g. 10.0.0.1:29500)")
    return text


def check_listen_host(host: str) -> str:
    """rank 0's `--listen` interface: an IP address or a host name, nothing a shell or a URL could misread."""
    text = str(host).strip()
    if ":" in text:
        raise InvalidRequest(f"--listen {host!r}: rank 0 listens on IPv4 only; give an IPv4 address or a host name")
    if not text or not _HOST.match(text) or len(text) > 253:
        raise InvalidRequest(f"--listen {host!r} is not an IP address or host name (e.g. 10.0.0.1)")
    return text


def check_join_timeout(seconds) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 1 <= seconds <= 7 * 24 * 3600:
        raise InvalidRequest(f"--join-timeout must be between 1 second and a week, got {seconds!r}")
    return float(seconds)


def check_tp_device(spec: devices.DeviceSpec) -> None:
    if not spec.tensor_parallel or not spec.dist_backend or not spec.mesh_device_type:
        raise UnsupportedCombination(
            f"tensor parallel is not available on {spec.label} [{spec.name}]: no collective backend drives it; "
            "use tp=1 or another device"
        )


def _check_counts(nproc: int, nnodes: int, node_rank: int) -> None:
    for name, value, low in (("nproc", nproc, 1), ("nnodes", nnodes, 1), ("node_rank", node_rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidRequest(f"{name} must be a whole number >= {low}, got {value!r}")
    if nproc * nnodes > MAX_RANKS:
        raise InvalidRequest(f"{nproc} x {nnodes} ranks is more than {MAX_RANKS}")
    if node_rank >= nnodes:
        raise InvalidRequest(f"node_rank {node_rank} must be below nnodes {nnodes}")


def tpu_launch_env(nnodes: int, nproc_per_node: int, set_env: Callable | None = None) -> dict[str, str]:
    """torch_tpu's multi-chip launch variables, os.environ left as it was (see engine.devices.tpu.launch_env;
    `sidecar_environment` asks the spec, so every device's own launch variables are included)."""
    return devices.tpu.launch_env(nnodes, nproc_per_node, set_env)


def sidecar_environment(
    spec: devices.DeviceSpec,
    cache_dir: Path,
    *,
    nproc: int,
    nnodes: int = 1,
    warm_modes: Sequence[str] = (),
    base: Mapping[str, str] | None = None,
    tpu_env: Callable | None = None,
) -> dict[str, str]:
    """The full environment torchrun (and so every rank, before it imports torch) starts with.

    The ranks start once, for all their warm modes, so a mode whose runtime reads a variable at start-up
    (tpu's defer-and-fuse) gets it when it is among `warm_modes`. `tpu_env` replaces the vendor's launch-variable
    function of a device that has one (tests)."""
    mode = next((m for m in warm_modes if spec.mode_environment(m)), None)
    env = devices.worker_environment(spec, Path(cache_dir), mode=mode, base=base)
    env.setdefault("PYTHONUNBUFFERED", "1")  # rank logs reach the sidecar log as they happen
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))  # SIGTERM: ranks gone in seconds
    if nnodes == 1:
        env.setdefault(STORE_HOST_VAR, LOOPBACK)
    env.update(spec.launch_env(nnodes, nproc, set_env=tpu_env))
    return env


def torchrun_argv(
    nproc: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    sidecar_args: Sequence[str] = (),
    python: str | None = None,
    join_timeout: float | None = None,
) -> list[str]:
    _check_counts(nproc, nnodes, node_rank)
    if nnodes > 1 and rdzv_endpoint is None:
        raise InvalidRequest(f"{nnodes} nodes need a rendezvous endpoint HOST:PORT on node 0 (--rdzv-endpoint)")
    if rdzv_endpoint is None:
        store_host = LOOPBACK
    else:  # several nodes: the address the host gave for node 0, never every interface
        store_host = check_rdzv_endpoint(rdzv_endpoint).rsplit(":", 1)[0].strip("[]")
    # torchrun's stores listen on every interface unless told otherwise (engine/tp/torchrun.py).
    argv = [python or sys.executable, "-m", TORCHRUN_MODULE, f"{STORE_HOST_FLAG}{store_host}",
            f"--nproc-per-node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        argv += ["--standalone", f"--local-addr={LOOPBACK}"]  # the ranks meet rank 0's store on loopback
    else:
        argv += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={check_rdzv_endpoint(rdzv_endpoint)}",
        ]
        if join_timeout is not None:
            argv.append(f"--rdzv-conf=timeout={int(round(check_join_timeout(join_timeout)))}")
    argv += ["--max-restarts=0", f"--monitor-interval={MONITOR_INTERVAL_S}", "-m", SIDECAR_MODULE]
    for arg in sidecar_args:
        if not isinstance(arg, str) or "\x00" in arg:
            raise InvalidRequest(f"sidecar argument {arg!r} is not a plain string")
        argv.append(arg)
    return argv


@dataclass(frozen=True)
class NodeLayout:
    """Where the sidecar's ranks run: `nproc` ranks on each of `nnodes` nodes, this one `node_rank`; several
    nodes meet at node 0's rendezvous endpoint `rdzv` (HOST:PORT) and wait up to `join_timeout` s for
    each other."""

    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv: str | None = None
    join_timeout: float | None = None


def build_launch(
    spec: devices.DeviceSpec,
    layout: NodeLayout,
    *,
    cache_dir: Path | None = None,
    sidecar_args: Sequence[str] = (),
    warm_modes: Sequence[str] = (),
    base_env: Mapping[str, str] | None = None,
    python: str | None = None,
    tpu_env: Callable | None = None,
) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that start the sidecar's ranks on this node: `torchrun --nproc-per-node=N ... -m
    engine.tp.sidecar ...`. The process-group backend and mesh device type come from the device spec
    inside the ranks; here the device decides the environment (compile caches, its launch variables)."""
    check_tp_device(spec)
    from engine import settings

    argv = torchrun_argv(
        layout.nproc, nnodes=layout.nnodes, node_rank=layout.node_rank, rdzv_endpoint=layout.rdzv,
        sidecar_args=sidecar_args, python=python, join_timeout=layout.join_timeout,
    )
    env = sidecar_environment(
        spec, cache_dir or settings.cache_dir(), nproc=layout.nproc, nnodes=layout.nnodes, warm_modes=warm_modes,
        base=base_env, tpu_env=tpu_env,
    )
    return argv, env


def node_command(
    spec: devices.DeviceSpec, nproc: int, nnodes: int, rdzv: str, node_rank: int, python: str = "python"
) -> list[str]:
    """argv to run on node `node_rank` (>= 1) of a multi-node sidecar: its ranks follow rank 0 and need
    neither the token (only rank 0 listens) nor the config (rank 0 broadcasts it)."""
    check_tp_device(spec)
    if node_rank < 1:
        raise InvalidRequest("node 0 is the app's own node; node_command is for nodes 1 and above")
    return torchrun_argv(
        nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv, python=python,
        sidecar_args=["--device", spec.name],
    )


def sidecar_command(
    spec: devices.DeviceSpec,
    layout: NodeLayout,
    *,
    preset: str,
    precision: str,
    extra: Sequence[str] = (),
    python: str = "python",
) -> list[str]:
    """The one command node `layout.node_rank` runs: `python -m engine.tp.sidecar ... --node-rank K`. It
    carries everything that node needs (preset and precision too, so its ranks can check they joined the
    sidecar they were meant for) and never the token: only rank 0, on node 0, listens. `extra` are further
    flags as (already validated) argv elements."""
    check_tp_device(spec)
    nproc, nnodes, node_rank, rdzv = layout.nproc, layout.nnodes, layout.node_rank, layout.rdzv
    _check_counts(nproc, nnodes, node_rank)
    argv = [python, "-m", SIDECAR_MODULE, "--preset", preset, "--device", spec.name, "--precision", precision,
            "--tp", str(nproc)]
    if nnodes > 1:
        if rdzv is None:
            raise InvalidRequest(f"{nnodes} nodes need a rendezvous endpoint HOST:PORT on node 0 (--rdzv-endpoint)")
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-endpoint", check_rdzv_endpoint(rdzv)]
        if layout.join_timeout is not None:
            argv += ["--join-timeout", f"{check_join_timeout(layout.join_timeout):g}"]
    for arg in extra:
        if not isinstance(arg, str) or "\x00" in arg:
            raise InvalidRequest(f"sidecar argument {arg!r} is not a plain string")
        argv.append(arg)
    return argv
