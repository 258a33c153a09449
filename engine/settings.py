"""Every environment variable the project reads, in one place.

Flags on the command line override these; these override the defaults below. Each variable is read by one
named function here (its docstring says what it means); the sections, in order:

- the app's own settings: cache and model folders, the server's defaults (`server_defaults`, one per flag
  of app.py), hosting (public mode, ZeroGPU, the runtime, GPU calls), priorities and the console;
- set by the app for its own children (a worker's short-runs file and log level, a rank's token file);
- set by torchrun for each rank (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, LOCAL_WORLD_SIZE, MASTER_*);
- read for the libraries (inductor's cache folder, a device's own variables, CXX, Gradio's statistics).

Outside this module a module may write the environment (for the libraries it imports next or the
children it starts) and copy the whole of it, but never read a variable by name (tests/test_settings_reads.py).
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

# The folder holding the engine package: the checkout, or site-packages once installed.
REPO_ROOT = Path(str(files("engine"))).resolve().parent
# The embedded default: a tiny model trained by this project (models/tiny-shapes) that draws its prompts.
DEFAULT_PRESET = "tiny-shapes"


def data_path(relative: str | Path) -> Path:
    """A file or folder the app ships as data ("presets", "models/tiny-shapes"): inside the installed engine
    package (a wheel carries them under engine/_data: setup.py), else at the checkout's root."""
    bundled = Path(str(files("engine"))) / "_data" / relative
    return bundled if bundled.exists() else REPO_ROOT / relative


PRESETS_DIR = data_path("presets")


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def cache_dir() -> Path:
    """Persistent folder for tiny models, inductor / NEFF caches and outputs (`--cache-dir`)."""
    default = Path(_env("XDG_CACHE_HOME", str(Path.home() / ".cache"))) / "diffusion-showcase"
    return Path(_env("SHOWCASE_CACHE_DIR", str(default))).expanduser()


def models_dir(root: Path | None = None) -> Path:
    """Where the random-weight tiny pipelines are built (once) and loaded from."""
    return (root or cache_dir()) / "models"


def model_roots() -> list[Path]:
    """Local model folders a user may serve with --model (colon-separated SHOWCASE_MODEL_ROOTS)."""
    raw = _env("SHOWCASE_MODEL_ROOTS")
    roots = [Path(p).expanduser().resolve() for p in raw.split(os.pathsep)] if raw else []
    return roots


def hf_offline() -> bool:
    """HF_HUB_OFFLINE, read as huggingface_hub reads it (1, true, yes, on)."""
    return (_env("HF_HUB_OFFLINE", "") or "").strip().lower() in ("1", "true", "yes", "on")


