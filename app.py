"""Diffusion Showcase web app: flags -> engine manager (default engine pre-warmed) -> Gradio UI.

    python app.py                      # tiny-shapes on the best device, compile mode, http://127.0.0.1:7860
    python app.py --device cpu --precision bf16 --warm 64x64 --auth user:secret
    python app.py --tp-address /srv/tp/flux2.json   # serve a sidecar started on its nodes (docs/multinode.md)
    python app.py --ray 10.0.0.5:6379 --replicas 2  # engines on the nodes of a Ray cluster (docs/multinode.md)

Every flag falls back to an environment variable (engine/settings.py server_defaults()), then to
the built-in default. Engine workers are spawned processes that re-import this file, so nothing
heavy happens at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine import settings
from engine.config.flags import OneLineParser, add_engine_arguments, add_fields, options_from_args
from engine.config.presets import get_preset
from engine.config.request import API_KEYS_ADMIN
from engine.config.validation import check_lora, check_preset_name
from engine.errors import InvalidRequest, ShowcaseError
from engine.protocol import DEFAULT_PRESET, Mode, Parallel, Precision, Size, parse_lora
from engine.protocol.flagfields import OPTIONAL_BOOL, SWITCH, OneOf, Whole, flag
from engine.serving.budget import GIB
from engine.serving.flags import (
    HOSTING_FLAGS,
    MAX_QUEUE,
    FleetFlags,
    HostingChoice,
    hosting_config,
    resolve_hosting,
)
from engine.serving.hosting import Runtime

if TYPE_CHECKING:
    from engine.fleet.config import FleetConfig
    from engine.protocol import EngineKey
    from engine.serving.interface import Serving
    from engine.serving.manager import EngineManager

log = logging.getLogger("app")


# Bounds of the numeric flags: each value is checked as the flags are parsed, before anything loads.
MAX_RANKS = 256


def build_parser() -> argparse.ArgumentParser:
    """Every flag is a field of a config dataclass (engine/config/flags.py `add_fields`), in this order."""
    from engine.pipeline.attention import BACKENDS

    d = settings.server_defaults()
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p.add_argument_group("server"), ServerFlags, d)
    add_fields(p.add_argument_group("default engine"), DefaultEngineFlags, d)
    h = p.add_argument_group("hosting (a Space or a shared box: see README 'Hosting')")
    for flags in HOSTING_FLAGS:
        add_fields(h, flags, d)
    add_fields(p.add_argument_group("fleet (engines on the nodes of a Ray cluster: docs/multinode.md)"), FleetFlags, d)
    add_engine_arguments(p, attention_backends=BACKENDS)
    return p


@dataclass(frozen=True)
class ServerFlags:
    """Where and how the web server listens and logs."""

    host: str = field(default="127.0.0.1", metadata=flag("interface to bind (default 127.0.0.1; $SHOWCASE_HOST)",
                                                         env="host"))
    port: int = field(default=7860, metadata=flag("port (default 7860; $SHOWCASE_PORT)", check=Whole(1, 65535),
                                                  env="port", as_text=True))
    share: bool = field(default=False, metadata=flag("opt in to a public gradio.live share link", kind=SWITCH))
    auth: str | None = field(default=None, metadata=flag(
        "require this login (Gradio's own auth; $SHOWCASE_AUTH)", check=lambda text: auth_text(text),
        metavar="USER:PASS", env="auth"))
    queue_size: int = field(default=64, metadata=flag(
        "events that may wait in the queue before new ones are refused ($SHOWCASE_QUEUE_SIZE)",
        check=Whole(1, MAX_QUEUE), env="queue_size", as_text=True))
    theme: str | None = field(default=None, metadata=flag("a Gradio theme name (default: Soft)"))
    verbose: bool = field(default=False, metadata=flag(kind=SWITCH, short="-v"))
    log_format: str = field(default="text", metadata=flag(
        "console lines of the app and its workers: text, or one JSON object per line with the request id (for "
        "hosts that ship logs; $SHOWCASE_LOG_FORMAT)", choices=("text", "json"), env="log_format"))
    mcp: bool = field(default=False, metadata=flag(
        "also serve the API as MCP tools for agents at /gradio_api/mcp/ (needs pip install \".[mcp]\"; default "
        "off; $SHOWCASE_MCP=1)", kind=OPTIONAL_BOOL, env="mcp"))


@dataclass(frozen=True)
class DefaultEngineFlags:
    """The engine the app starts with, and Generate's selectors."""

    preset: str = field(default=DEFAULT_PRESET, metadata=flag(
        "model preset ($SHOWCASE_PRESET)", check=lambda text: preset_or_model(text), env="preset"))
    device: str = field(default="auto", metadata=flag("device or 'auto' ($SHOWCASE_DEVICE)", env="device"))
    precision: str = field(default="fp32", metadata=flag(
        f"{', '.join(Precision.values())} ($SHOWCASE_PRECISION)", check=OneOf(Precision.values, "precision"),
        env="precision"))
    mode: str = field(default="compile", metadata=flag(
        f"{', '.join(Mode.values())} ($SHOWCASE_MODE)", check=OneOf(Mode.values, "mode"), env="mode"))
    config_from: str | None = field(default=None, metadata=flag(
        "the default engine and Generate's selectors from an advisor result (python -m bench advise --out FILE, "
        "or the Advisor tab's saved JSON): its pick's preset, device, precision, mode, step cache and attention "
        "backend", metavar="FILE"))
    tp: int = field(default=1, metadata=flag("run the default engine over N ranks (a torchrun sidecar)",
                                             check=Whole(1, MAX_RANKS)))
    parallel: str = field(default=str(Parallel.TENSOR), metadata=flag(
        "how --tp ranks split the transformer: tensor (weights sharded), ulysses or ring (context parallel: whole "
        "transformer on each rank, tokens split)", choices=Parallel.values()))
    tp_address: str | None = field(default=None, metadata=flag(
        "serve a running tensor-parallel sidecar as the default engine: FILE is the address file its node 0 wrote "
        "(python -m engine.tp.sidecar ... --address-file FILE; the token is read from the 0600 file it names). It "
        "may span several machines; the app never starts, restarts or stops it, shows it down with the reason "
        "when it stops, and re-attaches when it is back", metavar="FILE"))
    lora: str | None = field(default=None, metadata=flag(
        "the Generate page's LoRA style at start: one of the preset's (python -m engine presets lists them); turns "
        "on --loras", check=lambda text: lora_text(text), metavar="NAME[:SCALE][:fused]"))
    warm: str = field(default="all", metadata=flag(
        "buckets to pre-warm at start-up in --mode: 'all', 'none' or e.g. '64x64,128x128' ($SHOWCASE_WARM)",
        check=lambda text: warm_text(text), env="warm"))


