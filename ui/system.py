"""The System tab and /system: devices (and why others are missing), versions, caches, environment.

The report is plain data (system_report), drawn as Markdown (system_markdown). Secrets never leave
this module: any variable whose name looks like a credential is listed as set but its value is
replaced, and in every other value credentials in URLs, known token formats and random-looking keys
are hidden.
"""

from __future__ import annotations

import math
import os
import platform
import re
import sys
import time
from importlib import metadata
from pathlib import Path

import gradio as gr

from engine.errors import scrub_paths
from engine.serving.interface import Serving
from ui import schemas
from ui.common import FAST, HandlerBase, document_api
from ui.views import fmt_bytes

PACKAGES = ("torch", "diffusers", "transformers", "accelerate", "gradio", "gradio_client", "torch_tpu",
            "torch-neuronx", "torchao")
# Variables that change how torch, the compilers, the Hub and the server behave.
ENV_PREFIXES = ("TORCH", "PYTORCH", "TORCHINDUCTOR", "CUDA", "HIP", "ROCM", "XLA", "TPU", "NEURON", "HF_",
                "HUGGINGFACE", "GRADIO_", "SHOWCASE_", "OMP_", "MKL_", "TRANSFORMERS_", "DIFFUSERS_",
                "TOKENIZERS_", "XDG_CACHE_HOME")
SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|AUTH|CREDENTIAL|KEY|PRIVATE|COOKIE|SESSION|SIGNATURE",
                    re.IGNORECASE)
HIDDEN = "(set; value hidden)"
SIZE_BUDGET_S = 2.0  # a huge cache folder is reported as "at least" rather than stalling the panel
# Values that are credentials whatever the variable is called: known token prefixes (Hugging Face,
# GitHub, OpenAI/Anthropic, Slack, AWS, Google, JWTs) and long random-looking strings.
TOKEN_VALUE = re.compile(r"\b(?:hf_|api_|gh[pousr]_|github_pat_|sk-|xox[abpr]-|AKIA|ASIA|AIza|eyJ)[A-Za-z0-9_\-.]{8,}")
URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/@\s]+)@")
RANDOM_RUN = re.compile(r"(?<![/\w+=\-])[A-Za-z0-9+=_\-]{20,}")  # not a path segment (after a "/")


def _looks_random(text: str) -> bool:
    """A run of 20+ characters mixing letters and many digits with high entropy: a key, not a name or a path."""
    digits = sum(c.isdigit() for c in text)
    if digits < max(3, len(text) // 10) or sum(c.isalpha() for c in text) < 3:
        return False
    counts = {c: text.count(c) for c in set(text)}
    entropy = -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())
    return entropy >= 3.5


def redact_value(value: str) -> str:
    """`value` with credentials in URLs, known token formats and random-looking keys replaced."""
    value = URL_CREDENTIALS.sub(lambda m: m["scheme"] + "(credentials hidden)@", str(value))
    value = TOKEN_VALUE.sub("(hidden)", value)
    return RANDOM_RUN.sub(lambda m: "(hidden)" if _looks_random(m.group()) else m.group(), value)


def redact(name: str, value: str) -> str:
    """Hidden when the name says it is a secret; otherwise the value with anything secret-looking hidden."""
    return HIDDEN if SECRET.search(name) else redact_value(value)