def server_defaults() -> dict:
    """Defaults for app.py (each has a flag of the same name)."""
    # Hugging Face Spaces (and other hosts) say where to bind through GRADIO_SERVER_NAME/PORT;
    # an explicit SHOWCASE_HOST/PORT still wins.
    return {
        "host": _env("SHOWCASE_HOST", _env("GRADIO_SERVER_NAME", "127.0.0.1")),
        "port": _env("SHOWCASE_PORT", _env("GRADIO_SERVER_PORT", "7860")),  # text: app.py checks its range
        "preset": _env("SHOWCASE_PRESET", DEFAULT_PRESET),
        "device": _env("SHOWCASE_DEVICE", "auto"),
        "precision": _env("SHOWCASE_PRECISION", "fp32"),
        "mode": _env("SHOWCASE_MODE", "compile"),
        "warm": _env("SHOWCASE_WARM", "all"),
        "queue_size": _env("SHOWCASE_QUEUE_SIZE", "64"),
        "auth": _env("SHOWCASE_AUTH"),  # "user:password"
        # hosting
        "public": hosting_mode()[0],
        "presets": _env("SHOWCASE_PRESETS"),  # comma-separated: what visitors may choose in public mode
        "precisions": _env("SHOWCASE_PRECISIONS"),
        "modes": _env("SHOWCASE_MODES"),
        "admin_token": _env("SHOWCASE_ADMIN_TOKEN"),
        "memory_budget": _env("SHOWCASE_MEMORY_BUDGET"),  # e.g. "3GiB"; default: per device (see README)
        "max_engines": _env("SHOWCASE_MAX_ENGINES"),
        "compile_jobs": _env("SHOWCASE_COMPILE_JOBS"),
        "idle_unload": _env("SHOWCASE_IDLE_UNLOAD"),  # seconds; off by default
        "worker_threads": _env("SHOWCASE_WORKER_THREADS"),  # cpu engines: compute threads each
        "client_events": _env("SHOWCASE_CLIENT_EVENTS"),  # public mode: events one client may hold
        "max_request_cost": _env("SHOWCASE_MAX_REQUEST_COST"),  # public mode: token-steps per request
        "max_visitor_cost": _env("SHOWCASE_MAX_VISITOR_COST"),  # public mode: token-steps one visitor holds
        "trusted_proxies": _env("SHOWCASE_TRUSTED_PROXIES"),  # whose X-Forwarded-For names the client
        "api_keys": _env("SHOWCASE_API_KEYS"),  # the /v1 API's key file, or "admin-token"
        # socket bounds (ui/sockets.py): unset -> app.py's defaults
        "max_connections": _env("SHOWCASE_MAX_CONNECTIONS"),
        "max_connections_per_client": _env("SHOWCASE_MAX_CONNECTIONS_PER_CLIENT"),
        "max_streams_per_client": _env("SHOWCASE_MAX_STREAMS_PER_CLIENT"),
        "header_timeout": _env("SHOWCASE_HEADER_TIMEOUT"),
        "max_header_bytes": _env("SHOWCASE_MAX_HEADER_BYTES"),
        "max_headers": _env("SHOWCASE_MAX_HEADERS"),
        "body_min_rate": _env("SHOWCASE_BODY_MIN_RATE"),  # request bodies (ui/bodies.py)
        "body_timeout": _env("SHOWCASE_BODY_TIMEOUT"),
        "runtime": _env("SHOWCASE_RUNTIME"),  # inprocess | workers; default: runtime_default()
        "aot_dir": _env("SHOWCASE_AOT_DIR"),  # aot packages on persistent storage (a Space's /data)
        "aot_repo": _env("SHOWCASE_AOT_REPO"),  # a Hub model repo holding aot packages
        "log_format": log_format(),  # text | json
        "mcp": mcp_server(),  # serve the API as MCP tools too
        "ray": _env("SHOWCASE_RAY"),  # join a Ray cluster: an address, or "auto" (engine/fleet/)
        "replicas": _env("SHOWCASE_REPLICAS"),  # copies of each engine on the fleet (--ray)
    }


_FALSE = ("0", "false", "False", "no", "off")


def space_id() -> str | None:
    """Set by Hugging Face Spaces on every Space (owner/name)."""
    return _env("SPACE_ID")


def zero_gpu() -> bool:
    """A ZeroGPU Space (the `spaces` package reads the same variable)."""
    return (_env("SPACES_ZERO_GPU", "") or "").lower() in ("1", "t", "true")


def hosting_mode() -> tuple[bool, str]:
    """(public, why). SHOWCASE_PUBLIC decides when set; on a Space (SPACE_ID) the default is public, so a
    host who forgot --public does not hand visitors Hub loads and engine restarts."""
    explicit = _env("SHOWCASE_PUBLIC")
    if explicit is not None:
        public = explicit not in _FALSE
        return public, f"SHOWCASE_PUBLIC={explicit}"
    if space_id():
        return True, f"running on a Space (SPACE_ID={space_id()}); SHOWCASE_PUBLIC=0 or --no-public opts out"
    return False, "not on a Space and SHOWCASE_PUBLIC is not set; --public turns it on"


def runtime_default() -> tuple[str, str]:
    """(runtime, why): in-process on ZeroGPU (no long-lived device process can run there), else workers."""
    if zero_gpu():
        return "inprocess", "SPACES_ZERO_GPU is set: device work runs in ZeroGPU's forked GPU calls"
    return "workers", "one worker process per engine (the default off ZeroGPU)"


def gpu_calls() -> str:
    """How the in-process runtime runs a GPU call: spaces (ZeroGPU), direct, or fork (SHOWCASE_GPU_CALLS)."""
    return _env("SHOWCASE_GPU_CALLS", "spaces" if zero_gpu() else "direct")


