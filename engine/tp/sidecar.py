"""The tensor-parallel sidecar: one command per node, or `torchrun ... -m engine.tp.sidecar`.

Under torchrun (RANK is set) every process is one rank: it joins the process group for its device, loads
its shard, and then rank 0 serves the engine protocol of engine/worker/loop.py behind an HMAC token
(multiprocessing.connection; the token read from the 0600 file named by $SHOWCASE_TP_TOKEN_FILE), on
127.0.0.1 unless the host passes `--listen`, while the other ranks follow rank 0's operations.

Run without torchrun it is the launcher a host runs once per node (engine/tp/nodes.py): node 0 writes the
token and the address file, starts its ranks and serves; every other node joins node 0's rendezvous.
`--print-command` only prints the commands.

Exit codes (each rank): `engine.protocol.RankExit` -- OK 0 clean shutdown; USAGE 2 bad arguments, or the
nodes were started for different engines; LOAD_FAILED 3 the model failed to load on some rank (rank 0
reported it to the client as `Fatal`); GROUP_BROKEN 4 a rank died or the ranks disagreed (the in-flight
request failed with EngineCrashed naming the rank, node and host); ORPHANED 5 torchrun, the app or node 0
went away; INJECTED_CRASH 17 (tests). The launcher exits with its torchrun's code, or JOIN_TIMEOUT (6)
when the nodes did not all join in time.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import queue
import socket
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from engine import settings
from engine.config.flags import add_fields, from_args
from engine.errors import EngineBusy, InvalidRequest, ModelLoadError, ShowcaseError
from engine.processes import pid_alive
from engine.protocol import (
    BucketChanged,
    EngineConfig,
    EngineOptions,
    EngineReady,
    Fatal,
    Mode,
    Precision,
    RankExit,
    Ready,
    RequestFailed,
)
from engine.tp.flags import SidecarFlags
from engine.tp.tokens import new_token, read_token, write_address, write_private
from engine.worker.loop import WorkerLoop
from engine.worker.served import EngineFacts, LoopPolicy

log = logging.getLogger("engine.tp.sidecar")

# How a broken group's message ends on a sidecar a host started by hand (the app restarts one it launched).
BY_HAND_RESTART_HINT = ("the sidecar stops: restart it on every node (an app attached with --tp-address "
                        "re-attaches by itself), then retry")

EPILOG = """\
--tp is the number of ranks on EACH node (torchrun's --nproc-per-node), not in all: the engine has
--tp x --nnodes ranks, and its engine key says the total (2 nodes x 8 GPUs: tp16).

one machine:
  python -m engine.tp.sidecar --preset tiny-flux --device cpu --tp 2
several machines (run one command per node; node 0 prints the exact command for the others):
  node 0:  python -m engine.tp.sidecar --preset flux2-dev --device cuda --precision bf16 --tp 8 \\
               --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29500 --address-file /srv/tp/flux2.json
  node 1:  python -m engine.tp.sidecar --preset flux2-dev --device cuda --precision bf16 --tp 8 \\
               --nnodes 2 --node-rank 1 --rdzv-endpoint 10.0.0.1:29500
  (10.0.0.1:29500 is node 0's address and a free port on it, reachable from every node)

serve it in the app (on node 0; the token is read from the file the address file names):
  python app.py --tp-address /srv/tp/flux2.json
or send one request:
  python -m engine.tp.client /srv/tp/flux2.json --prompt "a red fox" --out fox.png

rank 0 listens on 127.0.0.1 only. --listen HOST opens it to the network (then --token-file is required:
make one with `python -m engine.tp.tokens FILE` and copy it to the app's machine over a secure channel);
keep HOST on a private network: the token authenticates, it does not encrypt. See docs/multinode.md.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine.tp.sidecar",
        description="Tensor-parallel engine sidecar (torchrun): run it once on every node; node 0 serves.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_fields(p, SidecarFlags)
    return p


def under_torchrun() -> bool:
    return settings.launched_by_torchrun()


def config_from_args(args: SidecarFlags, world_size: int) -> EngineConfig:
    if args.config is not None:
        config = pickle.loads(Path(args.config).read_bytes())  # written 0600 by our own launcher
    else:
        from engine.config.resolve import Catalog

        cache = args.cache_dir or settings.cache_dir()
        catalog = Catalog()
        key = catalog.make_key(args.preset or "tiny-flux", args.device, args.precision or "fp32", max(world_size, 2),
                               args.parallel or "tensor")
        warm_modes = tuple(Mode.parse(m, "mode") for m in args.warm)
        options = EngineOptions(warm_modes=warm_modes, warm_sizes=None if warm_modes else ())
        config = catalog.config(key, options, cache)
    if not isinstance(config, EngineConfig):
        raise SystemExit(f"{args.config} does not hold an EngineConfig")
    if config.key.tp != world_size:
        config = replace(config, key=replace(config.key, tp=world_size))
    return config


# --------------------------------------------------------------------------------------------------
# rank side
# --------------------------------------------------------------------------------------------------
def _read_token() -> tuple[bytes, Path]:
    path = settings.tp_token_file()
    if path:
        return read_token(Path(path), private=False), Path(path)
    # Started with torchrun by hand: make a token, readable by this user only.
    folder = Path(tempfile.mkdtemp(prefix="showcase-tp-"))
    token_path = write_private(folder / "token", new_token())
    return token_path.read_bytes(), token_path


def _describe_peer(peer) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)


# Connections whose handshake may be in progress at once, and the kernel's queue of not yet accepted ones.
MAX_PENDING = 16
LISTEN_BACKLOG = 64


class _Rank0Server:
    """Rank 0's socket: bound before loading (so a client sees a load failure early). One app at a time: a
    second one is answered at once with EngineBusy saying who is attached (never left in the listen
    backlog); started by the app itself (--parent-pid), the socket closes after its one client. Handshakes
    run side by side, each within wire.HANDSHAKE_S in all: silent or slow peers never hold up a real one."""

    def __init__(self, args: SidecarFlags, config: EngineConfig):
        from multiprocessing.connection import Listener

        from engine.tp.launch import check_listen_host

        self.token, token_path = _read_token()
        host = check_listen_host(args.listen) if args.listen else "127.0.0.1"
        # No authkey here: wire.authenticate_incoming, with a deadline, on a thread per connection.
        self.listener = Listener((host, args.port), backlog=LISTEN_BACKLOG)
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._closed = False
        self.only_one = args.parent_pid is not None
        if self.only_one:  # launched by the app, which keeps the token in memory: none left on disk
            token_path.unlink(missing_ok=True)
        bound_host, self.port = self.listener.address
        self.host = socket.gethostname() if bound_host in ("0.0.0.0", "") else bound_host
        address_file = Path(args.address_file) if args.address_file else token_path.with_name("address.json")
        write_address(address_file, self.host, self.port, token_path,
                      engine={**config.key.as_dict(), "precision": str(config.key.precision)})
        self._clients: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._current: str | None = None  # who is being served (peer and since when)
        self._queued = False
        if self.only_one:
            print(f"[tp sidecar] rank 0 listening on {self.host}:{self.port} for the app (pid {args.parent_pid})",
                  flush=True)
        else:
            print(f"[tp sidecar] rank 0 listening on {self.host}:{self.port} (address file {address_file}, "
                  f"HMAC token in {token_path}); serve it with:\n  python app.py --tp-address {address_file}\n"
                  f"or send one request:\n  python -m engine.tp.client {address_file} --prompt 'a red fox' "
                  "--out out.png", flush=True)
        threading.Thread(target=self._accept_forever, name="tp-accept", daemon=True).start()

    def _accept_forever(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
                peer = _describe_peer(self.listener.last_accepted)
            except OSError as exc:
                if not self.only_one and not self._closed:
                    log.error("listener failed: %s", exc)
                    self._clients.put(None)
                return
            # Each handshake runs on its own thread under its own deadline, so peers that connect and stall
            # cannot keep a real client waiting behind them; past MAX_PENDING they are dropped at once.
            if not self._pending.acquire(blocking=False):
                log.warning("dropped a connection from %s: %d handshakes already pending", peer, MAX_PENDING)
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn, peer), name="tp-handshake", daemon=True).start()

    def _handshake(self, conn, peer: str) -> None:
        from multiprocessing import AuthenticationError

        from engine.worker.wire import authenticate_incoming

        try:
            try:
                authenticate_incoming(conn, self.token)
            except AuthenticationError:
                log.warning("refused a connection from %s with a wrong token", peer)
                conn.close()
                return
            except (OSError, EOFError) as exc:
                log.warning("dropped a connection from %s that did not authenticate: %s", peer, exc)
                conn.close()
                return
        finally:
            self._pending.release()
        with self._lock:
            busy = self._current if self._current is not None else ("a client" if self._queued else None)
            if busy is None:
                self._queued = True
                self._clients.put((conn, peer))
        if busy is not None:
            log.warning("refused %s: already serving %s", peer, busy)
            try:
                conn.send(Fatal(EngineBusy(
                    f"the tensor-parallel sidecar at {self.host}:{self.port} already serves an app ({busy}); it "
                    "serves one app at a time: stop or disconnect that app first, or start another sidecar")))
            except OSError:
                pass
            conn.close()
            return
        if self.only_one:
            self.close()  # any later connection is refused outright

    def wait_client(self, timeout: float | None = None):
        try:
            item = self._clients.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is None:
            return None
        conn, peer = item
        with self._lock:
            self._queued = False
            self._current = f"connected from {peer} since {time.strftime('%H:%M:%S')}"
        return conn

    def release(self) -> None:
        with self._lock:
            self._current = None

    def close(self) -> None:
        self._closed = True
        try:
            self.listener.close()
        except OSError:
            pass


def _exit(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # inductor's compile workers and daemon threads must not keep a rank alive


class GroupStop(LoopPolicy):
    """How rank 0's WorkerLoop serves: it stops as soon as the group is broken. Requests run on the serve
    thread at one priority, and compiles do not pause for them: the other ranks compute in step with rank 0
    (a paused warm-up would hold them all in a collective)."""

    compile_steps_aside = False
    orders_by_run_cost = False

    def __init__(self, health):
        self.health = health  # the group's state (engine/tp/runner.py GroupHealth): a broken group stops serving

    def stop_reason(self) -> str | None:
        return self.health.broken

    def warm_up_failed(self, error: Exception) -> None:
        log.error("warm-up stopped: %s", error)  # the loop serves on unless the group broke with it


def _node_claims(args, config: EngineConfig, lead: dict) -> str | None:
    """On every rank: was this node started for the engine node 0 serves? (preset, precision, device, ranks
    per node). The launcher passes them; a rank started by hand or by the app's node command may not."""

    node = settings.torchrun_group_rank()
    if node == 0:
        return None
    me = f"node {node} (host {socket.gethostname()})"
    key = config.key
    if args.preset is not None and args.preset not in (key.preset, config.preset.name, config.preset.source):
        return f"{me} was started with --preset {args.preset} but node 0 serves {key.preset}"
    if args.parallel is not None and args.parallel != key.parallel:
        return f"{me} was started with --parallel {args.parallel} but node 0 serves {key.parallel}"
    if args.precision is not None:
        try:
            mine = str(Precision.parse(args.precision, "precision"))
        except Exception:  # noqa: BLE001
            mine = args.precision
        if mine != str(key.precision):
            return f"{me} was started with --precision {mine} but node 0 serves {key.precision}"
    from engine import devices

    try:
        mine = devices.get_device(args.device).name if args.device != "auto" else key.device
    except Exception:  # noqa: BLE001
        mine = args.device
    if mine != key.device:
        return f"{me} was started with --device {mine} but node 0 serves on {key.device}"
    local = settings.torchrun_local_world_size()
    if lead.get("local_world") is not None and local != lead["local_world"]:
        return f"{me} runs {local} ranks but node 0 runs {lead['local_world']}: give every node the same --tp"
    return None


def _check_nodes(args, config, lead: dict, group) -> str | None:
    """Every rank learns whether any node was started for another engine, before anything loads."""
    import torch.distributed as dist

    problem = _node_claims(args, config, lead)
    problems = [None] * group.world_size
    dist.all_gather_object(problems, problem, group=group.control)
    found = next((p for p in problems if p), None)
    return None if found is None else (f"{found}: start every node with the same --preset, --precision, --device, "
                                       "--tp and --parallel")


def _report_load_failure(server: _Rank0Server, error, ranks, config, from_app: bool, refused: str | None) -> None:
    first = next(r for r in ranks if r["error"])
    if refused:
        err = InvalidRequest(refused)
    elif isinstance(error, ShowcaseError) and first["rank"] == 0:
        err = error
    else:
        err = ModelLoadError(f"rank {first['rank']} of {len(ranks)} (node {first.get('node', 0)}, host "
                             f"{first.get('host')}) could not load {config.key}: {first['error']}")
    print(f"[tp sidecar] load failed: {err}", file=sys.stderr, flush=True)
    # The app's client connects as soon as rank 0 listens; by hand, nobody may be connected yet.
    conn = server.wait_client(timeout=30 if from_app else 0.5)
    if conn is not None:
        try:
            conn.send(Fatal(err))
        finally:
            conn.close()


class _Guard:
    """Rank 0 going down on its own: a rank stopped beating (liveness), or the group broke while idle (a
    failed heartbeat operation). Tells the client (the request in flight fails naming the node; `Fatal`
    puts the reason on the app's board) and exits, so torchrun and the other nodes follow."""

    def __init__(self, health, current_loop, ranks: list):
        self.health = health  # the group's state, shared with the runner (engine/tp/runner.py GroupHealth)
        self.current_loop = current_loop  # () -> rank 0's WorkerLoop now (None: no client yet)
        self.ranks = ranks
        self._once = threading.Lock()

    def go_down(self, reason: str) -> None:
        if not self._once.acquire(blocking=False):
            return
        self.health.mark_broken(reason)
        err = self.health.error(reason)
        loop = self.current_loop()
        if loop is not None:
            request_id = self.health.current_request
            if request_id:
                loop.send(RequestFailed(request_id, err))
            loop.send(Fatal(err))
        print(f"[tp sidecar] group broken: {reason}", file=sys.stderr, flush=True)
        _exit(RankExit.GROUP_BROKEN)

    def on_silent(self, silent: list[int], seconds: float) -> None:
        from engine.tp.liveness import describe_rank

        names = ", ".join(describe_rank(self.ranks, r) for r in silent)
        self.go_down(f"{names} sent no heartbeat for {seconds:.0f} s (--node-timeout)")

    def watch_idle_breaks(self) -> None:
        def run() -> None:
            since = None
            while True:
                time.sleep(1.0)
                if self.health.broken and not self.health.op_lock.locked():
                    since = since or time.monotonic()
                    if time.monotonic() - since > 2.0:  # the serve loop did not take it down itself
                        self.go_down(self.health.broken)
                else:
                    since = None

        threading.Thread(target=run, name="tp-broken-guard", daemon=True).start()


class RankProcess:
    """One rank of the sidecar under torchrun, phase by phase: join the group (logs, parent watch, process
    group, liveness), agree on rank 0's config, load the shard on every rank, then follow rank 0 (every
    other rank) or serve clients (rank 0) until shutdown. Every ending exits the process (_exit)."""

    def __init__(self, args: SidecarFlags):
        self.args = args
        self.rank, self.world = settings.torchrun_rank(), settings.torchrun_world_size()
        self.node = settings.torchrun_group_rank()
        self.from_app = args.parent_pid is not None
        self.server: _Rank0Server | None = None
        self.config: EngineConfig | None = None
        self.loop: WorkerLoop | None = None  # rank 0's current WorkerLoop: bucket changes go to its client
        self.ranks: list[dict] = []  # every rank's whereabouts, gathered after loading
        self.health = None  # the group's state on this rank (engine/tp/runner.py GroupHealth), set by load

    def run(self) -> None:
        self.join_group()
        refused = self.agree_config()
        runner, error = self.load(refused)
        failed = any(r["error"] for r in self.ranks)
        if self.rank != 0:
            self.follow(runner, failed, refused)
        if failed:
            _report_load_failure(self.server, error, self.ranks, self.config, self.from_app, refused)
            _exit(RankExit.USAGE if refused else RankExit.LOAD_FAILED)
        self.lead(runner)

    def join_group(self) -> None:
        from engine import devices
        from engine.tp.group import init_group, watch_parents
        from engine.tp.launch import dist_timeout_s
        from engine.tp.liveness import Liveness
        from engine.tp.torchrun import bind_stores_from_env
        from engine.worker import logs

        args, rank, node = self.args, self.rank, self.node
        logs.configure(logging.INFO if args.verbose else settings.log_level(),
                       process=f"tp rank {rank} node {node}", prefix=f"[tp rank {rank} node {node}] ")
        watch_parents(args.parent_pid)
        if rank == 0:
            self.config = config_from_args(args, self.world)
            self.server = _Rank0Server(args, self.config)
            device = self.config.key.device
        else:
            device = args.device  # the launcher passes the config's device to every rank
        self.spec = devices.resolve_device(device)
        bind_stores_from_env()  # a rank 0 that hosts its own store listens where torchrun's does
        self.group = init_group(self.spec, args.dist_timeout or dist_timeout_s(self.spec))
        self.liveness = Liveness(rank, self.world, args.node_timeout)
        self.liveness.start(on_store_lost=None if rank == 0 else self.node_0_gone)

    def node_0_gone(self, seconds: float) -> None:
        print(f"[tp sidecar] node {self.node} rank {self.rank}: node 0's rendezvous store "
              f"({':'.join(map(str, settings.torchrun_master()))}) has been unreachable for "
              f"{seconds:.0f} s: node 0 is gone; this rank exits", file=sys.stderr, flush=True)
        _exit(RankExit.ORPHANED)

    def agree_config(self) -> str | None:
        """Every rank takes rank 0's config; returns why the nodes disagree (None: they agree)."""
        import torch.distributed as dist


        shared = [self.config, {"local_world": settings.torchrun_local_world_size()}]
        dist.broadcast_object_list(shared, src=0, group=self.group.control)  # other nodes get rank 0's config
        self.config, lead = shared
        if self.node != 0:  # each machine has its own disk: models and compile caches come from this node's cache
            self.config = replace(self.config, cache_dir=str(self.args.cache_dir or settings.cache_dir()))
        return _check_nodes(self.args, self.config, lead, self.group)

    def load(self, refused: str | None):
        """Load this rank's shard (unless the nodes disagree); gather every rank's outcome and whereabouts
        into self.ranks. Returns (runner, error)."""
        import torch.distributed as dist

        from engine.tp.runner import GroupHealth, TensorParallelRunner

        runner, error = None, None
        self.health = GroupHealth(self.config.key, who_is_gone=self.who_is_gone,
                                  restart_hint=None if self.from_app else BY_HAND_RESTART_HINT)
        if refused:
            error = InvalidRequest(refused)
        else:
            try:
                runner = TensorParallelRunner(self.config, self.group, listener=self.bucket_changed,
                                              dump_dir=self.args.dump_dir, health=self.health)
                runner.load()
            except Exception as exc:
                log.exception("load failed")
                error = exc
        me = {"rank": self.rank, "node": self.node, "host": socket.gethostname(), "pid": os.getpid(),
              "device": str(self.group.device),
              "error": None if error is None else (str(error) if isinstance(error, ShowcaseError)
                                                   else f"{type(error).__name__}: {error}")}
        self.ranks = [None] * self.world
        dist.all_gather_object(self.ranks, me, group=self.group.control)
        return runner, error

    def bucket_changed(self, info) -> None:
        if self.loop is not None:
            self.loop.send(BucketChanged(info))

    def who_is_gone(self) -> str | None:
        """The ranks that stopped, named (None: none known)."""
        from engine.tp.liveness import describe_rank

        # Ranks on node 0 run next to rank 0: their process says it at once (torchrun on this node tears the
        # group down within a fraction of a second, too soon for heartbeats). Other nodes: their heartbeats.
        ranks = self.ranks
        gone = [r["rank"] for r in ranks if r["node"] == 0 and r["rank"] != 0 and not pid_alive(r["pid"])]
        gone = gone or self.liveness.silent_ranks()
        return ", ".join(describe_rank(ranks, r) for r in gone) or None

    def follow(self, runner, failed: bool, refused: str | None) -> None:
        """Every rank but 0: say why loading failed, or run what rank 0 runs until it stops."""
        node, rank, lead_host = self.node, self.rank, self.ranks[0]["host"]
        if failed:
            if settings.torchrun_local_rank() == 0:  # once per node: this node's launcher explains it
                first = next(r for r in self.ranks if r["error"])
                print(f"[tp sidecar] load failed: {refused or first['error']} (rank {first['rank']}, node "
                      f"{first.get('node')}, host {first.get('host')})", file=sys.stderr, flush=True)
            _exit(RankExit.USAGE if refused else RankExit.LOAD_FAILED)
        print(f"[tp sidecar] node {node} rank {rank}: loaded; following rank 0 (node 0, host {lead_host})",
              flush=True)
        code = runner.follow()
        if code is RankExit.GROUP_BROKEN:
            print(f"[tp sidecar] group broken: node {node} rank {rank} lost rank 0 (node 0, host {lead_host}): "
                  f"{runner.health.broken or 'node 0 stopped or cannot be reached'}", file=sys.stderr, flush=True)
        _exit(code)

    def lead(self, runner) -> None:
        """Rank 0: guard the group, serve clients, then shut the group down."""
        import torch.distributed as dist

        from engine.tp.liveness import describe_rank

        guard = _Guard(self.health, lambda: self.loop, self.ranks)
        if self.world > 1:
            self.liveness.watch(guard.on_silent)
        guard.watch_idle_breaks()
        nodes = sorted({r["node"] for r in self.ranks})
        print(f"[tp sidecar] loaded {self.config.key} on {self.world} ranks over {len(nodes)} node(s): "
              + ", ".join(describe_rank(self.ranks, r["rank"]) for r in self.ranks), flush=True)
        code = self.serve(runner)
        if code is not RankExit.OK:
            _exit(code)
        self.server.close()
        runner.stop_followers()
        self.liveness.stop()
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        _exit(RankExit.OK)

    def serve(self, runner) -> RankExit:
        """Serve clients until shutdown; by hand, a client that disconnects without asking for shutdown is
        followed by the next one. Returns how the rank exits."""
        first_client = True
        while True:
            conn = self.server.wait_client()
            if conn is None:
                return RankExit.GROUP_BROKEN
            # The runner is rank 0's executor (each operation broadcast to every rank) and reports on itself.
            self.loop = loop = WorkerLoop(conn, EngineFacts.of(runner), runner, runner, GroupStop(self.health),
                                          max_queue=self.config.options.max_queue)
            loop.send(Ready(self.ready_message(runner)))
            if first_client:
                runner.start_heartbeat()
                loop.queue_startup_warm()
                first_client = False
            loop.run()
            if self.health.broken:
                print(f"[tp sidecar] group broken: {self.health.broken}", file=sys.stderr, flush=True)
                loop.send(Fatal(self.health.error(self.health.broken)))  # the board shows why, not just "connection closed"
                conn.close()
                return RankExit.GROUP_BROKEN
            conn.close()
            self.server.release()
            if loop.shutdown_asked or self.from_app:
                return RankExit.OK
            print("[tp sidecar] client disconnected; waiting for the next one", flush=True)

    def ready_message(self, runner):
        ready = runner.ready_info()
        return EngineReady(key=self.config.key, pid=ready.pid, load_s=ready.load_s, notices=ready.notices,
                           modes=ready.modes, buckets=ready.buckets, tp=len(self.ranks), ranks=tuple(self.ranks),
                           backend=self.spec.dist_backend, footprint=ready.footprint, preset=ready.preset,
                           folders=ready.folders)


def rank_main(args: SidecarFlags) -> None:
    RankProcess(args).run()


def main(argv: list[str] | None = None) -> int:
    args = from_args(SidecarFlags, build_parser().parse_args(argv))
    if under_torchrun():
        rank_main(args)
        return RankExit.OK  # not reached: rank_main exits
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from engine.tp.nodes import launcher_main

    return launcher_main(args, argv)


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # torch's interpreter teardown took seconds here; the launcher is done