def preset_or_model(text: str) -> str:
    """--preset: a preset of presets/models.toml, or a Hub id / local folder (checked when it loads)."""
    try:
        return check_preset_name(text)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def lora_text(text: str) -> str:
    """--lora: NAME[:SCALE][:fused] (the name is checked against the preset once the preset is known)."""
    try:
        return parse_lora(text).text()
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def warm_text(text: str) -> str:
    """--warm: 'all', 'none' or WxH sizes."""
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


def warm_sizes(spec: str) -> tuple[str, ...] | None:
    """'all' -> None (every bucket of the preset), 'none' -> (), else the listed sizes."""
    spec = (spec or "all").strip().lower()
    if spec == "all":
        return None
    if spec in ("none", ""):
        return ()
    return tuple(str(Size.parse(s)) for s in spec.split(","))


@dataclass(frozen=True)
class DefaultEngine:
    """The default engine and Generate's selectors: the flags', then --config-from's pick, then an attached
    sidecar's key. Built from the parsed flags, never written back into them."""
    preset: str
    device: str
    precision: str
    mode: str
    tp: int = 1
    parallel: str = str(Parallel.TENSOR)
    attention_backend: str | None = None  # None: the flag's
    step_cache: str = "none"
    lora: str = "none"  # NAME[:SCALE][:fused]: Generate's LoRA selectors at start

    @classmethod
    def from_flags(cls, args) -> DefaultEngine:
        return cls(args.preset, args.device, args.precision, args.mode, args.tp, args.parallel,
                   lora=args.lora or "none")

    def key(self, serving: Serving) -> EngineKey:
        """Its EngineKey (ShowcaseError when the serving interface cannot make one)."""
        return serving.make_key(self.preset, self.device, self.precision, self.tp, parallel=self.parallel)

    def served_by(self, key) -> DefaultEngine:
        """The same selectors pointed at an attached engine's key."""
        return dataclasses.replace(self, preset=key.preset, device=key.device, precision=str(key.precision),
                                   tp=key.tp, parallel=str(key.parallel))


