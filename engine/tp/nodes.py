"""The command a host runs once per node: `python -m engine.tp.sidecar ... --nnodes N --node-rank K`.

Why a launcher around torchrun: torchrun's failures across machines are tracebacks ("Timed out after 600
seconds waiting for clients. 1/2 clients joined."), and a host following `--help` needs to be told which
node is missing and what to check, on the node that can see it. So each node's launcher

- validates every flag before anything starts (argv lists only, no shell; nothing a user typed reaches a
  command line unchecked) and starts this node's torchrun with `--rdzv-conf timeout=<--join-timeout>`;
- node 0: writes the token (0600, next to `--address-file`, or the host's own `--token-file`) and the address
  file (how to start the sidecar, what it serves; rank 0 adds where it listens), prints the exact command
  for every other node (never the token), watches the rendezvous (which nodes have joined: it reads
  torchrun's own rendezvous keys) and, when it times out, says which nodes never joined and what to check;
- every node: forwards SIGTERM/SIGINT/SIGHUP to torchrun (which stops its ranks), makes sure no rank of its
  own is left, and says in one line why the sidecar stopped (which rank on which node, root cause first).
"""

from __future__ import annotations

import collections
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.errors import InvalidRequest, ShowcaseError
from engine.protocol import Mode, Parallel, Precision, RankExit
from engine.tp.tokens import new_token, read_token, update_address, write_private

JOIN_TIMEOUT_EXIT = 6  # the launcher's exit code when the nodes did not all join in time
STOP_GRACE_S = 6.0  # after SIGTERM, torchrun gets this long to stop its ranks before it is killed
RDZV_RUN_ID = "none"  # torchrun's default --rdzv-id: its rendezvous keys live under this prefix
_JOINED = re.compile(r"(\d+)/(\d+) clients joined")


@dataclass
class NodePlan:
    """Everything this node's launcher does, decided (and validated) before anything starts."""

    node_rank: int
    nnodes: int
    nproc: int
    endpoint: str | None
    join_timeout: float
    argv: list[str]
    env: dict[str, str]
    commands: dict[int, list[str]]  # node -> its one command
    engine: dict = field(default_factory=dict)
    address_file: Path | None = None
    token_file: Path | None = None
    own_token: bool = True  # a per-launch token, removed at exit (not the host's --token-file)
    workdir: Path | None = None  # a temporary folder for the token and address file when none was given

    @property
    def total(self) -> int:
        return self.nproc * self.nnodes


def _check_preset_name(name: str) -> str:
    from engine.config.presets import get_preset, looks_like_model_ref

    if not isinstance(name, str) or not name.strip() or any(ord(c) < 32 for c in name):
        raise InvalidRequest(f"--preset {name!r} is not a preset name, Hub id or folder")
    if not looks_like_model_ref(name):
        get_preset(name)  # InvalidRequest naming the presets
    return name


def plan_node(args) -> NodePlan:
    """Validate the flags and build this node's torchrun argv/env and every node's one command."""
    from engine import devices, settings
    from engine.tp import launch

    layout = _check_layout(args)
    preset = _check_preset_name(args.preset or "tiny-flux")
    precision = str(Precision.parse(args.precision or "fp32", "precision"))
    spec = devices.get_device(args.device) if args.print_command else devices.resolve_device(args.device)
    launch.check_tp_device(spec)
    cache = Path(args.cache_dir or settings.cache_dir()).expanduser()
    warm = _check_warm_modes(args.warm)
    parallel = Parallel.parse(getattr(args, "parallel", None) or Parallel.TENSOR, "parallel")
    shared = _shared_flags(args, warm, parallel)
    commands = {}
    for node in range(layout.nnodes):
        extra = list(shared) + (["--cache-dir", str(args.cache_dir)] if args.cache_dir else [])
        if node == 0:
            extra += _node0_flags(args)
        commands[node] = launch.sidecar_command(spec, replace(layout, node_rank=node), preset=preset,
                                                precision=precision, extra=extra)
    rank_args = ["--device", spec.name, "--preset", preset, "--precision", precision, "--cache-dir", str(cache),
                 *shared]
    plan = NodePlan(node_rank=layout.node_rank, nnodes=layout.nnodes, nproc=layout.nproc, endpoint=layout.rdzv,
                    join_timeout=launch.check_join_timeout(args.join_timeout), argv=[], env={}, commands=commands,
                    engine={"preset": preset, "device": spec.name, "precision": precision,
                            "tp": layout.nproc * layout.nnodes, "parallel": str(parallel)})
    if layout.node_rank == 0:
        rank_args += _plan_rank0(args, plan)
    if args.verbose:
        rank_args.append("-v")
    plan.argv, plan.env = launch.build_launch(spec, layout, cache_dir=cache, sidecar_args=rank_args,
                                              warm_modes=warm)
    return plan


