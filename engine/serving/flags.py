"""The hosting flags of the web app (app.py): public mode, runtime, budgets, what visitors may choose and cost,
socket bounds; and what they resolve to, once: a HostingChoice (what depends on where the app runs) and the
manager's HostingConfig. The parsed flags are read, never rewritten."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from engine import settings
from engine.config.flags import as_text, comma_list, decimal, device_defaults, one_of, per_device, whole
from engine.config.presets import load_presets
from engine.config.request import API_KEYS_ADMIN, load_api_keys
from engine.errors import InvalidRequest, ShowcaseError
from engine.fleet.config import MAX_REPLICAS, FleetConfig, private_address, resolve_address
from engine.protocol import Mode, Precision
from engine.serving.budget import GIB, parse_size
from engine.serving.cost import DEFAULT_REQUEST_COST, DEFAULT_VISITOR_COST, CostBudget, parse_cost
from engine.serving.hosting import HostingConfig, HostPolicy, Runtime

MAX_QUEUE = 100_000
MAX_ENGINES = 64
MAX_THREADS = 1024
MAX_SECONDS = 7 * 86400.0  # idle-unload and eviction ages: a week


def add_hosting_flags(h, d: dict) -> None:
    """Public or developer mode, the runtime, aot packages and what visitors may choose."""
    precision = one_of(Precision.values, "precision")
    mode = one_of(Mode.values, "mode")
    preset_name = one_of(load_presets, "preset", lower=False)
    h.add_argument("--public", action=argparse.BooleanOptionalAction, default=None,
                   help="hosting mode: visitors choose only what the host offers, host operations need "
                        "--admin-token ($SHOWCASE_PUBLIC=1; default: on when SPACE_ID is set, i.e. on a Space)")
    h.add_argument("--runtime", choices=[str(r) for r in Runtime], default=d["runtime"],
                   help="workers: one worker process per engine; inprocess: engines in the app's process, device "
                        "work in GPU calls (ZeroGPU's spaces.GPU; compile/regional refused, aot instead). Default: "
                        "inprocess when SPACES_ZERO_GPU is set, else workers ($SHOWCASE_RUNTIME)")
    h.add_argument("--aot-dir", default=d["aot_dir"], metavar="DIR",
                   help="aot packages on persistent storage (default: <cache-dir>/aot; on a Space with persistent "
                        "storage, /data/showcase-aot; $SHOWCASE_AOT_DIR)")
    h.add_argument("--aot-repo", default=d["aot_repo"], metavar="REPO_ID",
                   help="a Hub model repo of aot packages (python -m engine export --push-to REPO_ID): packages "
                        "missing locally are downloaded at start-up ($SHOWCASE_AOT_REPO; token: $HF_TOKEN)")
    h.add_argument("--presets", type=comma_list(preset_name), default=d["presets"],
                   help="comma-separated presets visitors may choose (public mode; default: --preset only; "
                        "$SHOWCASE_PRESETS)")
    h.add_argument("--precisions", type=comma_list(precision), default=d["precisions"],
                   help="comma-separated precisions visitors may choose (public mode; default: all; $SHOWCASE_PRECISIONS)")
    h.add_argument("--modes", type=comma_list(mode), default=d["modes"],
                   help="comma-separated modes visitors may choose (public mode; default: all; $SHOWCASE_MODES)")
    h.add_argument("--admin-token", default=d["admin_token"],
                   help="secret that unlocks host operations (restart, warm everything, load past the budget) "
                        "in public mode ($SHOWCASE_ADMIN_TOKEN; never logged)")


def add_fleet_flags(h, d: dict) -> None:
    """Engines on the machines of a Ray cluster (engine/fleet/, docs/multinode.md)."""
    h.add_argument("--ray", nargs="?", const="auto", default=d["ray"], metavar="ADDRESS",
                   help="run engines as Ray actors on the nodes of a Ray cluster, placed by device: ADDRESS as "
                        "`ray start` printed it (host:port), `auto` (the default with a bare --ray: $RAY_ADDRESS, "
                        "else a cluster of this machine), or `local` ($SHOWCASE_RAY)")
    h.add_argument("--replicas", type=whole(1, MAX_REPLICAS), default=as_text(d["replicas"] or 1), metavar="N",
                   help="with --ray: copies of each engine on different nodes; requests go to the least-loaded "
                        "one (default 1; $SHOWCASE_REPLICAS)")
    h.add_argument("--ray-any-address", action="store_true",
                   help="with --public and --ray: join a cluster whose address is neither loopback nor private "
                        "(the cluster's own network must then be private: docs/multinode.md)")


def fleet_config(args, public: bool) -> FleetConfig | None:
    """--ray / --replicas as the manager takes them (None: no cluster). SystemExit naming the flag for a public
    app joining an address that is not loopback or private without --ray-any-address."""
    if not args.ray:
        if int(args.replicas) > 1:
            raise SystemExit("--replicas needs --ray (the copies run on the nodes of a Ray cluster)")
        return None
    address = resolve_address(args.ray, settings.ray_address())
    if public and not private_address(address) and not args.ray_any_address:
        raise SystemExit(f"--ray {address}: a public app joins only a cluster on loopback or a private network "
                         "(a Ray cluster runs whatever its members send it); pass --ray-any-address if that "
                         "network is private all the same")
    return FleetConfig(address=address, replicas=int(args.replicas), start_timeout_s=settings.fleet_start_timeout_s())


def add_budget_flags(h, d: dict) -> None:
    """What the engines of a device may hold, how many compile at once, when idle ones unload."""
    h.add_argument("--memory-budget", type=memory_size, default=d["memory_budget"], metavar="SIZE",
                   help="memory the engines of one device may hold, e.g. 3GiB (default: 50%% of RAM for cpu, "
                        "90%% of free memory for accelerators; $SHOWCASE_MEMORY_BUDGET)")
    h.add_argument("--max-engines", type=whole(1, MAX_ENGINES), default=d["max_engines"],
                   help=f"engines per device at once (default per device kind: {per_device('max_engines')}; "
                        "$SHOWCASE_MAX_ENGINES)")
    h.add_argument("--compile-jobs", type=whole(1, MAX_THREADS), default=d["compile_jobs"],
                   help="bucket compiles at once on this host (default: one per 4 cores, at least 1; "
                        "$SHOWCASE_COMPILE_JOBS)")
    h.add_argument("--idle-unload", type=decimal(1, MAX_SECONDS, zero="off"), default=d["idle_unload"],
                   metavar="SECONDS",
                   help="unload an engine nobody used for this long (default: off; $SHOWCASE_IDLE_UNLOAD)")
    h.add_argument("--worker-threads", type=whole(1, MAX_THREADS), default=d["worker_threads"], metavar="N",
                   help="compute threads per cpu engine (default: cores / --max-engines, at least 1; "
                        "$SHOWCASE_WORKER_THREADS)")
    h.add_argument("--public-evict-after", type=decimal(0, MAX_SECONDS), default=60.0, metavar="SECONDS",
                   help="public mode: a visitor's request may unload an idle engine only after this long unused")


def add_visitor_flags(h, d: dict) -> None:
    """What one client may queue and cost, and whose X-Forwarded-For names the client."""
    h.add_argument("--client-events", type=whole(1, MAX_QUEUE, zero="unbounded"), default=d["client_events"],
                   metavar="N",
                   help="requests one client (its address) may have waiting or running at once (default: 8 in "
                        "public mode, unbounded otherwise; 0: unbounded; $SHOWCASE_CLIENT_EVENTS)")
    h.add_argument("--max-request-cost", type=token_steps("--max-request-cost"), default=as_text(d["max_request_cost"]),
                   metavar="TOKEN_STEPS",
                   help="public mode: the most one visitor request may cost, in denoiser steps x latent tokens "
                        "(x configurations x prompts for Compare); a costlier one is refused with what fits "
                        f"(default {DEFAULT_REQUEST_COST}: 64 steps at tiny-shapes' 128x128; 0: unbounded; "
                        "$SHOWCASE_MAX_REQUEST_COST)")
    h.add_argument("--max-visitor-cost", type=token_steps("--max-visitor-cost"), default=as_text(d["max_visitor_cost"]),
                   metavar="TOKEN_STEPS",
                   help="public mode: the most one client address may have queued and running at once "
                        f"(default {DEFAULT_VISITOR_COST}; 0: unbounded; $SHOWCASE_MAX_VISITOR_COST)")
    h.add_argument("--api-keys", type=api_keys_flag, default=d["api_keys"], metavar="FILE",
                   help="require an API key on the OpenAI-compatible /v1 API (Authorization: Bearer <key>): FILE "
                        "holds the keys, one a line, re-read when it changes; 'admin-token': only --admin-token. "
                        "The admin token is always a key and makes the caller the host (default: no key needed; "
                        "$SHOWCASE_API_KEYS; keys are never logged)")
    h.add_argument("--trusted-proxies", default=d["trusted_proxies"], metavar="NETS",
                   help="comma-separated addresses/networks of reverse proxies whose X-Forwarded-For names the "
                        "client (default: none, the connection's address is the client; $SHOWCASE_TRUSTED_PROXIES)")


def add_socket_flags(h, d: dict) -> None:
    """Socket bounds (ui/sockets.py, same defaults; $SHOWCASE_<FLAG NAME>, e.g. $SHOWCASE_MAX_CONNECTIONS):
    connections and request headers, before the HTTP parser. An environment value is checked as the flag would be."""
    h.add_argument("--max-connections", type=whole(16, 1_000_000), default=as_text(d["max_connections"] or 1000),
                   metavar="N",
                   help="open connections, all clients together; past it an idle one of the address holding the most "
                        "makes room, or the new one gets 503 (default 1000)")
    h.add_argument("--max-connections-per-client", type=whole(1, 1_000_000, zero="unbounded"),
                   default=as_text(d["max_connections_per_client"]), metavar="N",
                   help="open connections from one address; past it 503 (default: 64 in public mode, unbounded "
                        "otherwise; 0: unbounded; a --trusted-proxies peer counts only in the total)")
    h.add_argument("--max-streams-per-client", type=whole(1, 1_000_000, zero="unbounded"),
                   default=as_text(d["max_streams_per_client"]), metavar="N",
                   help="event streams one address holds open (heartbeats, queue streams, MCP streams); past it "
                        "429, and at the --max-connections cap the address holding the most gives up its oldest "
                        "(default: 16 in public mode, unbounded otherwise; 0: unbounded)")
    h.add_argument("--header-timeout", type=decimal(1.0, 600.0), default=as_text(d["header_timeout"] or 10.0),
                   metavar="SECONDS",
                   help="a request's headers must arrive within this from connecting (or from its first byte on a "
                        "kept-alive connection), else 408 and closed (default 10)")
    h.add_argument("--max-header-bytes", type=header_bytes, default=as_text(d["max_header_bytes"] or 32 * 1024),
                   metavar="SIZE", help="a request line and headers together; past it 431 and closed (default 32KiB)")
    h.add_argument("--max-headers", type=whole(8, 10_000), default=as_text(d["max_headers"] or 100), metavar="N",
                   help="header lines in a request; past it 431 and closed (default 100)")


def api_keys_flag(text: str) -> str:
    """--api-keys: 'admin-token' or a readable file holding at least one key."""
    if text != API_KEYS_ADMIN:
        try:
            load_api_keys(text)
        except InvalidRequest as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


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
                      evict_idle_after_s=args.public_evict_after, cost=cost_budget(args))


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


