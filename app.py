"""Diffusion Showcase web app: flags -> engine manager (default engine pre-warmed) -> Gradio UI.

    python app.py                      # tiny-shapes on the best device, compile mode, http://127.0.0.1:7860
    python app.py --device cpu --precision bf16 --warm 64x64 --auth user:secret
    python app.py --tp-address /srv/tp/flux2.json   # serve a sidecar started on its nodes (docs/multinode.md)

Every flag falls back to an environment variable (engine/settings.py server_defaults()), then to
the built-in default. Engine workers are spawned processes that re-import this file, so nothing
heavy happens at import time.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from engine import settings

log = logging.getLogger("app")


# Bounds of the numeric flags: each value is checked as the flags are parsed, before anything loads.
MAX_QUEUE = 100_000
MAX_ENGINES = 64
MAX_THREADS = 1024
MAX_RANKS = 256
MAX_SECONDS = 7 * 86400.0  # idle-unload and eviction ages: a week


def _text(value):
    """A default as text: argparse checks a text default with the flag's type, so an environment variable
    gets the same check as the flag."""
    return None if value is None else str(value)


def build_parser() -> argparse.ArgumentParser:
    from engine import settings
    from engine.config.flags import (
        OneLineParser,
        add_engine_arguments,
        comma_list,
        decimal,
        one_of,
        per_device,
        whole,
    )
    from engine.config.presets import load_presets
    from engine.pipeline.attention import BACKENDS
    from engine.protocol import Mode, Precision
    from engine.serving.cost import DEFAULT_REQUEST_COST, DEFAULT_VISITOR_COST

    d = settings.server_defaults()
    precision = one_of(Precision.values, "precision")
    mode = one_of(Mode.values, "mode")
    preset_name = one_of(load_presets, "preset", lower=False)
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--host", default=d["host"], help="interface to bind (default 127.0.0.1; $SHOWCASE_HOST)")
    s.add_argument("--port", type=whole(1, 65535), default=_text(d["port"]), help="port (default 7860; $SHOWCASE_PORT)")
    s.add_argument("--share", action="store_true", help="opt in to a public gradio.live share link")
    s.add_argument("--auth", type=auth_text, default=d["auth"], metavar="USER:PASS",
                   help="require this login (Gradio's own auth; $SHOWCASE_AUTH)")
    s.add_argument("--queue-size", type=whole(1, MAX_QUEUE), default=_text(d["queue_size"]),
                   help="events that may wait in the queue before new ones are refused ($SHOWCASE_QUEUE_SIZE)")
    s.add_argument("--theme", default=None, help="a Gradio theme name (default: Soft)")
    s.add_argument("-v", "--verbose", action="store_true")
    s.add_argument("--log-format", choices=("text", "json"), default=d["log_format"],
                   help="console lines of the app and its workers: text, or one JSON object per line with the "
                        "request id (for hosts that ship logs; $SHOWCASE_LOG_FORMAT)")
    s.add_argument("--mcp", action=argparse.BooleanOptionalAction, default=d["mcp"],
                   help="also serve the API as MCP tools for agents at /gradio_api/mcp/ (needs pip install "
                        "\".[mcp]\"; default off; $SHOWCASE_MCP=1)")
    e = p.add_argument_group("default engine")
    e.add_argument("--preset", type=preset_or_model, default=d["preset"], help="model preset ($SHOWCASE_PRESET)")
    e.add_argument("--device", default=d["device"], help="device or 'auto' ($SHOWCASE_DEVICE)")
    e.add_argument("--precision", type=precision, default=d["precision"], help=f"{', '.join(Precision.values())} ($SHOWCASE_PRECISION)")
    e.add_argument("--mode", type=mode, default=d["mode"], help=f"{', '.join(Mode.values())} ($SHOWCASE_MODE)")
    e.add_argument("--config-from", default=None, metavar="FILE",
                   help="the default engine and Generate's selectors from an advisor result (python -m engine "
                        "advise --out FILE, or the Advisor tab's saved JSON): its pick's preset, device, "
                        "precision, mode, step cache and attention backend")
    e.add_argument("--tp", type=whole(1, MAX_RANKS), default=1,
                   help="run the default engine over N ranks (a torchrun sidecar)")
    e.add_argument("--parallel", choices=("tensor", "ulysses", "ring"), default="tensor",
                   help="how --tp ranks split the transformer: tensor (weights sharded), ulysses or ring "
                        "(context parallel: whole transformer on each rank, tokens split)")
    e.add_argument("--tp-address", default=None, metavar="FILE",
                   help="serve a running tensor-parallel sidecar as the default engine: FILE is the address file "
                        "its node 0 wrote (python -m engine.tp.sidecar ... --address-file FILE; the token is read "
                        "from the 0600 file it names). It may span several machines; the app never starts, "
                        "restarts or stops it, shows it down with the reason when it stops, and re-attaches when "
                        "it is back")
    e.add_argument("--warm", type=warm_text, default=d["warm"],
                   help="buckets to pre-warm at start-up in --mode: 'all', 'none' or e.g. '64x64,128x128' "
                        "($SHOWCASE_WARM)")
    h = p.add_argument_group("hosting (a Space or a shared box: see README 'Hosting')")
    h.add_argument("--public", action=argparse.BooleanOptionalAction, default=None,
                   help="hosting mode: visitors choose only what the host offers, host operations need "
                        "--admin-token ($SHOWCASE_PUBLIC=1; default: on when SPACE_ID is set, i.e. on a Space)")
    h.add_argument("--runtime", choices=("workers", "inprocess"), default=d["runtime"],
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
    h.add_argument("--client-events", type=whole(1, MAX_QUEUE, zero="unbounded"), default=d["client_events"],
                   metavar="N",
                   help="requests one client (its address) may have waiting or running at once (default: 8 in "
                        "public mode, unbounded otherwise; 0: unbounded; $SHOWCASE_CLIENT_EVENTS)")
    h.add_argument("--max-request-cost", type=token_steps("--max-request-cost"), default=_text(d["max_request_cost"]),
                   metavar="TOKEN_STEPS",
                   help="public mode: the most one visitor request may cost, in denoiser steps x latent tokens "
                        "(x configurations x prompts for Compare); a costlier one is refused with what fits "
                        f"(default {DEFAULT_REQUEST_COST}: 64 steps at tiny-shapes' 128x128; 0: unbounded; "
                        "$SHOWCASE_MAX_REQUEST_COST)")
    h.add_argument("--max-visitor-cost", type=token_steps("--max-visitor-cost"), default=_text(d["max_visitor_cost"]),
                   metavar="TOKEN_STEPS",
                   help="public mode: the most one client address may have queued and running at once "
                        f"(default {DEFAULT_VISITOR_COST}; 0: unbounded; $SHOWCASE_MAX_VISITOR_COST)")
    h.add_argument("--trusted-proxies", default=d["trusted_proxies"], metavar="NETS",
                   help="comma-separated addresses/networks of reverse proxies whose X-Forwarded-For names the "
                        "client (default: none, the connection's address is the client; $SHOWCASE_TRUSTED_PROXIES)")
    # Socket bounds (ui/sockets.py, same defaults; $SHOWCASE_<FLAG NAME>, e.g. $SHOWCASE_MAX_CONNECTIONS): connections
    # and request headers, before the HTTP parser. An environment value is checked as the flag would be.
    h.add_argument("--max-connections", type=whole(16, 1_000_000), default=_text(d["max_connections"] or 1000),
                   metavar="N",
                   help="open connections, all clients together; past it an idle one of the address holding the most "
                        "makes room, or the new one gets 503 (default 1000)")
    h.add_argument("--max-connections-per-client", type=whole(1, 1_000_000, zero="unbounded"),
                   default=_text(d["max_connections_per_client"]), metavar="N",
                   help="open connections from one address; past it 503 (default: 64 in public mode, unbounded "
                        "otherwise; 0: unbounded; a --trusted-proxies peer counts only in the total)")
    h.add_argument("--header-timeout", type=decimal(1.0, 600.0), default=_text(d["header_timeout"] or 10.0),
                   metavar="SECONDS",
                   help="a request's headers must arrive within this from connecting (or from its first byte on a "
                        "kept-alive connection), else 408 and closed (default 10)")
    h.add_argument("--max-header-bytes", type=header_bytes, default=_text(d["max_header_bytes"] or 32 * 1024),
                   metavar="SIZE", help="a request line and headers together; past it 431 and closed (default 32KiB)")
    h.add_argument("--max-headers", type=whole(8, 10_000), default=_text(d["max_headers"] or 100), metavar="N",
                   help="header lines in a request; past it 431 and closed (default 100)")
    add_engine_arguments(p, attention_backends=BACKENDS)
    return p


def preset_or_model(text: str) -> str:
    """--preset: a preset of presets/models.toml, or a Hub id / local folder (checked when it loads)."""
    from engine.config.validation import check_preset_name
    from engine.errors import InvalidRequest

    try:
        return check_preset_name(text)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def warm_text(text: str) -> str:
    """--warm: 'all', 'none' or WxH sizes."""
    from engine.errors import InvalidRequest

    try:
        warm_sizes(text)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(f"{exc}; allowed: all, none or sizes like 64x64,128x128") from None
    return text


def auth_text(text: str) -> str:
    """--auth: USER:PASSWORD (the value is a secret: never repeated in the message)."""
    user, sep, password = str(text).partition(":")
    if not sep or not user or not password:
        raise argparse.ArgumentTypeError("must be USER:PASSWORD, both non-empty")
    return text


def memory_size(text: str) -> str:
    """--memory-budget: a size no smaller than the least any engine is estimated to need (a worker process
    alone: DeviceSpec.process_overhead_bytes, the smallest over the devices; each device's own figure is
    checked once the device is known)."""
    from engine.config.flags import device_defaults
    from engine.errors import InvalidRequest
    from engine.serving.budget import GIB, parse_size

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
        from engine.errors import InvalidRequest
        from engine.serving.cost import parse_cost

        try:
            parse_cost(text, flag)
        except InvalidRequest as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag} ")) from None
        return text

    return check


def header_bytes(text: str) -> int:
    """--max-header-bytes: a size (32KiB, 65536) from 1 KiB to 1 MiB."""
    from engine.errors import ShowcaseError
    from engine.serving.budget import parse_size

    try:
        size = parse_size(text)
    except ShowcaseError:
        size = None
    if size is None or not 1024 <= size <= 1024 * 1024:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size from 1KiB to 1MiB (e.g. 32KiB)")
    return size


def warm_sizes(spec: str) -> tuple[str, ...] | None:
    """'all' -> None (every bucket of the preset), 'none' -> (), else the listed sizes."""
    from engine.protocol import Size

    spec = (spec or "all").strip().lower()
    if spec == "all":
        return None
    if spec in ("none", ""):
        return ()
    return tuple(str(Size.parse(s)) for s in spec.split(","))


def _choices(text: str | None, parse) -> tuple | None:
    return tuple(parse(t) for t in text.split(",") if t.strip()) if text else None


SPACE_DATA = "/data"  # a Space's persistent storage, when the host bought it


def resolve_hosting(args) -> list[str]:
    """Fill in what depends on where the app runs (public mode, runtime, mode, aot folder) and say why."""
    from engine import settings
    from engine.protocol import Mode

    lines = []
    if args.public is None:
        args.public, why = settings.hosting_mode()
    else:
        why = "--public" if args.public else "--no-public"
    lines.append(f"hosting mode: {'public' if args.public else 'developer'} ({why})")
    if args.runtime is None:
        args.runtime, why = settings.runtime_default()
    else:
        why = "--runtime / $SHOWCASE_RUNTIME"
    lines.append(f"runtime: {args.runtime} ({why})")
    if args.runtime == "inprocess":
        if Mode.parse(args.mode, "mode") in (Mode.COMPILE, Mode.REGIONAL):
            lines.append(f"default mode: aot instead of {args.mode} (the in-process runtime runs no torch.compile)")
            args.mode = str(Mode.AOT)
        if args.tp > 1 or args.tp_address:
            raise SystemExit("--tp and --tp-address need --runtime workers (torchrun ranks cannot run in-process)")
    if args.aot_dir is None and settings.space_id() and os.access(SPACE_DATA, os.W_OK):
        args.aot_dir = os.path.join(SPACE_DATA, "showcase-aot")
    if args.aot_dir:
        os.environ["SHOWCASE_AOT_DIR"] = str(args.aot_dir)  # the engines (and their workers) read it
        lines.append(f"aot packages: {args.aot_dir}" + (f", missing ones from the Hub repo {args.aot_repo}"
                                                         if args.aot_repo else ""))
    return lines


def host_policy(args):
    """What visitors may do: everything on a developer's machine; the host's lists in public mode."""
    from engine.protocol import Mode, Precision
    from engine.serving.manager import HostPolicy

    if args.public is None:
        resolve_hosting(args)
    if not args.public:
        return HostPolicy()
    presets = _choices(args.presets, str.strip) or (args.preset,)
    return HostPolicy(public=True, presets=presets,
                      precisions=_choices(args.precisions, lambda t: Precision.parse(t, "precision")),
                      modes=_choices(args.modes, lambda t: Mode.parse(t, "mode")),
                      evict_idle_after_s=args.public_evict_after, cost=cost_budget(args))


def cost_budget(args):
    """The visitors' cost budgets (engine/serving/cost.py) from the flags; a bad value exits naming the flag."""
    from engine.errors import InvalidRequest
    from engine.serving.cost import DEFAULT_REQUEST_COST, DEFAULT_VISITOR_COST, CostBudget, parse_cost

    try:
        request = parse_cost(DEFAULT_REQUEST_COST if args.max_request_cost is None else args.max_request_cost,
                             "--max-request-cost")
        visitor = parse_cost(DEFAULT_VISITOR_COST if args.max_visitor_cost is None else args.max_visitor_cost,
                             "--max-visitor-cost")
    except InvalidRequest as exc:
        raise SystemExit(str(exc)) from None
    return CostBudget(request=request, visitor=visitor)


