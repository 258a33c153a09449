"""The hosting flags of the web app (app.py): public mode, runtime, budgets, what visitors may choose and cost,
socket bounds; and what they resolve to, once: a HostingChoice (what depends on where the app runs) and the
manager's HostingConfig. The parsed flags are read, never rewritten."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from engine import settings
from engine.config.flags import comma_list, device_defaults, one_of
from engine.config.presets import load_presets
from engine.config.request import API_KEYS_ADMIN, check_secret, load_api_keys
from engine.errors import InvalidRequest, ShowcaseError
from engine.fleet.config import MAX_REPLICAS, FleetConfig, private_address, resolve_address
from engine.protocol import Mode, Precision
from engine.protocol.flagfields import OPTIONAL_BOOL, SWITCH, Decimal, Whole, flag
from engine.serving.budget import GIB, parse_size
from engine.serving.cost import DEFAULT_REQUEST_COST, DEFAULT_VISITOR_COST, CostBudget, parse_cost
from engine.serving.hosting import HostingConfig, HostPolicy, Runtime

MAX_QUEUE = 100_000
MAX_ENGINES = 64
MAX_THREADS = 1024
MAX_SECONDS = 7 * 86400.0  # idle-unload and eviction ages: a week


# The hosting flags, one field each (engine/config/flags.py turns a field with `flag(...)` metadata into its
# flag; `env` names its environment default in settings.server_defaults()). Their values are read off the
# parsed flags by the functions below.


def _preset_names(text: str) -> str:
    return comma_list(one_of(load_presets, "preset", lower=False))(text)


@dataclass(frozen=True)
class HostingFlags:
    """Public or developer mode, the runtime, aot packages and what visitors may choose."""

    public: bool | None = field(default=None, metadata=flag(
        "hosting mode: visitors choose only what the host offers, host operations need --admin-token "
        "($SHOWCASE_PUBLIC=1; default: on when SPACE_ID is set, i.e. on a Space)", kind=OPTIONAL_BOOL))
    runtime: str | None = field(default=None, metadata=flag(
        "workers: one worker process per engine; inprocess: engines in the app's process, device work in GPU "
        "calls (ZeroGPU's spaces.GPU; compile/regional refused, aot instead). Default: inprocess when "
        "SPACES_ZERO_GPU is set, else workers ($SHOWCASE_RUNTIME)", choices=tuple(str(r) for r in Runtime),
        env="runtime"))
    aot_dir: str | None = field(default=None, metadata=flag(
        "aot packages on persistent storage (default: <cache-dir>/aot; on a Space with persistent storage, "
        "/data/showcase-aot; $SHOWCASE_AOT_DIR)", metavar="DIR", env="aot_dir"))
    aot_repo: str | None = field(default=None, metadata=flag(
        "a Hub model repo of aot packages (python -m engine export --push-to REPO_ID): packages missing locally "
        "are downloaded at start-up ($SHOWCASE_AOT_REPO; token: $HF_TOKEN)", metavar="REPO_ID", env="aot_repo"))
    presets: str | None = field(default=None, metadata=flag(
        "comma-separated presets visitors may choose (public mode; default: --preset only; $SHOWCASE_PRESETS)",
        check=_preset_names, env="presets"))
    pin: str | None = field(default=None, metadata=flag(
        "comma-separated presets whose engines a visitor's engine never evicts (public mode; the default engine "
        "always is pinned; visitors' engines share what the budget leaves)", check=_preset_names))
    precisions: str | None = field(default=None, metadata=flag(
        "comma-separated precisions visitors may choose (public mode; default: all; $SHOWCASE_PRECISIONS)",
        check=comma_list(one_of(Precision.values, "precision")), env="precisions"))
    modes: str | None = field(default=None, metadata=flag(
        "comma-separated modes visitors may choose (public mode; default: all; $SHOWCASE_MODES)",
        check=comma_list(one_of(Mode.values, "mode")), env="modes"))
    admin_token: str | None = field(default=None, metadata=flag(
        "secret that unlocks host operations (restart, warm everything, load past the budget) in public mode "
        "($SHOWCASE_ADMIN_TOKEN; never logged; at least 16 characters)", env="admin_token",
        check=lambda text: secret_flag(text)))


@dataclass(frozen=True)
class FleetFlags:
    """Engines on the machines of a Ray cluster (engine/fleet/, docs/multinode.md)."""

    ray: str | None = field(default=None, metadata=flag(
        "run engines as Ray actors on the nodes of a Ray cluster, placed by device: ADDRESS as `ray start` printed "
        "it (host:port), `auto` (the default with a bare --ray: $RAY_ADDRESS, else a cluster of this machine), or "
        "`local` ($SHOWCASE_RAY)", nargs="?", const="auto", metavar="ADDRESS", env="ray"))
    replicas: int = field(default=1, metadata=flag(
        "with --ray: copies of each engine on different nodes; requests go to the least-loaded one (default 1; "
        "$SHOWCASE_REPLICAS)", check=Whole(1, MAX_REPLICAS), metavar="N", env="replicas", as_text=True))
    ray_any_address: bool = field(default=False, metadata=flag(
        "with --public and --ray: join a cluster whose address is neither loopback nor private (the cluster's "
        "own network must then be private: docs/multinode.md)", kind=SWITCH))


def fleet_config(args, public: bool) -> FleetConfig | None:
    """--ray / --replicas as the manager takes them (None: no cluster). SystemExit naming the flag for a public
    app joining an address that is not loopback or private without --ray-any-address."""
    if not args.ray:
        if int(args.replicas) > 1:
            raise SystemExit("--replicas needs --ray (the copies run on the nodes of a Ray cluster)")
        return None
    address = resolve_address(args.ray, settings.ray_address(), settings.ray_current_cluster())
    if public and not private_address(address) and not args.ray_any_address:
        raise SystemExit(f"--ray {address}: a public app joins only a cluster on loopback or a private network "
                         "(a Ray cluster runs whatever its members send it); pass --ray-any-address if that "
                         "network is private all the same")
    return FleetConfig(address=address, replicas=int(args.replicas), start_timeout_s=settings.fleet_start_timeout_s(),
                       temp_dir=str(Path(args.cache_dir or settings.cache_dir()).expanduser().absolute() / "ray"))


@dataclass(frozen=True)
class BudgetFlags:
    """What the engines of a device may hold, how many compile at once, when idle ones unload."""

    memory_budget: str | None = field(default=None, metadata=flag(
        "memory the engines of one device may hold, e.g. 3GiB (default: 50%% of RAM for cpu, 90%% of free memory "
        "for accelerators; $SHOWCASE_MEMORY_BUDGET)", check=lambda text: memory_size(text), metavar="SIZE",
        env="memory_budget"))
    max_engines: int | None = field(default=None, metadata=flag(
        "engines per device at once (default per device kind: {per_device[max_engines]}; $SHOWCASE_MAX_ENGINES)",
        check=Whole(1, MAX_ENGINES), env="max_engines"))
    compile_jobs: int | None = field(default=None, metadata=flag(
        "bucket compiles at once on this host (default: one per 4 cores, at least 1; $SHOWCASE_COMPILE_JOBS)",
        check=Whole(1, MAX_THREADS), env="compile_jobs"))
    idle_unload: float | None = field(default=None, metadata=flag(
        "unload an engine nobody used for this long (default: off; $SHOWCASE_IDLE_UNLOAD)",
        check=Decimal(1, MAX_SECONDS, zero="off"), metavar="SECONDS", env="idle_unload"))
    worker_threads: int | None = field(default=None, metadata=flag(
        "compute threads per cpu engine (default: cores / --max-engines, at least 1; $SHOWCASE_WORKER_THREADS)",
        check=Whole(1, MAX_THREADS), metavar="N", env="worker_threads"))
    public_evict_after: float = field(default=60.0, metadata=flag(
        "public mode: a visitor's request may unload an idle engine only after this long unused",
        check=Decimal(0, MAX_SECONDS), metavar="SECONDS"))


@dataclass(frozen=True)
class VisitorFlags:
    """What one client may queue and cost, and whose X-Forwarded-For names the client."""

    client_events: int | None = field(default=None, metadata=flag(
        "requests one client (its address) may have waiting or running at once (default: 8 in public mode, "
        "unbounded otherwise; 0: unbounded; $SHOWCASE_CLIENT_EVENTS)", check=Whole(1, MAX_QUEUE, zero="unbounded"),
        metavar="N", env="client_events"))
    max_request_cost: str | None = field(default=None, metadata=flag(
        "public mode: the most one visitor request may cost, in denoiser steps x latent tokens (x configurations x "
        "prompts for Compare); a costlier one is refused with what fits (default "
        f"{DEFAULT_REQUEST_COST}: 64 steps at tiny-shapes' 128x128; 0: unbounded; $SHOWCASE_MAX_REQUEST_COST)",
        check=lambda text: token_steps("--max-request-cost")(text), metavar="TOKEN_STEPS", env="max_request_cost",
        as_text=True))
    max_visitor_cost: str | None = field(default=None, metadata=flag(
        "public mode: the most one client address may have queued and running at once (default "
        f"{DEFAULT_VISITOR_COST}; 0: unbounded; $SHOWCASE_MAX_VISITOR_COST)",
        check=lambda text: token_steps("--max-visitor-cost")(text), metavar="TOKEN_STEPS", env="max_visitor_cost",
        as_text=True))
    api_keys: str | None = field(default=None, metadata=flag(
        "require an API key on the OpenAI-compatible /v1 API (Authorization: Bearer <key>): FILE holds the keys, "
        "one a line, re-read when it changes; 'admin-token': only --admin-token. The admin token is always a key "
        "and makes the caller the host (default: no key needed; $SHOWCASE_API_KEYS; keys are never logged)",
        check=lambda text: api_keys_flag(text), metavar="FILE", env="api_keys"))
    trusted_proxies: str | None = field(default=None, metadata=flag(
        "comma-separated addresses/networks of reverse proxies whose X-Forwarded-For names the client (default: "
        "none, the connection's address is the client; $SHOWCASE_TRUSTED_PROXIES)", metavar="NETS",
        env="trusted_proxies"))


@dataclass(frozen=True)
class SocketFlags:
    """Socket bounds (ui/sockets.py, same defaults; $SHOWCASE_<FLAG NAME>, e.g. $SHOWCASE_MAX_CONNECTIONS):
    connections and request headers, before the HTTP parser; and request bodies' deadline (ui/bodies.py). An
    environment value is checked as the flag would be."""

    max_connections: int = field(default=1000, metadata=flag(
        "open connections, all clients together; past it an idle one of the address holding the most makes room, "
        "or the new one gets 503 (default 1000)", check=Whole(16, 1_000_000), metavar="N", env="max_connections",
        as_text=True))
    max_connections_per_client: int | None = field(default=None, metadata=flag(
        "open connections from one address; past it 503 (default: 64 in public mode, unbounded otherwise; 0: "
        "unbounded; a --trusted-proxies peer counts only in the total)",
        check=Whole(1, 1_000_000, zero="unbounded"), metavar="N", env="max_connections_per_client", as_text=True))
    max_streams_per_client: int | None = field(default=None, metadata=flag(
        "event streams one address holds open (heartbeats, queue streams, MCP streams); past it 429, and at the "
        "--max-connections cap the address holding the most gives up its oldest (default: 16 in public mode, "
        "unbounded otherwise; 0: unbounded)", check=Whole(1, 1_000_000, zero="unbounded"), metavar="N",
        env="max_streams_per_client", as_text=True))
    header_timeout: float = field(default=10.0, metadata=flag(
        "a request's headers must arrive within this from connecting (or from its first byte on a kept-alive "
        "connection), else 408 and closed (default 10)", check=Decimal(1.0, 600.0), metavar="SECONDS",
        env="header_timeout", as_text=True))
    max_header_bytes: int = field(default=32 * 1024, metadata=flag(
        "a request line and headers together; past it 431 and closed (default 32KiB)",
        check=lambda text: header_bytes(text), metavar="SIZE", env="max_header_bytes", as_text=True))
    max_headers: int = field(default=100, metadata=flag(
        "header lines in a request; past it 431 and closed (default 100)", check=Whole(8, 10_000), metavar="N",
        env="max_headers", as_text=True))
    body_min_rate: float = field(default=240.0, metadata=flag(
        "a request body must arrive at this many bytes/s on average after its first 10 s, else 408 and closed "
        "(default 240; 0: no rate)", check=Decimal(1.0, 1e9, zero="no rate"), metavar="BYTES_PER_S",
        env="body_min_rate", as_text=True))
    body_timeout: float = field(default=300.0, metadata=flag(
        "a request body must arrive whole within this from its head, else 408 and closed (default 300; 0: "
        "unbounded)", check=Decimal(1.0, 86400.0, zero="unbounded"), metavar="SECONDS", env="body_timeout",
        as_text=True))


HOSTING_FLAGS = (HostingFlags, BudgetFlags, VisitorFlags, SocketFlags)  # app.py's "hosting" group, in order


def api_keys_flag(text: str) -> str:
    """--api-keys: 'admin-token' or a readable file holding at least one key."""
    if text != API_KEYS_ADMIN:
        try:
            load_api_keys(text)
        except InvalidRequest as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def secret_flag(text: str) -> str:
    """--admin-token: long enough not to be guessed."""
    try:
        return check_secret(text)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def memory_size(text: str) -> str:
    """--memory-budget: a size no smaller than the least any engine is estimated to need (a worker process
    alone: DeviceSpec.process_overhead_bytes, the smallest over the devices; each device's own figure is
    checked once the device is known)."""
    try:
        size = parse_size(text)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    floor = min((device_defaults("process_overhead_bytes") or {"": 0}).values())
    if size is not None and size < floor:
        raise argparse.ArgumentTypeError(f"{text} is smaller than any engine (a worker process alone is estimated "
                                         f"at {floor / GIB:.2f} GiB); allowed: at least {floor / 2**20:.0f}MiB")
    return text


def token_steps(flag: str):
    """--max-request-cost / --max-visitor-cost: checked as parsed; the text is kept (parse_cost reads it)."""
    def check(text: str) -> str:
        try:
            parse_cost(text, flag)
        except InvalidRequest as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag} ")) from None
        return text

    return check


def header_bytes(text: str) -> int:
    """--max-header-bytes: a size (32KiB, 65536) from 1 KiB to 1 MiB."""
    try:
        size = parse_size(text)
    except ShowcaseError:
        size = None
    if size is None or not 1024 <= size <= 1024 * 1024:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size from 1KiB to 1MiB (e.g. 32KiB)")
    return size


SPACE_DATA = "/data"  # a Space's persistent storage, when the host bought it


@dataclass(frozen=True)
class HostingChoice:
    """What depends on where the app runs, resolved once: public mode, the runtime, the default mode and the
    aot folder; `lines` say why each was chosen."""

    public: bool
    runtime: Runtime
    mode: str
    aot_dir: str | None
    lines: tuple[str, ...]


def resolve_hosting(args, mode: str | None = None) -> HostingChoice:
    """Public mode, runtime, default mode (`mode`, else the flag's) and aot folder for this host, and why."""
    mode = mode or args.mode
    if args.public is None:
        public, why = settings.hosting_mode()
    else:
        public, why = args.public, "--public" if args.public else "--no-public"
    lines = [f"hosting mode: {'public' if public else 'developer'} ({why})"]
    if args.runtime is None:
        runtime, why = settings.runtime_default()
    else:
        runtime, why = args.runtime, "--runtime / $SHOWCASE_RUNTIME"
    runtime = Runtime(runtime)
    lines.append(f"runtime: {runtime} ({why})")
    if runtime is Runtime.INPROCESS:
        if Mode.parse(mode, "mode") in (Mode.COMPILE, Mode.REGIONAL):
            lines.append(f"default mode: aot instead of {mode} (the in-process runtime runs no torch.compile)")
            mode = str(Mode.AOT)
        if args.tp > 1 or args.tp_address:
            raise SystemExit("--tp and --tp-address need --runtime workers (torchrun ranks cannot run in-process)")
    aot_dir = args.aot_dir
    if aot_dir is None and settings.space_id() and os.access(SPACE_DATA, os.W_OK):
        aot_dir = os.path.join(SPACE_DATA, "showcase-aot")
    if aot_dir:
        lines.append(f"aot packages: {aot_dir}" + (f", missing ones from the Hub repo {args.aot_repo}"
                                                   if args.aot_repo else ""))
    return HostingChoice(public, runtime, mode, aot_dir, tuple(lines))


def _choices(text: str | None, parse) -> tuple | None:
    return tuple(parse(t) for t in text.split(",") if t.strip()) if text else None


def host_policy(args, public: bool, preset: str | None = None):
    """What visitors may do: everything on a developer's machine; the host's lists in public mode (default:
    the default engine's `preset` only)."""
    if not public:
        return HostPolicy()
    presets = _choices(args.presets, str.strip) or (preset or args.preset,)
    return HostPolicy(public=True, presets=presets,
                      precisions=_choices(args.precisions, lambda t: Precision.parse(t, "precision")),
                      modes=_choices(args.modes, lambda t: Mode.parse(t, "mode")),
                      evict_idle_after_s=args.public_evict_after, cost=cost_budget(args),
                      pinned=_choices(args.pin, str.strip) or ())


def hosting_config(args, hosting: HostingChoice, preset: str):
    """The manager's HostingConfig from the flags and the resolved hosting."""
    fleet = fleet_config(args, hosting.public)
    if fleet is not None and hosting.runtime is Runtime.INPROCESS:
        raise SystemExit("--ray needs --runtime workers (its engines run in actors on the cluster's nodes)")
    return HostingConfig(memory_budget=parse_size(args.memory_budget), max_engines=args.max_engines,
                         compile_jobs=args.compile_jobs, idle_unload_s=args.idle_unload,
                         worker_threads=args.worker_threads, runtime=hosting.runtime,
                         policy=host_policy(args, hosting.public, preset),
                         fleet=fleet)


def cost_budget(args):
    """The visitors' cost budgets (engine/serving/cost.py) from the flags; a bad value exits naming the flag."""
    try:
        request = parse_cost(DEFAULT_REQUEST_COST if args.max_request_cost is None else args.max_request_cost,
                             "--max-request-cost")
        visitor = parse_cost(DEFAULT_VISITOR_COST if args.max_visitor_cost is None else args.max_visitor_cost,
                             "--max-visitor-cost")
    except InvalidRequest as exc:
        raise SystemExit(str(exc)) from None
    return CostBudget(request=request, visitor=visitor)