def _check_layout(args):
    """The node layout the flags give (NodeLayout), checked; the join timeout only where nodes join."""
    from engine.tp import launch

    nnodes, node_rank, nproc = args.nnodes, args.node_rank, args.tp
    for name, value, low in (("--tp", nproc, 1), ("--nnodes", nnodes, 1), ("--node-rank", node_rank, 0)):
        if value < low:
            raise InvalidRequest(f"{name} must be >= {low}, got {value}")
    if node_rank >= nnodes:
        raise InvalidRequest(f"--node-rank {node_rank} must be below --nnodes {nnodes} (nodes count from 0)")
    if nnodes > 1 and not args.rdzv_endpoint:
        raise InvalidRequest(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT: node 0's address and a free port "
                             "on it that every node reaches (the same on every node)")
    endpoint = launch.check_rdzv_endpoint(args.rdzv_endpoint) if nnodes > 1 else None
    join_timeout = launch.check_join_timeout(args.join_timeout)
    if not 1 <= args.node_timeout <= 24 * 3600:
        raise InvalidRequest(f"--node-timeout must be between 1 s and a day, got {args.node_timeout}")
    return launch.NodeLayout(nproc, nnodes, node_rank, endpoint, join_timeout if nnodes > 1 else None)


def _check_warm_modes(modes) -> list[str]:
    for mode in modes:
        Mode.parse(mode, "mode")
    return list(modes)


def _shared_flags(args, warm: list[str], parallel) -> list[str]:
    """Flags every node passes on (to its ranks, and in the printed commands)."""
    shared: list[str] = []
    for mode in warm:
        shared += ["--warm", mode]
    if args.dist_timeout:
        shared += ["--dist-timeout", f"{float(args.dist_timeout):g}"]
    shared += ["--node-timeout", f"{float(args.node_timeout):g}"]
    if parallel.context:
        shared += ["--parallel", str(parallel)]
    return shared


def _plan_rank0(args, plan: NodePlan) -> list[str]:
    """Node 0: where rank 0 listens, its token and address file (set on `plan`); returns rank 0's flags."""
    from engine.tp import launch

    rank_args: list[str] = []
    if args.listen:
        host = launch.check_listen_host(args.listen)
        if host not in launch.LOOPBACK_HOSTS and args.token_file is None:
            raise InvalidRequest(
                f"--listen {host} opens rank 0 to the network: pass --token-file FILE too (make one with "
                "`python -m engine.tp.tokens FILE`, copy it to the app's machine over a secure channel) and "
                "keep the address on a private network")
        rank_args += ["--listen", host]
    if args.port:
        if not 0 < args.port < 65536:
            raise InvalidRequest(f"--port {args.port} is not a TCP port")
        rank_args += ["--port", str(args.port)]
    if args.token_file is not None:
        read_token(args.token_file, private=True)  # InvalidRequest: missing, short or readable by others
        plan.token_file, plan.own_token = Path(args.token_file).resolve(), False
    if args.address_file is not None:
        plan.address_file = Path(args.address_file).expanduser().resolve()
    elif not args.print_command:
        plan.workdir = Path(tempfile.mkdtemp(prefix="showcase-tp-"))
        plan.address_file = plan.workdir / "address.json"
    if plan.address_file is not None:
        rank_args += ["--address-file", str(plan.address_file)]
        if plan.token_file is None:  # next to it: flux.json -> flux.token (never the address file itself)
            token = plan.address_file.with_suffix(".token")
            plan.token_file = token if token != plan.address_file else token.with_name(token.name + ".key")
    if args.dump_dir:
        rank_args += ["--dump-dir", str(args.dump_dir)]
    return rank_args


