"""The tensor-parallel sidecar: `torchrun --nproc-per-node=N -m engine.tp.sidecar ...`.

Under torchrun (RANK is set) every process is one rank: it joins the process group for its device, loads
its shard, and then rank 0 serves the engine protocol of engine/worker.py on 127.0.0.1 behind an HMAC
token (multiprocessing.connection, the token read from the 0600 file named by $SHOWCASE_TP_TOKEN_FILE),
while the other ranks follow rank 0's operations.

Run without torchrun it is a by-hand launcher for debugging: it builds the torchrun command
(engine/tp/launch.py), writes a token file, starts the ranks in the foreground and prints how to connect.
`--print-command` only prints the argv (and, with --nnodes > 1, the command for the other nodes).

Exit codes (each rank): `engine.protocol.RankExit` -- OK 0 clean shutdown; USAGE 2 bad arguments;
LOAD_FAILED 3 the model failed to load on some rank (rank 0 reported it to the client as `Fatal`);
GROUP_BROKEN 4 a rank died or the ranks disagreed (the in-flight request failed with EngineCrashed);
ORPHANED 5 torchrun or the app went away; INJECTED_CRASH 17 (tests).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from engine.protocol import EngineConfig, EngineOptions, Fatal, Mode, RankExit, Ready, Shutdown
from engine.tp.tokens import new_token, write_address, write_private

log = logging.getLogger("engine.tp.sidecar")

EPILOG = """\
how to connect (the sidecar prints this again once rank 0 listens):
  python -m engine.tp.client ADDRESS_FILE --prompt "a red fox" --out fox.png
or from Python:
  from engine.tp.client import connect
  engine = connect("ADDRESS_FILE"); engine.wait_ready(600)
  engine.generate(GenerateRequest(...))

examples:
  python -m engine.tp.sidecar --preset tiny-flux --device cpu --tp 2
  python -m engine.tp.sidecar --preset flux2-dev --device cuda --tp 8 --precision bf16
  python -m engine.tp.sidecar --preset flux2-dev --device cuda --tp 8 --nnodes 2 \\
      --rdzv-endpoint 10.0.0.1:29500 --print-command      # prints the command for node 1
  torchrun --standalone --nproc-per-node=2 -m engine.tp.sidecar --preset tiny-flux --device cpu
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine.tp.sidecar",
        description="Tensor-parallel engine sidecar (torchrun). Without torchrun: start one by hand.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, default=None,
                   help="pickled EngineConfig written by the app (0600); otherwise built from the flags below")
    p.add_argument("--preset", default="tiny-flux")
    p.add_argument("--device", default="auto", help="cpu, cuda, xpu, neuron, tpu (or auto)")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--warm", action="append", default=[], metavar="MODE",
                   help="warm every bucket of MODE at start (repeatable; default: none)")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--tp", type=int, default=2, help="ranks per node (launcher mode)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT on node 0, for --nnodes > 1")
    p.add_argument("--print-command", action="store_true", help="print the torchrun argv and exit")
    p.add_argument("--port", type=int, default=0, help="rank 0's loopback port (default: a free one)")
    p.add_argument("--address-file", type=Path, default=None, help="rank 0 writes {host, port, token_file} here")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the app) is gone")
    p.add_argument("--dist-timeout", type=float, default=None, help="collective timeout in seconds")
    p.add_argument("--dump-dir", type=Path, default=None,
                   help="test/debug: rank 0 saves each request's float image as <request_id>.npy")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def config_from_args(args, world_size: int) -> EngineConfig:
    if args.config is not None:
        config = pickle.loads(Path(args.config).read_bytes())  # written 0600 by our own launcher
    else:
        from engine import settings
        from engine.resolve import Catalog

        cache = args.cache_dir or settings.cache_dir()
        catalog = Catalog()
        key = catalog.make_key(args.preset, args.device, args.precision, max(world_size, 2))
        warm_modes = tuple(Mode.parse(m, "mode") for m in args.warm)
        options = EngineOptions(warm_modes=warm_modes, warm_sizes=None if warm_modes else ())
        config = catalog.config(key, options, cache)
    if not isinstance(config, EngineConfig):
        raise SystemExit(f"{args.config} does not hold an EngineConfig")
    if config.key.tp != world_size:
        from dataclasses import replace

        config = replace(config, key=replace(config.key, tp=world_size))
    return config


# --------------------------------------------------------------------------------------------------
# rank side
# --------------------------------------------------------------------------------------------------
def _read_token() -> tuple[bytes, Path]:
    from engine.tp.launch import TOKEN_FILE_VAR

    path = os.environ.get(TOKEN_FILE_VAR)
    if path:
        return Path(path).read_bytes(), Path(path)
    # Started with torchrun by hand: make a token, readable by this user only.
    folder = Path(tempfile.mkdtemp(prefix="showcase-tp-"))
    token_path = write_private(folder / "token", new_token())
    return token_path.read_bytes(), token_path