def edge_config(args):
    """The web edge's bounds (ui/edge.py) from the flags."""
    from ui.edge import CLIENT_EVENTS, EdgeConfig, parse_proxies
    from ui.sockets import PER_CLIENT, SocketBounds

    events = args.client_events
    if events is None:
        events = CLIENT_EVENTS if args.public else None
    elif int(events) <= 0:
        events = None
    try:
        proxies = parse_proxies(args.trusted_proxies)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    per_client = args.max_connections_per_client
    if per_client is None:
        per_client = PER_CLIENT if args.public else None  # a developer's load tests come from one address
    sockets = SocketBounds(max_connections=args.max_connections, per_client=per_client or None,
                           header_timeout_s=args.header_timeout, max_header_bytes=args.max_header_bytes,
                           max_headers=args.max_headers)
    return EdgeConfig(client_events=None if events is None else int(events), trusted_proxies=proxies,
                      sockets=sockets)


def parse_auth(value: str | None) -> tuple[str, str] | None:
    if not value:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise SystemExit("--auth must be USER:PASSWORD")
    return user, password


def prewarm(manager, args) -> None:
    """Start the default engine now; its worker loads the weights and warms the buckets by itself."""
    try:
        key = manager.make_key(args.preset, args.device, args.precision, args.tp, parallel=args.parallel)
        if getattr(args, "aot_repo", None):
            pull_packages(manager, args)
        engine = manager.engine(key)
        log.info("loading %s; then compiling its %s buckets (%s) in the background", key, args.mode, args.warm)
        if not engine.wait_ready(timeout=900):
            log.warning("engine %s is still loading after 900 s", key)
            return
        row = next((r for r in manager.status() if r["engine"] == str(key)), {})
        busy = sum(1 for b in row.get("buckets") or () if b["state"] in ("queued", "compiling"))
        log.info("engine %s ready in %.1f s; %s", key, row.get("load_s") or 0.0,
                 f"{busy} bucket(s) compiling (the Buckets tab shows them; until one is warm, requests at it "
                 "run eagerly)" if busy else "no bucket compiling")
    except Exception as exc:  # the UI still starts and shows the reason
        log.warning("could not start the default engine: %s", exc)