def edge_config(args, public: bool):
    """The web edge's bounds (ui/edge.py) from the flags (`public`: hosting mode's defaults)."""
    from ui.addresses import parse_proxies
    from ui.bodies import PER_CLIENT_BYTES, BodyBounds
    from ui.edge import CLIENT_EVENTS, EdgeConfig
    from ui.sockets import PER_CLIENT, STREAMS_PER_CLIENT, SocketBounds

    events = args.client_events
    if events is None:
        events = CLIENT_EVENTS if public else None
    elif int(events) <= 0:
        events = None
    try:
        proxies = parse_proxies(args.trusted_proxies)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    per_client = args.max_connections_per_client
    if per_client is None:
        per_client = PER_CLIENT if public else None  # a developer's load tests come from one address
    streams = args.max_streams_per_client
    if streams is None:
        streams = STREAMS_PER_CLIENT if public else None
    sockets = SocketBounds(max_connections=args.max_connections, per_client=per_client or None,
                           streams_per_client=streams or None,
                           header_timeout_s=args.header_timeout, max_header_bytes=args.max_header_bytes,
                           max_headers=args.max_headers)
    bodies = BodyBounds(min_rate=args.body_min_rate, timeout_s=args.body_timeout or None,
                        per_client_bytes=PER_CLIENT_BYTES if public else None)
    return EdgeConfig(client_events=None if events is None else int(events), trusted_proxies=proxies,
                      sockets=sockets, bodies=bodies)


def parse_auth(value: str | None) -> tuple[str, str] | None:
    if not value:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise SystemExit("--auth must be USER:PASSWORD")
    return user, password


def prewarm(serving: Serving, engine: DefaultEngine, warm: str, aot_repo: str | None = None) -> None:
    """Start the default engine now; its worker loads the weights and warms the buckets (`warm`) by itself."""
    try:
        key = engine.key(serving)
        if aot_repo:
            pull_packages(serving.cache_dir, aot_repo, engine.preset)
        client = serving.engine(key)
        log.info("loading %s; then compiling its %s buckets (%s) in the background", key, engine.mode, warm)
        if not client.wait_ready(timeout=900):
            log.warning("engine %s is still loading after 900 s", key)
            return
        row = next((r for r in serving.status_rows() if r["engine"] == str(key)), {})
        # Its start-up compiles are asked for just after it says it is ready: they are not on its board yet.
        log.info("engine %s ready in %.1f s; %s", key, row.get("load_s") or 0.0,
                 "no start-up compiles (--warm none)" if warm == "none" else
                 f"no start-up compiles (mode {engine.mode})" if not Mode(engine.mode).compiled else
                 "its start-up buckets compile in the background, a line as each ends (the Buckets tab shows "
                 "them; until one is warm, requests at it run eagerly)")
    except Exception as exc:  # the UI still starts and shows the reason
        log.warning("could not start the default engine: %s", exc)


def pull_packages(cache_dir: Path, repo: str, preset: str) -> None:
    """Download the Hub repo's aot packages of the default preset that are not here yet."""
    from engine.pipeline import aot_hub

    root = settings.aot_dir() or cache_dir / "aot"
    try:
        fetched = aot_hub.pull_packages(repo, root, preset=preset)
        log.info("aot packages from %s: %d new file(s) in %s", repo, len(fetched), root)
    except Exception as exc:  # packages are an optimisation: build them instead
        log.warning("could not download aot packages from %s (%s); buckets build their own", repo, exc)


ATTACH_WAIT_S = 15.0  # at start-up, how long to wait for an attached sidecar before the UI comes up without it
UI_TP_CHOICES = (1, 2, 4, 8)  # the UI's tensor-parallel dropdown (ui/blocks.py); other counts: the API


def attach_sidecar(manager: EngineManager, args):
    """--tp-address: attach (and keep re-attaching) to a sidecar the host started. Once attached within
    ATTACH_WAIT_S its engine is the default one. Returns (attacher, its key or None)."""
    from engine.tp.attach import SidecarAttacher

    attacher = SidecarAttacher(manager.adopt, args.tp_address).start()
    engine = attacher.wait_attached(ATTACH_WAIT_S)
    if engine is None:
        # The UI keeps the flags' defaults meanwhile: pointing it at the sidecar's key before the engine is
        # adopted would make the manager start a local engine under that key.
        log.warning("not attached to the sidecar yet (%s); the app keeps trying every few seconds",
                    attacher.last_error or "still connecting")
        return attacher, None
    manager.default_key = engine.key
    return attacher, engine.key