def _node0_flags(args) -> list[str]:
    """Node 0's own flags, for its command in the address file ("start it with ...")."""
    extra = []
    if args.address_file is not None:
        extra += ["--address-file", str(Path(args.address_file).expanduser().resolve())]
    if args.listen:
        extra += ["--listen", str(args.listen)]
    if args.token_file is not None:
        extra += ["--token-file", str(Path(args.token_file).expanduser().resolve())]
    if args.port:
        extra += ["--port", str(int(args.port))]
    return extra


# --------------------------------------------------------------------------------------------------
# watching torchrun
# --------------------------------------------------------------------------------------------------
class _Output:
    """torchrun's output, echoed line by line to ours, the tail kept to explain how it ended."""

    def __init__(self, stream, keep: int = 4000):
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._thread = threading.Thread(target=self._pump, args=(stream,), name="torchrun-output", daemon=True)
        self._thread.start()

    def _pump(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            sys.stdout.buffer.write(raw)
            sys.stdout.flush()
            self.lines.append(raw.decode(errors="replace"))

    def text(self, wait_s: float = 2.0) -> str:
        self._thread.join(wait_s)
        return "".join(self.lines)


def probe_joined(host: str, port: int, nnodes: int, store=None):
    """(store, the nodes that have joined node 0's rendezvous so far), read from the keys torchrun's agents
    write there ("torchelastic/role_info/<node>"); node 0 writes its own only once all have joined. Returns
    (None, None) while the store is not up. Read-only, and not counted as a participant."""
    import datetime
    import socket

    import torch.distributed as dist

    try:
        if store is None:
            # A plain connect first: a TCPStore client dialling a port nobody listens on yet retries and logs a
            # C++ stack trace each time.
            socket.create_connection((host, port), timeout=1).close()
            store = dist.PrefixStore(RDZV_RUN_ID, dist.TCPStore(
                host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=2)))
        joined = {0} | {n for n in range(1, nnodes) if store.check([f"torchelastic/role_info/{n}"])}
        if store.check(["torchelastic/role_info/0"]):
            joined = set(range(nnodes))
        return store, joined
    except Exception:  # noqa: BLE001 - not up yet, or gone: no news
        return None, None


class _RendezvousWatch:
    """Node 0: while the nodes join, say which ones it still waits for; remember the last answer."""

    def __init__(self, plan: NodePlan, done: threading.Event):
        self.plan = plan
        self.done = done
        self.joined: set[int] | None = None
        self.complete = False
        threading.Thread(target=self._run, name="rendezvous-watch", daemon=True).start()

    def _run(self) -> None:
        host, port = self.plan.endpoint.rsplit(":", 1)
        started, last_print, shown, store = time.monotonic(), 0.0, None, None
        while not self.done.wait(2.0):
            store, joined = probe_joined(host.strip("[]"), int(port), self.plan.nnodes, store)
            if joined is None:
                continue
            self.joined = joined
            if len(joined) == self.plan.nnodes:
                self.complete = True
                print(f"[tp sidecar] all {self.plan.nnodes} nodes joined the rendezvous at {self.plan.endpoint}; "
                      f"loading {self.plan.total} ranks", flush=True)
                return
            now = time.monotonic()
            if joined != shown or now - last_print >= 30:
                missing = sorted(set(range(self.plan.nnodes)) - joined)
                left = self.plan.join_timeout - (now - started)
                print(f"[tp sidecar] rendezvous at {self.plan.endpoint}: {len(joined)} of {self.plan.nnodes} nodes "
                      f"joined; waiting for node(s) {', '.join(map(str, missing))} ({max(0.0, left):.0f} s left of "
                      f"--join-timeout)", flush=True)
                shown, last_print = set(joined), now