def pull_packages(manager, args) -> None:
    """Download the Hub repo's aot packages of the default preset that are not here yet."""
    from engine import settings
    from engine.pipeline import aot_hub

    root = settings.aot_dir() or manager.cache_dir / "aot"
    try:
        fetched = aot_hub.pull_packages(args.aot_repo, root, preset=args.preset)
        log.info("aot packages from %s: %d new file(s) in %s", args.aot_repo, len(fetched), root)
    except Exception as exc:  # packages are an optimisation: build them instead
        log.warning("could not download aot packages from %s (%s); buckets build their own", args.aot_repo, exc)


ATTACH_WAIT_S = 15.0  # at start-up, how long to wait for an attached sidecar before the UI comes up without it
UI_TP_CHOICES = (1, 2, 4, 8)  # the UI's tensor-parallel dropdown (ui/blocks.py); other counts: the API


def attach_sidecar(manager, args):
    """--tp-address: attach (and keep re-attaching) to a sidecar the host started. Once attached within
    ATTACH_WAIT_S its engine is the default one. Returns (attacher, its key or None)."""
    from engine.tp.attach import SidecarAttacher

    attacher = SidecarAttacher(manager, args.tp_address).start()
    engine = attacher.wait_attached(ATTACH_WAIT_S)
    if engine is None:
        # The UI keeps the flags' defaults meanwhile: pointing it at the sidecar's key before the engine is
        # adopted would make the manager start a local engine under that key.
        log.warning("not attached to the sidecar yet (%s); the app keeps trying every few seconds",
                    attacher.last_error or "still connecting")
        return attacher, None
    manager.default_key = engine.key
    return attacher, engine.key