def environment_in_force(extra: dict[str, str] | None = None, environ=None) -> dict[str, str]:
    """The relevant variables of this process plus what worker processes get (`extra`, which wins: the
    workers are where engines compile, and this process's TORCHINDUCTOR_CACHE_DIR is torch's default once
    diffusers is imported), redacted."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if k.startswith(ENV_PREFIXES)}
    env.update(extra or {})
    return {k: redact(k, v) for k, v in sorted(env.items())}


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def folder_size(path: Path, budget_s: float = SIZE_BUDGET_S) -> tuple[int, bool]:
    """(bytes, complete): stops counting after budget_s so the panel never stalls on a huge cache."""
    total, deadline, stack = 0, time.monotonic() + budget_s, [Path(path)]
    while stack:
        if time.monotonic() > deadline:
            return total, False
        current = stack.pop()
        try:
            with os.scandir(current) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total, True


_SIZES_TTL_S = 30.0
_sizes_memo: dict = {}


def cache_folders(serving: Serving, device_names: list[str], environ=None) -> list[dict]:
    """Every cache folder the app and its workers use, and its size; sizes are remembered for 30 s
    (walking a big cache costs seconds of CPU that polling clients must not take from the engines)."""
    key = (str(serving.cache_dir), tuple(device_names), id(environ),
           tuple(sorted((k, str(v)) for k, v in engine_folders(serving).items())))  # engines come and go
    memo = _sizes_memo.get(key)
    if memo and time.monotonic() - memo[0] < _SIZES_TTL_S:
        return memo[1]
    rows = _cache_folders(serving, device_names, environ)
    _sizes_memo[key] = (time.monotonic(), rows)
    return rows


CACHE_LABELS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TORCH_NEURONX_NEFF_CACHE_DIR": "neuron NEFF"}
# What a worker reports (EngineReady.folders): its cache variables, TMPDIR, inductor's precompiled headers.
FOLDER_LABELS = {**CACHE_LABELS, "TMPDIR": "temporary files", "precompiled headers": "precompiled headers"}


def engine_folders(serving: Serving) -> dict[str, Path]:
    """Each loaded engine's compile and temporary folders as its worker reported them (where it really
    writes, after any move to a temporary cache), one row per folder with the engines using it."""
    users: dict[tuple[str, str], list[str]] = {}
    for engine in serving.engines():
        try:
            folders = engine.folders()
        except Exception:  # an engine going down must not hide the rest
            continue
        for name, path in folders.items():
            users.setdefault((FOLDER_LABELS.get(name, name), path), []).append(str(engine.key))
    return {f"{label} (in use by {', '.join(keys)})": Path(path) for (label, path), keys in users.items()}


def worker_cache_env(serving: Serving, device_names: list[str]) -> dict[str, str]:
    """The cache variables the workers of these devices are started with (the cache folder's)."""
    env: dict[str, str] = {}
    for name in device_names:
        try:
            env.update(serving.worker_cache_env(name))
        except Exception:  # an unknown or broken device must not hide the rest
            continue
    return env


def _cache_folders(serving: Serving, device_names: list[str], environ=None) -> list[dict]:
    environ = os.environ if environ is None else environ
    cache_dir = Path(serving.cache_dir)
    persistent = serving.cache_persistent
    folders = {
        "cache dir (--cache-dir)" + ("" if persistent else ", temporary: the configured one is not writable"):
            cache_dir,
        "tiny models": cache_dir / "models",
    }
    folders.update(engine_folders(serving))
    for var, value in worker_cache_env(serving, device_names).items():
        if var.endswith("_DIR"):
            folders[f"{CACHE_LABELS.get(var, var)} (workers' {var})"] = Path(value)
        else:
            folders[f"workers' {var}={value}"] = None  # a switch, e.g. the compile caches turned off
    try:
        from huggingface_hub import constants

        folders["Hugging Face hub cache"] = Path(constants.HF_HUB_CACHE)
    except Exception:
        pass
    if environ.get("GRADIO_TEMP_DIR"):
        folders["gradio outputs (GRADIO_TEMP_DIR)"] = Path(environ["GRADIO_TEMP_DIR"])
    rows = []
    for label, path in folders.items():
        if path is None:
            rows.append({"folder": label, "location": "", "size": ""})
            continue
        if path.exists():
            size, complete = folder_size(path)
            size_text = fmt_bytes(size) if complete else f"at least {fmt_bytes(size)}"
        else:
            size_text = "not created yet"
        # "location", not "path": clients read a "path" key as a file
        rows.append({"folder": label, "location": str(path), "size": size_text})
    return rows


def web_server(serving: Serving, edge=None) -> dict:
    """The web server's own memory (counted in the cpu budget) and the web edge's bounds."""
    try:
        import psutil

        rss = psutil.Process().memory_info().rss
    except Exception:
        rss = None
    row = {"memory": fmt_bytes(rss) if rss is not None else "unknown",
           "counted_in_budget": bool(serving.app_bytes("cpu"))}
    if edge is not None:
        row["edge"] = edge.snapshot()
    return row


def system_report(serving: Serving, devices_report: list[dict], edge=None) -> dict:
    available = [d["name"] for d in devices_report if d.get("available")]
    worker_env = worker_cache_env(serving, available)
    return {
        "devices": [
            {"name": d["name"], "label": d["label"], "available": d["available"],
             "auto": d.get("auto", False), "reason": d.get("reason", ""),
             "compile_backend": d.get("compile_backend"), "static_shapes": d.get("static_shapes"),
             "modes": d.get("modes", []), "memory": d.get("memory", "")}
            for d in devices_report
        ],
        "versions": versions(),
        "caches": cache_folders(serving, available),
        "environment": environment_in_force(worker_env),
        "engines": [
            {"engine": e["engine"], "state": e["state"], "load_s": e.get("load_s"),
             "notices": e.get("notices", []), "error": e.get("error"), "footprint": e.get("footprint")}
            for e in serving.status_rows()
        ],
        # budgets and use per device, engines started and evicted, the compile scheduler, the policy
        "host": serving.host_status(),
        "web_server": web_server(serving, edge),
    }


def _md_escape(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def system_markdown(report: dict) -> str:
    lines = ["### Devices", "", "| device | available | compile backend | modes | why not / memory |",
             "|---|---|---|---|---|"]
    for d in report["devices"]:
        avail = ("yes (auto)" if d["auto"] else "yes") if d["available"] else "no"
        why = d["memory"] if d["available"] else d["reason"]
        lines.append(f"| {d['name']} — {_md_escape(d['label'])} | {avail} | {d['compile_backend']} | "
                     f"{', '.join(d['modes'])} | {_md_escape(why)} |")
    lines += ["", "### Software", "", "| package | version |", "|---|---|"]
    lines += [f"| {k} | {_md_escape(v)} |" for k, v in report["versions"].items()]
    web = report.get("web_server") or {}
    if web:
        counted = " (counted in the cpu memory budget)" if web.get("counted_in_budget") else ""
        lines += ["", "### Web server", "", f"Resident memory: {web['memory']}{counted}"]
    lines += ["", "### Cache folders", "", "| folder | path | size |", "|---|---|---|"]
    lines += [f"| {c['folder']} | `{_md_escape(c['location'])}` | {c['size']} |" for c in report["caches"]]
    lines += ["", "### Environment in force", ""]
    if report["environment"]:
        lines += ["| variable | value |", "|---|---|"]
        lines += [f"| `{k}` | `{_md_escape(v)}` |" for k, v in report["environment"].items()]
    else:
        lines.append("(none of the relevant variables is set)")
    lines += cluster_lines((report.get("host") or {}).get("cluster"))
    if report["engines"]:
        lines += ["", "### Loaded engines", "", "| engine | state | load s | notices |", "|---|---|---|---|"]
        for e in report["engines"]:
            notes = "; ".join(e["notices"]) or (e["error"] or "")
            load = f"{e['load_s']:.2f}" if e.get("load_s") else ""
            lines.append(f"| {e['engine']} | {e['state']} | {load} | {_md_escape(notes)} |")
    return "\n".join(lines)


def for_visitors(value):
    """The report as a public server shows it: no server paths (folders keep their names and sizes) and the
    operating system without its kernel version."""
    if isinstance(value, dict):
        return {k: for_visitors(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [for_visitors(v) for v in value]
    return scrub_paths(value) if isinstance(value, str) else value


def cluster_lines(cluster: dict | None) -> list[str]:
    """Under --ray: the Ray cluster's nodes, their chips and resources (free of total)."""
    if not cluster:
        return []
    lines = ["", "### Ray cluster", "", "| node | address | chips | resources |", "|---|---|---|---|"]
    for n in cluster["nodes"]:
        resources = ", ".join(f"{k} {v:g}" for k, v in sorted(n["resources"].items()))
        lines.append(f"| {_md_escape(n['name'])} | {n['address']} | {', '.join(n['chips']) or '—'} | "
                     f"{_md_escape(resources)} |")
    lacking = [d for d in cluster["devices"] if d["why"]]
    if lacking:
        lines += ["", "Devices no node has: " + "; ".join(f"{d['device']} ({d['why']})" for d in lacking)]
    return lines


class SystemHandlers(HandlerBase):
    def system(self, refresh: bool = True) -> dict:
        """The report; `refresh` probes the devices again (the Refresh button). Public mode: for_visitors."""
        report = system_report(self.serving, self.devices_report(refresh=refresh), self.edge)
        if not self.serving.public():
            return report
        report["versions"]["platform"] = f"{platform.system()} {platform.machine()}"
        return for_visitors(report)

    def system_panel(self) -> str:
        return system_markdown(self.system(refresh=False))

    def system_refresh(self) -> str:
        return system_markdown(self.system(refresh=True))

    def system_api(self) -> dict:
        """Devices (and why others are missing), versions, cache folders, environment in force."""
        return self.system(refresh=False)


def build(h: SystemHandlers) -> None:
    """The tab (inside gr.Tabs), drawn when it is opened; and the /system API."""
    with gr.Tab("System", id="system") as tab:
        refresh_btn = gr.Button("Refresh", size="sm", elem_id="system-refresh")
        panel = gr.Markdown("Loading…", elem_id="system")
        document_api(gr.api(h.system_api, api_name="system", concurrency_limit=None),  # queue bound: ui/edge.py
                     returns=("system", "devices (available or why not), library versions, cache folders, the "
                              "environment in force (secrets hidden)"), schema=schemas.SYSTEM)
    tab.select(h.system_panel, None, panel, **FAST)
    refresh_btn.click(h.system_refresh, None, panel, **FAST)
