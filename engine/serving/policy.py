"""What may run here, checked before any engine starts: in public mode a visitor picks only what the host
offers and is served aot only from a package already loaded; the in-process runtime refuses what it cannot
run. Pure checks: the manager calls them with its state."""

from __future__ import annotations

from engine import devices
from engine.config.presets import looks_like_model_ref
from engine.errors import InvalidRequest, NotAllowed, UnsupportedCombination
from engine.protocol import BucketKey, BucketState, EngineKey, EngineOptions, Mode, ModelPreset, Precision
from engine.serving.hosting import HostPolicy, Runtime


def visitor_presets(policy: HostPolicy, presets) -> list[str]:
    """The presets visitors may pick (public mode: the host's list, of those this app has)."""
    if policy.public and policy.presets is not None:
        return [p for p in policy.presets if p in presets]
    return list(presets)


def check_visitor_choice(policy: HostPolicy, offered: list[str], *, preset=None, precision=None,
                         mode=None) -> None:
    """NotAllowed naming what is offered when a public host does not offer this preset, precision or mode."""
    if not policy.public:
        return
    if preset is not None:
        if isinstance(preset, str) and looks_like_model_ref(preset):
            raise NotAllowed(f"this server does not load Hub ids or local folders ({preset!r}); "
                             f"choose one of its presets: {', '.join(offered)}")
        if preset not in offered:
            raise NotAllowed(f"preset {preset!r} is not offered here; choose one of: {', '.join(offered)}")
    if precision is not None and policy.precisions is not None:
        choice = Precision.parse(precision, "precision")
        if choice not in policy.precisions:
            raise NotAllowed(f"precision {choice} is not offered here; choose one of: "
                             f"{', '.join(map(str, policy.precisions))}")
    if mode is not None and policy.modes is not None:
        choice = Mode.parse(mode, "mode")
        if choice not in policy.modes:
            raise NotAllowed(f"mode {choice} is not offered here; choose one of: {', '.join(map(str, policy.modes))}")


def check_visitor_aot(policy: HostPolicy, key: EngineKey, bucket: BucketKey, engine) -> None:
    """Public mode: a visitor is served aot only from a package already loaded (warm) in `engine` (None: not
    loaded); building one costs minutes of compiling and hundreds of MiB of disk, which is the host's call."""
    if engine is not None:
        engine.wait_ready(timeout=600)  # the default engine loads its start-up packages as it starts
        if any(info.bucket == bucket and info.state == BucketState.WARM for info in engine.buckets()):
            return
    others = [str(m) for m in devices.get_device(key.device).modes
              if m != Mode.AOT and (policy.modes is None or m in policy.modes)]
    raise NotAllowed(f"mode aot at {bucket.size}: no package of this bucket is loaded on {key}, and building "
                     "one (minutes of compiling, hundreds of MiB of disk) is up to the host here (the admin "
                     "token, or `python -m engine export` ahead of time)"
                     + (f"; pick mode {' or '.join(others)} meanwhile" if others else ""))


def check_visitor_warm(policy: HostPolicy, key: EngineKey, bucket: BucketKey, preset: ModelPreset, engine) -> None:
    """Public mode: a visitor warms one bucket of an engine already loaded (`engine`, None when it is not)."""
    if bucket.size not in preset.buckets:
        raise InvalidRequest(f"{bucket.size} is not a bucket of {key.preset}")
    if bucket.mode is Mode.AOT:
        check_visitor_aot(policy, key, bucket, engine)  # warming a loaded package is a no-op; building is the host's
    if engine is None:
        raise NotAllowed(f"{key} is not loaded; generate with it first, then warm its buckets")


def check_runtime(runtime: Runtime, key: EngineKey, mode: Mode | None) -> None:
    """What the in-process runtime cannot run is refused before an engine starts, with the reason."""
    if runtime is not Runtime.INPROCESS:
        return
    from engine.serving.inprocess import REFUSED_MODES, check_inprocess_key

    check_inprocess_key(key)
    if mode in REFUSED_MODES:
        raise UnsupportedCombination(f"mode {mode}: {REFUSED_MODES[mode]}")


def check_attention(key: EngineKey, options: EngineOptions) -> None:
    """An engine restarted with other options: its attention backend must run on its device and dtype."""
    from engine.pipeline import attention

    spec = devices.get_device(key.device)
    plan = devices.plan_precision(spec, key.precision)  # quantized engines attend in their base dtype
    attention.check_backend(options.attention_backend, spec, plan.base or plan.precision)