def apply_advice(args) -> str:
    """--config-from: the advisor's pick becomes the default engine's settings; returns its step cache.
    InvalidRequest when the file is not an advisor result or names something this app does not have."""
    from engine.bench.advise import load_pick
    from engine.errors import InvalidRequest
    from engine.pipeline.attention import BACKENDS

    pick = load_pick(args.config_from)
    if pick["attention"] not in BACKENDS:
        raise InvalidRequest(f"{args.config_from}: unknown attention backend {pick['attention'][:40]!r}; "
                             f"choose one of: {', '.join(BACKENDS)}")
    args.preset, args.device, args.precision, args.mode = pick["preset"], pick["device"], pick["precision"], pick["mode"]
    args.attention_backend = pick["attention"]
    log.warning("--config-from %s: %s/%s/%s, step cache %s, attention %s", args.config_from, pick["device"],
                pick["precision"], pick["mode"], pick["step_cache"], pick["attention"])
    return pick["step_cache"]


def check_engine_room(args, manager, device: str) -> str | None:
    """What is wrong with --memory-budget on `device`, if anything: it must hold the smallest engine there,
    a worker process (DeviceSpec.process_overhead_bytes) beside this process's own memory where the
    device's memory is the host's. Checked before any engine starts."""
    from engine import devices
    from engine.serving.budget import GIB

    if manager.memory_budget is None:
        return None
    need = devices.get_device(device).process_overhead_bytes + manager.app_bytes(device)
    if manager.memory_budget >= need:
        return None
    return (f"argument --memory-budget: {args.memory_budget} leaves no room for an engine on {device} (a worker "
            f"process there is estimated at {need / GIB:.2f} GiB with this server's own memory); allowed: at "
            f"least {need / GIB:.2f}GiB")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported
    parser = build_parser()
    args = parser.parse_args(argv)  # every flag's value is checked here (engine/config/flags.py)
    from engine.worker import logs

    os.environ["SHOWCASE_LOG_FORMAT"] = args.log_format  # the workers log the same way
    logs.configure(logging.INFO if args.verbose else logging.WARNING, process="web", fmt=args.log_format)
    log.setLevel(logging.INFO)  # the start-up choices below are always logged
    if args.mcp:
        from ui.mcp import missing

        if (why := missing()) is not None:
            parser.error(f"argument --mcp: {why}")
    step_cache = "none"
    if args.config_from:  # its pick replaces flags: checked as they are, before anything loads
        from engine.errors import InvalidRequest

        try:
            step_cache = apply_advice(args)
        except InvalidRequest as exc:
            parser.error(f"argument --config-from: {exc}")
    for line in resolve_hosting(args):
        log.info(line)
    if args.runtime == "workers":  # engines quantize in their own processes; this one only lists options
        from engine.pipeline.recipes import keep_torchao_unloaded

        keep_torchao_unloaded()
    if args.runtime == "inprocess":
        from engine import settings as engine_settings

        if engine_settings.gpu_calls() == "spaces":
            import spaces  # noqa: F401 - before torch touches CUDA (ZeroGPU patches it)

    from engine import devices
    from engine.config.flags import options_from_args
    from engine.errors import ShowcaseError
    from engine.protocol import Mode
    from engine.serving.budget import parse_size
    from engine.serving.manager import make_manager

    # An unknown device name stops here; a known device this machine lacks starts the UI, which says why.
    if str(args.device).strip().lower() not in devices.device_names():
        parser.error(f"argument --device: unknown device {args.device!r}; choose one of: "
                     f"{', '.join(devices.device_names())}")
    try:
        sizes = warm_sizes(args.warm)
        auth = parse_auth(args.auth)
        mode = Mode.parse(args.mode, "mode")
        modes = (mode,) if mode.compiled else ()
        if args.public and not (args.admin_token or auth):
            log.warning("public mode without --admin-token or --auth: host operations (restart, warm all) are off")
        manager = make_manager(
            args, options_from_args(args, warm_sizes=sizes, warm_modes=modes),
            memory_budget=parse_size(args.memory_budget), max_engines=args.max_engines,
            compile_jobs=args.compile_jobs, idle_unload_s=args.idle_unload, policy=host_policy(args),
            worker_threads=args.worker_threads, runtime=args.runtime)
        try:
            manager.default_key = manager.make_key(args.preset, args.device, args.precision, args.tp,
                                                   parallel=args.parallel)
        except ShowcaseError as exc:  # the UI still starts and shows the reason
            log.warning("default engine %s/%s/%s: %s", args.preset, args.device, args.precision, exc)
        problem = manager.default_key and check_engine_room(args, manager, manager.default_key.device)
        if problem:
            manager.shutdown()
            parser.error(problem)
    except ShowcaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import gradio as gr  # noqa: F401 - after GRADIO_ANALYTICS_ENABLED is set

    from ui import UIDefaults, build_demo, launch_kwargs

    demo = None
    attacher = None
    if args.tp_address:
        attacher, key = attach_sidecar(manager, args)
        if key is not None and key.tp in UI_TP_CHOICES:
            args.preset, args.device, args.precision, args.tp = key.preset, key.device, str(key.precision), key.tp
            args.parallel = str(key.parallel)
        elif key is not None:
            log.warning("the sidecar %s has %d ranks, not one of the UI's tensor-parallel choices %s: request it "
                        "through the API (/generate with tp=%d)", key, key.tp, UI_TP_CHOICES, key.tp)

    def on_sigterm(signum, frame):
        # Raised in the main thread (inside launch's wait loop), so the finally below runs.
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if attacher is None and args.runtime == "inprocess" and settings.zero_gpu():
            # ZeroGPU packs the weights and registers the GPU functions when the app launches: the default
            # engine must be loaded (and its GPU call decorated) before that.
            prewarm(manager, args)
            try:
                manager.engine(manager.make_key(args.preset, args.device, args.precision)).wait_ready(timeout=900)
            except Exception as exc:
                log.warning("the default engine did not load before launch: %s", exc)
        elif attacher is None:  # with --tp-address the sidecar is the default engine: nothing to start here
            if args.tp > 1 or args.runtime == "inprocess":
                # These engines import diffusers in this process, as building the UI does: a thread importing
                # transformers while another does saw it half initialised ("cannot import name
                # 'PreTrainedModel'"), so the first import happens here, before the threads.
                import diffusers
                import transformers

                diffusers.DiffusionPipeline, transformers.PreTrainedModel  # noqa: B018 - resolves the lazy modules
            threading.Thread(target=prewarm, args=(manager, args), name="prewarm", daemon=True).start()
        defaults = UIDefaults(preset=args.preset, device=args.device, precision=args.precision, mode=args.mode,
                              tp=args.tp, parallel=args.parallel, admin_token=args.admin_token,
                              step_cache=step_cache)
        demo = build_demo(manager, defaults, queue_size=args.queue_size, edge=edge_config(args))
        demo.launch(
            server_name=args.host,
            server_port=args.port,
            share=args.share,
            auth=auth,
            allowed_paths=None,  # serve nothing beyond the app's own outputs
            ssr_mode=False,
            show_error=False,  # only the app's own gr.Error messages reach a visitor (ui/common.py)
            mcp_server=args.mcp,
            prevent_thread_lock=True,
            **launch_kwargs(args.theme, demo),
        )
        if args.mcp:
            from ui import mcp

            mcp.serve(demo)
            log.info("MCP tools for agents: %sgradio_api/mcp/ (Streamable HTTP)", demo.local_url)
        log.info("Prometheus metrics: %smetrics%s", demo.local_url,
                 " (Authorization: Bearer <admin token>)" if args.public else "")
        demo.block_thread()
    except KeyboardInterrupt:
        pass
    finally:
        log.info("shutting down engines")
        if attacher is not None:
            attacher.stop()  # an attached sidecar is only disconnected: it keeps running for the next app
        manager.shutdown()
        if demo is not None:
            demo.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