def _listen(port: int, address_file: Path | None, parent_pid: int | None = None):
    """Bind rank 0's socket before loading, so the client can connect (and see a load failure) early."""
    from multiprocessing.connection import Listener

    token, token_path = _read_token()
    listener = Listener(("127.0.0.1", port), authkey=token)
    if parent_pid:  # launched by the app, which keeps the token in memory: none left on disk
        token_path.unlink(missing_ok=True)
    host, bound = listener.address
    if address_file is None:
        address_file = token_path.with_name("address.json")
    write_address(Path(address_file), host, bound, token_path)
    if parent_pid:
        print(f"[tp sidecar] rank 0 listening on {host}:{bound} for the app (pid {parent_pid})", flush=True)
    else:
        print(f"[tp sidecar] rank 0 listening on {host}:{bound} (HMAC token in {token_path}); connect with:\n"
              f"  python -m engine.tp.client {address_file} --prompt 'a red fox' --out out.png", flush=True)
    return listener


def _accept(listener, box: list, done: threading.Event, only_one: bool = False) -> None:
    """Accept the next client that knows the token. `only_one` (launched by the app): then close the
    socket, so any later connection is refused outright instead of waiting in the backlog."""
    from multiprocessing import AuthenticationError

    while True:
        try:
            box.append(listener.accept())
            if only_one:
                listener.close()
            break
        except AuthenticationError:
            log.warning("refused a connection with a wrong token")
        except OSError as exc:
            log.error("listener failed: %s", exc)
            break
    done.set()


def _exit(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # inductor's compile workers and daemon threads must not keep a rank alive


class _Rank0Server:
    """Rank 0's socket: bound before loading (so a client sees a load failure early), one client at a time."""

    def __init__(self, args):
        self.listener = _listen(args.port, args.address_file, args.parent_pid)
        self.conn_box: list = []
        self.connected = threading.Event()
        # Started by the app (--parent-pid): one client, then the socket closes (later connections are refused).
        self.accept_next(only_one=args.parent_pid is not None)

    def accept_next(self, only_one: bool = False) -> None:
        self.connected.clear()
        threading.Thread(target=_accept, args=(self.listener, self.conn_box, self.connected, only_one),
                         daemon=True).start()

    def wait_client(self, timeout: float | None = None):
        if self.connected.wait(timeout) and self.conn_box:
            return _TrackedConnection(self.conn_box.pop())
        return None


def _make_sidecar_loop(runner, conn, max_queue: int):
    from engine.worker import WorkerLoop

    class SidecarLoop(WorkerLoop):
        """WorkerLoop on rank 0; stops serving as soon as the group is broken."""

        def _halt(self) -> None:
            self._stop.set()
            self._requests.put(None)

        def _serve_one(self, request) -> None:
            super()._serve_one(request)
            if runner.broken:
                self._halt()

        def _warm_forever(self) -> None:
            try:
                super()._warm_forever()
            except Exception as exc:
                log.error("warm-up stopped: %s", exc)
                if runner.broken:
                    self._halt()

    return SidecarLoop(conn, runner, max_queue=max_queue)


def _load_on_every_rank(config, group, rank: int, world: int, dump_dir, box: list):
    """Load this rank's shard; gather every rank's outcome. Returns (runner, error, ranks)."""
    import torch.distributed as dist

    from engine.errors import ShowcaseError
    from engine.protocol import BucketChanged
    from engine.tp.runner import TensorParallelRunner

    runner, error = None, None
    try:
        runner = TensorParallelRunner(config, group, listener=lambda info: box and box[0].send(BucketChanged(info)),
                                      dump_dir=dump_dir)
        runner.load()
    except Exception as exc:
        log.exception("load failed")
        error = exc
    me = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "device": str(group.device),
          "error": None if error is None else (str(error) if isinstance(error, ShowcaseError)
                                               else f"{type(error).__name__}: {error}")}
    ranks = [None] * world
    dist.all_gather_object(ranks, me, group=group.control)
    return runner, error, ranks


def _report_load_failure(server: _Rank0Server, error, ranks, config, from_app: bool) -> None:
    from engine.errors import ModelLoadError, ShowcaseError

    first = next(r for r in ranks if r["error"])
    err = error if (isinstance(error, ShowcaseError) and first["rank"] == 0) else ModelLoadError(
        f"rank {first['rank']} of {len(ranks)} could not load {config.key}: {first['error']}")
    print(f"[tp sidecar] load failed: {err}", file=sys.stderr, flush=True)
    # The app's client connects as soon as rank 0 listens; by hand, nobody may be connected yet.
    conn = server.wait_client(timeout=30 if from_app else 0.5)
    if conn is not None:
        try:
            conn.send(Fatal(err))
        finally:
            conn.close()