def apply_advice(engine: DefaultEngine, path: str) -> DefaultEngine:
    """--config-from: `engine` with the advisor's pick (preset, device, precision, mode, attention, step cache, and
    the LoRA style it was measured with, fused as the pick ran it).
    InvalidRequest when the file is not an advisor result or names something this app does not have."""
    from bench.advise import load_pick
    from engine.pipeline.attention import BACKENDS

    pick = load_pick(path)
    if pick["attention"] not in BACKENDS:
        raise InvalidRequest(f"{path}: unknown attention backend {pick['attention'][:40]!r}; "
                             f"choose one of: {', '.join(BACKENDS)}")
    if pick["lora"] != "none":  # the style the run was measured with
        try:
            check_lora(get_preset(pick["preset"]), pick["lora"])
        except InvalidRequest as exc:
            raise InvalidRequest(f"{path}: {exc}") from None
    log.warning("--config-from %s: %s/%s/%s, step cache %s, attention %s, LoRA %s", path, pick["device"],
                pick["precision"], pick["mode"], pick["step_cache"], pick["attention"], pick["lora"])
    return dataclasses.replace(engine, preset=pick["preset"], device=pick["device"], precision=pick["precision"],
                               mode=pick["mode"], attention_backend=pick["attention"], step_cache=pick["step_cache"],
                               lora=pick["lora"] if pick["lora"] != "none" else engine.lora)


def check_engine_room(args, serving: Serving, device: str) -> str | None:
    """What is wrong with --memory-budget on `device`, if anything: it must hold the smallest engine there,
    a worker process (DeviceSpec.process_overhead_bytes) beside this process's own memory where the
    device's memory is the host's. Checked before any engine starts."""
    from engine import devices  # imports torch: only once the flags are parsed

    budget = serving.memory_budget()
    if budget is None:
        return None
    need = devices.get_device(device).process_overhead_bytes + serving.app_bytes(device)
    if budget >= need:
        return None
    return (f"argument --memory-budget: {args.memory_budget} leaves no room for an engine on {device} (a worker "
            f"process there is estimated at {need / GIB:.2f} GiB with this server's own memory); allowed: at "
            f"least {need / GIB:.2f}GiB")


# -- main's phases ---------------------------------------------------------------------------------
def configure_logging(args) -> None:
    from engine.worker import logs

    os.environ["SHOWCASE_LOG_FORMAT"] = args.log_format  # the workers log the same way
    logs.configure(logging.INFO if args.verbose else logging.WARNING, process="web", fmt=args.log_format)
    log.setLevel(logging.INFO)  # the start-up choices below are always logged
    logging.getLogger("engine.serving.compiles").setLevel(logging.INFO)  # a line per compile that ends


def check_flags(parser, args) -> DefaultEngine:
    """What the flags can be refused for before anything loads; returns the default engine they ask for."""
    if args.mcp:
        from ui.mcp import missing

        if (why := missing()) is not None:
            parser.error(f"argument --mcp: {why}")
    if args.api_keys == API_KEYS_ADMIN and not args.admin_token:
        parser.error(f"argument --api-keys: {API_KEYS_ADMIN} needs --admin-token (the key callers send)")
    engine = DefaultEngine.from_flags(args)
    if args.config_from:  # its pick replaces flags: checked as they are, before anything loads
        try:
            engine = apply_advice(engine, args.config_from)
        except InvalidRequest as exc:
            parser.error(f"argument --config-from: {exc}")
    if args.lora:
        try:
            check_lora(get_preset(engine.preset), engine.lora)
        except ShowcaseError as exc:
            parser.error(f"argument --lora: {exc}")
    return engine


def check_device(parser, device: str) -> None:
    """An unknown device name stops here; a known device this machine lacks starts the UI, which says why."""
    from engine import devices  # imports torch: after prepare_runtime

    if str(device).strip().lower() not in devices.device_names():
        parser.error(f"argument --device: unknown device {device!r}; choose one of: "
                     f"{', '.join(devices.device_names())}")


