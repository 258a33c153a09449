"""The sidecar's flags (`python -m engine.tp.sidecar`), one field each: engine/config/flags.py `add_fields` makes
a field with `flag(...)` metadata its flag, and `from_args` reads the parsed command line back as SidecarFlags,
which the launcher (engine/tp/nodes.py) and every rank (engine/tp/sidecar.py) read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.protocol import Parallel
from engine.protocol.flagfields import APPEND, SWITCH, flag
from engine.tp.launch import JOIN_TIMEOUT_S
from engine.tp.liveness import NODE_TIMEOUT_S


@dataclass(frozen=True)
class SidecarFlags:
    """Which engine every node serves, how the nodes meet, and (node 0) how the app reaches rank 0."""

    config: Path | None = field(default=None, metadata=flag(
        "pickled EngineConfig written by the app (0600); otherwise built from the flags below", check=Path))
    preset: str | None = field(default=None, metadata=flag(
        "model preset (default tiny-flux); the same on every node"))
    device: str = field(default="auto", metadata=flag("cpu, cuda, xpu, neuron, tpu (or auto)"))
    precision: str | None = field(default=None, metadata=flag(
        "fp32 (default), tf32, bf16, fp16; the same on every node"))
    warm: tuple[str, ...] = field(default=(), metadata=flag(
        "warm every bucket of MODE at start (repeatable; default: none)", kind=APPEND, metavar="MODE"))
    cache_dir: Path | None = field(default=None, metadata=flag(
        "this node's cache folder (models, compiles)", check=Path))
    tp: int = field(default=2, metadata=flag(
        "ranks on EACH node (torchrun --nproc-per-node), not in all: the engine has --tp x --nnodes ranks "
        "(default {default})", check=int))
    parallel: str | None = field(default=None, metadata=flag(
        "how the ranks split the transformer: tensor (weights sharded; default), ulysses or ring (context "
        "parallel: whole transformer on every rank, tokens split); the same on every node",
        choices=Parallel.values()))
    nnodes: int = field(default=1, metadata=flag("machines the engine spans (default {default})", check=int))
    node_rank: int = field(default=0, metadata=flag(
        "this machine's place, 0 .. nnodes-1; node 0 serves, the others join it (default {default})", check=int))
    rdzv_endpoint: str | None = field(default=None, metadata=flag(
        "HOST:PORT on node 0 that every node reaches, for --nnodes > 1 (the same on every node)"))
    join_timeout: float = field(default=JOIN_TIMEOUT_S, metadata=flag(
        "how long node 0 waits for the other nodes to join, and they for node 0 (default {default} s)",
        check=float, metavar="SECONDS"))
    node_timeout: float = field(default=NODE_TIMEOUT_S, metadata=flag(
        "a rank silent (no heartbeat) this long is declared gone: the request in flight fails naming its node "
        "and the sidecar stops (default {default:g} s)", check=float, metavar="SECONDS"))
    print_command: bool = field(default=False, metadata=flag("print the commands and exit", kind=SWITCH))
    listen: str | None = field(default=None, metadata=flag(
        "node 0: the interface rank 0 listens on (default 127.0.0.1, this machine only); needs --token-file; "
        "keep it on a private network", metavar="HOST"))
    port: int = field(default=0, metadata=flag("rank 0's port (default: a free one)", check=int))
    address_file: Path | None = field(default=None, metadata=flag(
        "node 0: rank 0 writes {{host, port, token_file, ...}} here (0600; the token is in a separate 0600 file "
        "next to it); app.py --tp-address reads it", check=Path))
    token_file: Path | None = field(default=None, metadata=flag(
        "node 0: a long-lived token (0600, made with python -m engine.tp.tokens FILE) instead of a new one per "
        "launch; required with --listen", check=Path))
    parent_pid: int | None = field(default=None, metadata=flag(
        "exit when this process (the app) is gone", check=int))
    dist_timeout: float | None = field(default=None, metadata=flag("collective timeout in seconds", check=float))
    dump_dir: Path | None = field(default=None, metadata=flag(
        "test/debug: rank 0 saves each request's float image as <request_id>.npy", check=Path))
    verbose: bool = field(default=False, metadata=flag(kind=SWITCH, short="-v"))
