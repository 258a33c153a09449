"""Diffusion Showcase web app: flags -> engine manager (default engine pre-warmed) -> Gradio UI.

    python app.py                      # tiny-flux on the best device, compile mode, http://127.0.0.1:7860
    python app.py --device cpu --precision bf16 --warm 64x64 --auth user:secret

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

log = logging.getLogger("app")


def build_parser() -> argparse.ArgumentParser:
    from engine import settings
    from engine.flags import add_engine_arguments

    d = settings.server_defaults()
    p = argparse.ArgumentParser(prog="app.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--host", default=d["host"], help="interface to bind (default 127.0.0.1; $SHOWCASE_HOST)")
    s.add_argument("--port", type=int, default=d["port"], help="port (default 7860; $SHOWCASE_PORT)")
    s.add_argument("--share", action="store_true", help="opt in to a public gradio.live share link")
    s.add_argument("--auth", default=d["auth"], metavar="USER:PASS",
                   help="require this login (Gradio's own auth; $SHOWCASE_AUTH)")
    s.add_argument("--queue-size", type=int, default=d["queue_size"],
                   help="events that may wait in the queue before new ones are refused ($SHOWCASE_QUEUE_SIZE)")
    s.add_argument("--theme", default=None, help="a Gradio theme name (default: Soft)")
    s.add_argument("-v", "--verbose", action="store_true")
    e = p.add_argument_group("default engine")
    e.add_argument("--preset", default=d["preset"], help="model preset ($SHOWCASE_PRESET)")
    e.add_argument("--device", default=d["device"], help="device or 'auto' ($SHOWCASE_DEVICE)")
    e.add_argument("--precision", default=d["precision"], help="fp32, tf32, bf16 or fp16 ($SHOWCASE_PRECISION)")
    e.add_argument("--mode", default=d["mode"], help="eager, compile, regional, defer-and-fuse ($SHOWCASE_MODE)")
    e.add_argument("--tp", type=int, default=1,
                   help="tensor parallel over N ranks for the default engine (a torchrun sidecar)")
    e.add_argument("--warm", default=d["warm"],
                   help="buckets to pre-warm at start-up in --mode: 'all', 'none' or e.g. '64x64,128x128' "
                        "($SHOWCASE_WARM)")
    add_engine_arguments(p)
    return p


def warm_sizes(spec: str) -> tuple[str, ...] | None:
    """'all' -> None (every bucket of the preset), 'none' -> (), else the listed sizes."""
    from engine.protocol import Size

    spec = (spec or "all").strip().lower()
    if spec == "all":
        return None
    if spec in ("none", ""):
        return ()
    return tuple(str(Size.parse(s)) for s in spec.split(","))


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
        key = manager.make_key(args.preset, args.device, args.precision, args.tp)
        manager.engine(key)
        log.info("pre-warming %s (%s buckets: %s)", key, args.mode, args.warm)
    except Exception as exc:  # the UI still starts and shows the reason
        log.warning("could not start the default engine: %s", exc)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")

    from engine.errors import ShowcaseError
    from engine.flags import make_manager, options_from_args
    from engine.protocol import Mode

    try:
        sizes = warm_sizes(args.warm)
        auth = parse_auth(args.auth)
        mode = Mode.parse(args.mode, "mode")
        modes = (mode,) if mode.compiled else ()
        manager = make_manager(args, options_from_args(args, warm_sizes=sizes, warm_modes=modes))
    except ShowcaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import gradio as gr  # noqa: F401 - after GRADIO_ANALYTICS_ENABLED is set

    from ui import UIDefaults, build_demo, launch_kwargs

    demo = None

    def on_sigterm(signum, frame):
        # Raised in the main thread (inside launch's wait loop), so the finally below runs.
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        threading.Thread(target=prewarm, args=(manager, args), name="prewarm", daemon=True).start()
        defaults = UIDefaults(preset=args.preset, device=args.device, precision=args.precision, mode=args.mode,
                              tp=args.tp)
        demo = build_demo(manager, defaults, queue_size=args.queue_size)
        demo.launch(
            server_name=args.host,
            server_port=args.port,
            share=args.share,
            auth=auth,
            allowed_paths=None,  # serve nothing beyond the app's own outputs
            ssr_mode=False,
            show_error=True,
            **launch_kwargs(args.theme),
        )
    except KeyboardInterrupt:
        pass
    finally:
        log.info("shutting down engines")
        manager.shutdown()
        if demo is not None:
            demo.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