def prepare_runtime(hosting: HostingChoice) -> None:
    """What this process needs before torch loads: the aot folder the engines read, and per runtime, torchao
    kept out (workers quantize in their own processes) or ZeroGPU's patches in (`spaces` first)."""
    if hosting.aot_dir:
        os.environ["SHOWCASE_AOT_DIR"] = str(hosting.aot_dir)  # the engines (and their workers) read it
    if hosting.runtime is Runtime.WORKERS:
        from engine.pipeline.recipes import keep_torchao_unloaded

        keep_torchao_unloaded()
    elif settings.gpu_calls() == "spaces":
        import spaces  # noqa: F401 - before torch touches CUDA (ZeroGPU patches it)


def build_manager(parser, args, engine: DefaultEngine, hosting: HostingChoice) -> EngineManager:
    """The engine manager with its default engine's key; exits naming the flag when --memory-budget leaves
    no room for that engine."""
    from engine.serving.manager import make_manager

    sizes = warm_sizes(args.warm)
    mode = Mode.parse(engine.mode, "mode")
    modes = (mode,) if mode.compiled else ()
    advised = {"attention_backend": engine.attention_backend} if engine.attention_backend else {}
    if engine.lora != "none":
        advised["loras"] = True  # a style needs the slot
    config = hosting_config(args, hosting, engine.preset)
    manager = make_manager(args, options_from_args(args, warm_sizes=sizes, warm_modes=modes, **advised), config)
    join_fleet(config.fleet, manager)  # before the default engine's key: under --ray its device is on the nodes
    serving = manager.serving()
    try:
        manager.default_key = engine.key(serving)
    except ShowcaseError as exc:  # the UI still starts and shows the reason
        log.warning("default engine %s/%s/%s: %s", engine.preset, engine.device, engine.precision, exc)
    default = manager.default_key
    problem = default and check_engine_room(args, serving, default.device)
    if problem:
        manager.shutdown()
        parser.error(problem)
    return manager


def attach_default(manager: EngineManager, args, engine: DefaultEngine):
    """--tp-address: the attached sidecar becomes the default engine (the UI's too, where its rank count is one
    of the UI's). Returns (attacher or None, the default engine)."""
    if not args.tp_address:
        return None, engine
    attacher, key = attach_sidecar(manager, args)
    if key is not None and key.tp in UI_TP_CHOICES:
        return attacher, engine.served_by(key)
    if key is not None:
        log.warning("the sidecar %s has %d ranks, not one of the UI's tensor-parallel choices %s: request it "
                    "through the API (/generate with tp=%d)", key, key.tp, UI_TP_CHOICES, key.tp)
    return attacher, engine


def start_default_engine(serving: Serving, args, engine: DefaultEngine, hosting: HostingChoice) -> None:
    """Load the default engine: before launch on ZeroGPU, else in the background while the UI comes up."""
    if hosting.runtime is Runtime.INPROCESS and settings.zero_gpu():
        # ZeroGPU packs the weights and registers the GPU functions when the app launches: the default
        # engine must be loaded (and its GPU call decorated) before that.
        prewarm(serving, engine, args.warm, args.aot_repo)
        try:
            serving.engine(serving.make_key(engine.preset, engine.device, engine.precision)).wait_ready(timeout=900)
        except Exception as exc:
            log.warning("the default engine did not load before launch: %s", exc)
        return
    if engine.tp > 1 or hosting.runtime is Runtime.INPROCESS:
        # These engines import diffusers in this process, as building the UI does: a thread importing
        # transformers while another does saw it half initialised ("cannot import name
        # 'PreTrainedModel'"), so the first import happens here, before the threads.
        import diffusers
        import transformers

        diffusers.DiffusionPipeline, transformers.PreTrainedModel  # noqa: B018 - resolves the lazy modules
    threading.Thread(target=prewarm, args=(serving, engine, args.warm, args.aot_repo), name="prewarm",
                     daemon=True).start()