def zero_gpu_size() -> str | None:
    """ZeroGPU slice size a GPU call asks for: large (the default) or xlarge (SHOWCASE_ZERO_GPU_SIZE)."""
    return _env("SHOWCASE_ZERO_GPU_SIZE")


def gpu_default_duration_s() -> float:
    """The `duration` of a GPU call with no measurement yet (a bucket's first request): ZeroGPU's default."""
    return float(_env("SHOWCASE_GPU_DURATION", "60"))


def gpu_max_duration_s() -> float:
    """The longest `duration` a request's GPU call asks for."""
    return float(_env("SHOWCASE_GPU_MAX_DURATION", "120"))


def gpu_build_duration_s() -> float:
    """The `duration` of a GPU call that builds a bucket's aot packages (export + AOTInductor)."""
    return float(_env("SHOWCASE_GPU_BUILD_DURATION", "300"))


def aot_dir() -> Path | None:
    """Where aot packages live when not under the cache folder (SHOWCASE_AOT_DIR: persistent storage)."""
    value = _env("SHOWCASE_AOT_DIR")
    return Path(value).expanduser() if value else None


def default_compile_jobs() -> int:
    """Compiles at once on this host: compiling is CPU-bound (tracing, inductor, the C++/Triton compilers),
    so one per four cores, at least one: a 2-core box compiles one bucket at a time."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def worker_niceness() -> int:
    """CPU priority of engine worker processes, below the web server's (0): under full load the server
    still answers, streams progress and hands results on at once; engines share what is left equally."""
    return int(_env("SHOWCASE_WORKER_NICENESS", "5"))


def compile_niceness() -> int:
    """How much lower than its engine's requests an engine's compile thread runs: +10 gives requests
    about nine tenths of a contended core while a compile still moves on (+19 starved compiles under
    steady traffic; 0 = like the requests)."""
    return int(_env("SHOWCASE_COMPILE_NICENESS", "10"))


def short_request_ms() -> float:
    """cpu engines: requests expected to run this long or less keep the worker's priority; longer ones run
    two nice steps lower per doubling (engine/worker/priority.py). 0 turns the ordering off."""
    return float(_env("SHOWCASE_SHORT_REQUEST_MS", "100"))


def compile_yields() -> bool:
    """Whether a worker's compile thread steps aside while a request runs (engine/worker/loop.py)."""
    return _env("SHOWCASE_COMPILE_YIELD", "1") not in ("0", "false", "no", "off")


def long_requests_step_aside() -> bool:
    """cpu engines: whether a long request waits before each step while another engine runs a short one
    (engine/worker/priority.py ShortRuns)."""
    return _env("SHOWCASE_STEP_ASIDE", "1") not in ("0", "false", "no", "off")


def switch_interval_s() -> float:
    """The worker's interpreter thread switch interval (see engine/worker/loop.py)."""
    return float(_env("SHOWCASE_SWITCH_INTERVAL", "0.0005"))


def workers_at_own_priority() -> None:
    """A one-shot command (`python -m engine generate`) has no web server its worker must yield to: the
    worker and its loading thread run at the command's own priority, unless the user exported a niceness."""
    os.environ.setdefault("SHOWCASE_WORKER_NICENESS", "0")
    os.environ.setdefault("SHOWCASE_COMPILE_NICENESS", "0")


def log_format() -> str:
    """How the app's processes write log lines: text (default) or json, one object per line
    (SHOWCASE_LOG_FORMAT; workers inherit it)."""
    return _env("SHOWCASE_LOG_FORMAT", "text")


def mcp_server() -> bool:
    """Serve the public API endpoints as MCP tools (SHOWCASE_MCP=1). Off unless asked: it needs the optional
    `mcp` extra, and it opens the app to agents, which a host decides."""
    return (_env("SHOWCASE_MCP", "0") or "0") not in _FALSE


def ray_address() -> str | None:
    """The Ray cluster `--ray auto` joins: Ray's own RAY_ADDRESS (None: start a local one)."""
    return _env("RAY_ADDRESS")


def ray_current_cluster() -> str | None:
    """The cluster Ray's `ray.init("auto")` joins when RAY_ADDRESS is unset: the address the last `ray start`
    wrote to ray_current_cluster in Ray's temp folder ($RAY_TMPDIR, else $TMPDIR, else /tmp, then "ray")."""
    base = _env("RAY_TMPDIR") or _env("TMPDIR") or os.path.join(os.sep, "tmp")
    try:
        with open(os.path.join(base, "ray", "ray_current_cluster"), encoding="utf-8") as f:
            return f.read(512).strip() or None
    except (OSError, UnicodeError):
        return None