def _node_list(nodes) -> str:
    nodes = sorted(nodes)
    return ("node " if len(nodes) == 1 else "nodes ") + ", ".join(map(str, nodes))


def explain_exit(plan: NodePlan, code: int | None, log_text: str, joined: set[int] | None = None,
                 stopped_by: str | None = None) -> tuple[int, str]:
    """(exit code, one paragraph) for how this node's torchrun ended: which node did not join, or which rank
    failed on which node (root cause first), or that it was stopped."""
    from engine.tp.client import root_cause

    me = f"node {plan.node_rank}"
    if stopped_by:
        return RankExit.OK, f"{me}: stopped ({stopped_by}); its ranks are gone"
    if code == 0:
        return RankExit.OK, f"{me}: the sidecar shut down cleanly"
    timed_out = "waiting for clients" in log_text and "Timed out" in log_text
    if plan.node_rank == 0 and timed_out:
        m = _JOINED.search(log_text)
        missing = sorted(set(range(plan.nnodes)) - joined) if joined else None
        if not missing and m and int(m.group(1)) == 1:  # only node 0 itself: every other node is missing
            missing = list(range(1, plan.nnodes))
        if not missing:
            count = (plan.nnodes - int(m.group(1))) if m else None
            missing_text = f"{count} node(s)" if count else "some nodes"
        else:
            missing_text = _node_list(missing)
        how = "\n".join(f"  on node {n} run:\n    {shlex.join(plan.commands[n])}" for n in (missing or ())
                        if n in plan.commands)
        return JOIN_TIMEOUT_EXIT, (
            f"{me}: {missing_text} never joined the rendezvous at {plan.endpoint} within {plan.join_timeout:g} s "
            f"(--join-timeout); {m.group(1) + ' of ' + m.group(2) if m else 'not all'} nodes did.\n{how}\n"
            f"  check on the missing machine(s): the command above runs there with the same --nnodes and "
            f"--rdzv-endpoint; {plan.endpoint} is node 0's address as that machine sees it (never 127.0.0.1 "
            f"across machines) and the port is open between the nodes (firewall, security group); the node "
            f"starts within --join-timeout (raise it for slow machines)")
    cause = root_cause(log_text)
    said = re.findall(r"\[tp sidecar\] (group broken|load failed): (.+)", log_text)  # the ranks' own words
    if said:
        return code or 1, f"{me}: the sidecar stopped: {said[-1][1].strip()}" + (f" ({cause})" if cause else "")
    if cause:
        return code or 1, f"{me}: the sidecar stopped: {cause}"
    if plan.node_rank > 0:
        if "trying to connect" in log_text or ("DistNetworkError" in log_text and "connect" in log_text):
            return JOIN_TIMEOUT_EXIT, (
                f"{me}: could not reach node 0's rendezvous at {plan.endpoint} within {plan.join_timeout:g} s "
                f"(--join-timeout): start node 0 first (python -m engine.tp.sidecar ... --node-rank 0) and check "
                f"that {plan.endpoint} is node 0's address as this machine sees it and the port is open")
        if "Connection was likely closed" in log_text or "Broken pipe" in log_text:
            return JOIN_TIMEOUT_EXIT, (
                f"{me}: node 0's rendezvous at {plan.endpoint} closed before the sidecar started: node 0 stopped "
                f"or gave up waiting for another node (see node 0's output; every node must start within "
                f"--join-timeout {plan.join_timeout:g} s)")
    return code or 1, f"{me}: torchrun exited with code {code} (see its output above)"