def _serve(server: _Rank0Server, runner, config, ranks, spec, from_app: bool, box: list) -> RankExit:
    """Serve clients until shutdown; by hand, a client that disconnects without asking for shutdown is
    followed by the next one. Returns how the rank exits."""
    from engine.protocol import EngineReady

    first_client = True
    while True:
        conn = server.wait_client()
        if conn is None:
            return RankExit.GROUP_BROKEN
        loop = _make_sidecar_loop(runner, conn, config.options.max_queue)
        box[:] = [loop]
        ready = runner.ready_info()
        loop.send(Ready(EngineReady(key=config.key, pid=ready.pid, load_s=ready.load_s, notices=ready.notices,
                                    modes=ready.modes, buckets=ready.buckets, tp=len(ranks), ranks=tuple(ranks),
                                    backend=spec.dist_backend, footprint=ready.footprint, preset=ready.preset)))
        if first_client:
            runner.start_heartbeat()
            loop.queue_startup_warm()
            first_client = False
        loop.run()
        conn.close()
        if runner.broken:
            return RankExit.GROUP_BROKEN
        if conn.shutdown_requested or from_app:
            return RankExit.OK
        print("[tp sidecar] client disconnected; waiting for the next one", flush=True)
        server.accept_next()


def rank_main(args) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO if args.verbose else os.environ.get("SHOWCASE_LOG_LEVEL", "WARNING"),
                        format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s")
    from engine.tp.group import watch_parents

    watch_parents(args.parent_pid)

    import torch.distributed as dist

    from engine import devices
    from engine.tp.group import init_group
    from engine.tp.launch import dist_timeout_s

    server, config = None, None
    if rank == 0:
        config = config_from_args(args, world)
        server = _Rank0Server(args)
        device = config.key.device
    else:
        device = args.device  # the launcher passes the config's device to every rank
    spec = devices.resolve_device(device)
    group = init_group(spec, args.dist_timeout or dist_timeout_s(spec))
    shared = [config]
    dist.broadcast_object_list(shared, src=0, group=group.control)  # nodes >= 1 get rank 0's config
    config = shared[0]

    loop_box: list = []  # rank 0's current WorkerLoop: bucket changes go to its client
    runner, error, ranks = _load_on_every_rank(config, group, rank, world, args.dump_dir, loop_box)
    failed = any(r["error"] for r in ranks)
    if rank != 0:
        _exit(RankExit.LOAD_FAILED if failed else runner.follow())
    from_app = args.parent_pid is not None
    if failed:
        _report_load_failure(server, error, ranks, config, from_app)
        _exit(RankExit.LOAD_FAILED)
    code = _serve(server, runner, config, ranks, spec, from_app, loop_box)
    if code is not RankExit.OK:
        _exit(code)
    server.listener.close()
    runner.stop_followers()
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    _exit(RankExit.OK)


class _TrackedConnection:
    """A Connection that remembers whether the client asked for shutdown (vs. just disconnecting)."""

    def __init__(self, conn):
        self._conn = conn
        self.shutdown_requested = False

    def recv(self):
        message = self._conn.recv()
        if isinstance(message, Shutdown):
            self.shutdown_requested = True
        return message

    def send(self, message) -> None:
        self._conn.send(message)

    def close(self) -> None:
        self._conn.close()


# --------------------------------------------------------------------------------------------------
# by-hand launcher
# --------------------------------------------------------------------------------------------------
def launcher_main(args) -> int:
    from engine import devices, settings
    from engine.errors import ShowcaseError
    from engine.tp.launch import TOKEN_FILE_VAR, build_launch, node_command

    try:
        cache = args.cache_dir or settings.cache_dir()
        spec = devices.get_device(args.device) if args.print_command else devices.resolve_device(args.device)
        sidecar_args = ["--device", spec.name, "--preset", args.preset, "--precision", args.precision,
                        "--cache-dir", str(cache)]
        folder = None
        if not args.print_command:  # printed commands: rank 0 makes its own token and address file
            folder = Path(tempfile.mkdtemp(prefix="showcase-tp-"))
            sidecar_args += ["--address-file", str(folder / "address.json")]
        for mode in args.warm:
            sidecar_args += ["--warm", mode]
        if args.dump_dir:
            sidecar_args += ["--dump-dir", str(args.dump_dir)]
        if args.dist_timeout:
            sidecar_args += ["--dist-timeout", str(args.dist_timeout)]
        argv, env = build_launch(spec, args.tp, args.nnodes, args.rdzv_endpoint, cache_dir=cache,
                                 sidecar_args=sidecar_args, warm_modes=args.warm)
    except ShowcaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return RankExit.USAGE
    print("node 0 (this machine, rank 0):\n  " + shlex.join(argv))
    for node in range(1, args.nnodes):
        other = node_command(spec, args.tp, args.nnodes, args.rdzv_endpoint, node, python="python")
        print(f"node {node}:\n  " + shlex.join(other))
    if args.print_command:
        return RankExit.OK
    token_path = write_private(folder / "token", new_token())
    env[TOKEN_FILE_VAR] = str(token_path)
    proc = subprocess.Popen(argv, env=env)  # foreground: Ctrl-C reaches torchrun, which stops the ranks
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()
    finally:
        for name in ("token", "address.json"):
            (folder / name).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if under_torchrun():
        rank_main(args)
        return RankExit.OK  # not reached: rank_main exits
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return launcher_main(args)


if __name__ == "__main__":
    sys.exit(main())