def fleet_start_timeout_s() -> float:
    """How long a Ray engine may wait for a node to take it and start its actor (engine/fleet/client.py)."""
    return float(_env("SHOWCASE_FLEET_START_S", "120"))


# -- set by the app for its own children --------------------------------------------------------------
def short_runs() -> str | None:
    """The host's file of engines running a short request (SHOWCASE_SHORT_RUNS, set by the manager for a
    cpu worker: engine/worker/priority.py ShortRuns)."""
    return _env("SHOWCASE_SHORT_RUNS")


def log_level() -> str:
    """The level of a worker's or a rank's console (SHOWCASE_LOG_LEVEL, default WARNING)."""
    return _env("SHOWCASE_LOG_LEVEL", "WARNING")


def tp_token_file() -> str | None:
    """The token file a tensor-parallel rank authenticates with (SHOWCASE_TP_TOKEN_FILE, set by the launcher)."""
    return _env("SHOWCASE_TP_TOKEN_FILE")


def tp_store_host() -> str | None:
    """The address torchrun's stores bind to (SHOWCASE_TP_STORE_HOST, set by the launcher)."""
    return _env("SHOWCASE_TP_STORE_HOST")


# -- set by torchrun for each rank ----------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    """RANK, WORLD_SIZE and LOCAL_RANK all set: this process is a rank torchrun started."""
    return all(_env(name) is not None for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def torchrun_rank() -> int | None:
    """RANK, or None outside a torchrun launch."""
    value = _env("RANK")
    return int(value) if value is not None else None


def torchrun_world_size() -> int | None:
    value = _env("WORLD_SIZE")
    return int(value) if value is not None else None


def torchrun_local_rank() -> int:
    return int(_env("LOCAL_RANK", "0"))


def torchrun_group_rank() -> int:
    """GROUP_RANK: this node's index in a multi-node launch (0 on one node)."""
    return int(_env("GROUP_RANK", "0"))


def torchrun_local_world_size() -> int:
    return int(_env("LOCAL_WORLD_SIZE", "1"))


def torchrun_master() -> tuple[str | None, str | None]:
    """(MASTER_ADDR, MASTER_PORT) of the launch's rendezvous."""
    return _env("MASTER_ADDR"), _env("MASTER_PORT")


# -- read for the libraries ----------------------------------------------------------------------------
def inductor_cache_dir() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR as this process sees it (torch writes its default into it once torch._dynamo
    is imported: engine/devices/environment.py)."""
    return _env("TORCHINDUCTOR_CACHE_DIR")


def device_variable(name: str) -> str | None:
    """A variable a device spec names in its tables (`cache_env`, `mode_env`: engine/devices/*.py), which
    document each one; for other variables, a named function of this module."""
    return _env(name)


def pythonpath() -> str | None:
    """PYTHONPATH, which a child the app starts (the advisor's bench) extends with the checkout."""
    return _env("PYTHONPATH")


def cxx() -> str | None:
    """CXX: the C++ compiler inductor is pointed at when it is on the PATH."""
    return _env("CXX")


def aten_cpu_capability() -> str | None:
    """ATEN_CPU_CAPABILITY: a vector ISA the user pinned (then inductor's SIMD width is left as it is)."""
    return _env("ATEN_CPU_CAPABILITY")


def device_backend_autoload() -> bool:
    """TORCH_DEVICE_BACKEND_AUTOLOAD: whether torch loads device backends (torch_tpu) at `import torch`."""
    return _env("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "0"


def gradio_statistics_configured() -> bool:
    """Whether the host set Gradio's queue statistics variables (then the app leaves them as they are)."""
    return any(name in os.environ for name in GRADIO_STATISTICS_VARS)


GRADIO_STATISTICS_VARS = ("GRADIO_ANALYTICS_CACHE_FREQUENCY", "GRADIO_ANALYTICS_MAX_EVENTS")


def gradio_analytics_cache_frequency() -> str | None:
    return _env("GRADIO_ANALYTICS_CACHE_FREQUENCY")