# --------------------------------------------------------------------------------------------------
# running one node
# --------------------------------------------------------------------------------------------------
def _print_plan(plan: NodePlan) -> None:
    eng = plan.engine
    layout = eng.get("parallel", "tensor")
    what = f"{eng['preset']} {eng['precision']} on {eng['device']}, {'tp' if layout == 'tensor' else layout}{plan.total}"
    if plan.node_rank == 0:
        where = f" over {plan.nnodes} nodes x {plan.nproc} ranks" if plan.nnodes > 1 else f" ({plan.nproc} ranks)"
        print(f"[tp sidecar] node 0 serves {what}{where}", flush=True)
        if plan.nnodes > 1:
            print("[tp sidecar] run on every other node (the token never leaves this machine):", flush=True)
            for node in range(1, plan.nnodes):
                print(f"  node {node}:  {shlex.join(plan.commands[node])}", flush=True)
    else:
        print(f"[tp sidecar] node {plan.node_rank} of {plan.nnodes}: {plan.nproc} ranks of {what}, joining node 0 at "
              f"{plan.endpoint}", flush=True)


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _stop_leftovers(procs: list, wait_s: float = 2.0) -> None:
    """After torchrun is gone: its ranks (own sessions) exit by themselves within a second (watch_parents);
    kill any of ours still there."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=wait_s)


def run_node(plan: NodePlan) -> int:
    """Start this node's torchrun in the foreground, watch it, explain its end. Returns the exit code."""
    import psutil

    if plan.node_rank == 0 and plan.address_file is not None:
        plan.address_file.parent.mkdir(parents=True, exist_ok=True)
        if plan.own_token:
            write_private(plan.token_file, new_token())
        # A fresh file: the previous launch's port is stale. Rank 0 adds host, port and token file.
        write_private(plan.address_file, b"{}")
        update_address(plan.address_file, state="starting", started_at=time.time(), engine=plan.engine,
                       nnodes=plan.nnodes, rdzv_endpoint=plan.endpoint,
                       command=plan.commands[0], node_commands={str(n): c for n, c in plan.commands.items() if n})
        from engine.tp.launch import TOKEN_FILE_VAR

        plan.env[TOKEN_FILE_VAR] = str(plan.token_file)
    _print_plan(plan)
    proc = subprocess.Popen(plan.argv, env=plan.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    output = _Output(proc.stdout)
    done = threading.Event()
    watch = _RendezvousWatch(plan, done) if plan.node_rank == 0 and plan.nnodes > 1 else None
    stop: dict = {}

    def on_signal(signum, frame) -> None:
        if "at" not in stop:
            stop.update(at=time.monotonic(), name=signal.Signals(signum).name)
            try:
                proc.send_signal(signal.SIGTERM)  # torchrun stops its ranks (SIGTERM, then SIGKILL)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    family: dict[int, psutil.Process] = {}
    try:
        ticks = 0
        while proc.poll() is None:
            if ticks % 10 == 0:  # remember the ranks, to make sure none is left at the end
                for p in _descendants(proc.pid):
                    family.setdefault(p.pid, p)
            ticks += 1
            time.sleep(0.1)
            if "at" in stop and time.monotonic() - stop["at"] > STOP_GRACE_S:
                proc.kill()
        done.set()
        _stop_leftovers(list(family.values()))
        code, message = explain_exit(plan, proc.returncode, output.text(), watch.joined if watch else None,
                                     stop.get("name"))
        print(f"[tp sidecar] {message}", file=sys.stderr if code else sys.stdout, flush=True)
        if plan.node_rank == 0 and plan.address_file is not None:
            update_address(plan.address_file, state="stopped", stopped_at=time.time(), reason=message)
        return code
    finally:
        done.set()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:
            proc.kill()
        if plan.own_token and plan.token_file is not None:
            plan.token_file.unlink(missing_ok=True)
        if plan.workdir is not None:
            shutil.rmtree(plan.workdir, ignore_errors=True)


def print_commands(plan: NodePlan) -> None:
    for node in range(plan.nnodes):
        role = "serves" if node == 0 else "joins node 0"
        print(f"node {node} ({role}):\n  {shlex.join(plan.commands[node])}")
    print(f"node {plan.node_rank} starts (torchrun, no shell):\n  {shlex.join(plan.argv)}")


def launcher_main(args, argv: list[str] | None = None) -> int:
    try:
        plan = plan_node(args)
    except ShowcaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return RankExit.USAGE
    if args.print_command:
        print_commands(plan)
        return RankExit.OK
    if plan.node_rank > 0 and (args.address_file or args.token_file or args.listen):
        print("[tp sidecar] note: --address-file, --token-file and --listen are node 0's; this node ignores them",
              file=sys.stderr)
    return run_node(plan)