def launch_ui(serving: Serving, args, engine: DefaultEngine, public: bool, auth):
    """Build the Gradio app on the serving interface and start serving it (without blocking); returns the demo."""
    from ui import UIDefaults, build_demo, launch_kwargs, webtemp

    outputs = webtemp.use_cache_folder(serving.cache_dir)  # before the app is built: Gradio reads it then
    webtemp.start_reaper(outputs)  # uploads arrive without outputs: tidied on a schedule of their own
    defaults = UIDefaults(preset=engine.preset, device=engine.device, precision=engine.precision, mode=engine.mode,
                          tp=engine.tp, parallel=engine.parallel, admin_token=args.admin_token,
                          step_cache=engine.step_cache, lora=engine.lora, api_keys=args.api_keys)
    demo = build_demo(serving, defaults, queue_size=args.queue_size, edge=edge_config(args, public))
    demo.web_temp = outputs
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
        quiet=True,  # Gradio's own lines told a --share app to "set `share=True` in `launch()`"
        **launch_kwargs(args.theme, demo),
    )
    print(f"* Running on local URL:  {demo.local_url.rstrip('/')}", flush=True)
    if demo.share_url:
        print(f"* Running on public URL: {demo.share_url}", flush=True)
    if args.mcp:
        from ui import mcp

        mcp.serve(demo)
        log.info("MCP tools for agents: %sgradio_api/mcp/ (Streamable HTTP)", demo.local_url)
    log.info("OpenAI-compatible images API: %sv1 (client = OpenAI(base_url=..., api_key=...)%s)", demo.local_url,
             "; a key is required" if args.api_keys else "")
    log.info("Prometheus metrics: %smetrics%s", demo.local_url,
             " (Authorization: Bearer <admin token>)" if public else "")
    return demo


def join_fleet(fleet: FleetConfig | None, manager: EngineManager) -> None:
    """--ray (`fleet`): make this process a driver of the cluster (ray is imported here and nowhere without
    --ray); the manager's engines stop when it cannot."""
    if fleet is None:
        return
    from engine.fleet.cluster import join

    try:
        join(fleet)
    except ShowcaseError:
        manager.shutdown()
        raise


def leave_fleet(serving: Serving) -> None:
    """After the engines closed: disconnect from the cluster, which ends any actor of this app still there."""
    if serving.fleet():
        from engine.fleet.cluster import leave

        leave()


def on_sigterm(signum, frame):
    # Raised in the main thread (inside launch's wait loop), so serve's finally runs.
    raise SystemExit(0)


def serve(manager: EngineManager, args, engine: DefaultEngine, hosting: HostingChoice, auth) -> int:
    """Attach or start the default engine, serve the UI until stopped, then stop every engine."""
    import gradio as gr  # noqa: F401 - after GRADIO_ANALYTICS_ENABLED is set

    demo, serving = None, manager.serving()
    attacher, engine = attach_default(manager, args, engine)
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if attacher is None:  # with --tp-address the sidecar is the default engine: nothing to start here
            start_default_engine(serving, args, engine, hosting)
        demo = launch_ui(serving, args, engine, hosting.public, auth)
        from engine.devices.environment import remove_empty_default_inductor_folder

        remove_empty_default_inductor_folder()  # torch made it at import in the system temp; nothing here compiles
        demo.block_thread()
    except KeyboardInterrupt:
        pass
    finally:
        log.info("shutting down engines")
        if attacher is not None:
            attacher.stop()  # an attached sidecar is only disconnected: it keeps running for the next app
        manager.shutdown()
        leave_fleet(serving)
        if demo is not None:
            demo.close()
            from ui import webtemp

            webtemp.remove(demo.web_temp)
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported
    parser = build_parser()
    args = parser.parse_args(argv)  # every flag's value is checked here (engine/config/flags.py)
    configure_logging(args)
    try:
        return start(parser, args)
    except SystemExit as exc:  # a combination of flags refused after parsing: status 2, as a bad value's
        if isinstance(exc.code, str):
            parser.error(exc.code)
        raise


def start(parser, args) -> int:
    """Check the flags' combinations, build the manager, serve until stopped."""
    engine = check_flags(parser, args)
    hosting = resolve_hosting(args, engine.mode)
    for line in hosting.lines:
        log.info(line)
    engine = dataclasses.replace(engine, mode=hosting.mode)
    prepare_runtime(hosting)
    check_device(parser, engine.device)

    try:
        auth = parse_auth(args.auth)
        if hosting.public and not (args.admin_token or auth):
            log.warning("public mode without --admin-token or --auth: host operations (restart, warm all) are off")
        manager = build_manager(parser, args, engine, hosting)
    except ShowcaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(manager, args, engine, hosting, auth)


if __name__ == "__main__":
    sys.exit(main())
