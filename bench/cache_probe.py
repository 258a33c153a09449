"""The persistent-cache probe: one bucket's compile time in a fresh process, empty cache vs filled cache.

A restart is what the persistent inductor cache is for, so both compiles run in fresh child processes
(`python -m bench bench --_compile-probe ...`): the first with an empty `TORCHINDUCTOR_CACHE_DIR`
(cold), the second with the same folder, now filled (warm). The folder is set in the child's
environment, so it is in force before the child imports torch. The child prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.measure import build_runner
from bench.modes import MODE_TABLE
from bench.plan import BenchPlan, plan_from_args
from bench.report import fmt
from bench.stats import ratio
from engine import devices, settings
from engine.devices import INDUCTOR_CACHE_VAR
from engine.protocol import BucketKey

PROBE_MARK = "BENCH_PROBE "
REPO = Path(__file__).resolve().parents[2]  # the children run `python -m engine` from here


def run_cache_probe(plan: BenchPlan, device: str, mode: str, bar=None) -> dict:
    """Compile one bucket (the plan's first precision and size) cold, then warm, in fresh children."""
    precision, size = plan.precisions[0], plan.sizes[0]
    folder = Path(tempfile.mkdtemp(prefix="showcase-bench-inductor-"))
    cmd = [
        sys.executable, "-m", "bench", "bench", "--_compile-probe", "--preset", plan.preset.name,
        "--device", device, "--precisions", precision, "--modes", mode, "--sizes", str(size),
        "--cache-dir", str(plan.cache_dir), *plan.model_args,
        *(["--threads", str(plan.threads)] if plan.threads else []), *plan.engine_args,
    ]
    env = {**os.environ, INDUCTOR_CACHE_VAR: str(folder)}
    out: dict = {"mode": mode, "precision": precision, "size": str(size), "cache_dir": str(folder)}
    try:
        for label in ("cold", "warm"):
            if bar:
                bar.set_postfix_str(f"persistent cache: {label} compile in a fresh process")
            start = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=plan.probe_timeout_s,
                                  cwd=str(REPO))
            wall = time.perf_counter() - start
            if bar:
                bar.update()
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith(PROBE_MARK)]
            if proc.returncode != 0 or not found:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                out["error"] = f"{label} probe exited {proc.returncode}: {' | '.join(tail)}"
                return out
            child = json.loads(found[-1][len(PROBE_MARK):])
            out[f"{label}_compile_s"] = child.get("compile_s")
            out[f"{label}_process_s"] = wall
            out[f"{label}_child"] = child
            if child.get("error"):
                out["error"] = f"{label} probe: {child['error']}"
                return out
        out["ratio"] = ratio(out.get("warm_compile_s"), out.get("cold_compile_s"))
        out["note"] = (f"{mode} {precision} {size}: cold {fmt(out.get('cold_compile_s'), 1)} s, "
                       f"with the cache {fmt(out.get('warm_compile_s'), 1)} s (first bucket call in a fresh process)")
    except subprocess.TimeoutExpired:
        out["error"] = f"probe took longer than {plan.probe_timeout_s:.0f}s"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def _inductor_cache_dir() -> str | None:
    """The folder inductor itself resolved (the probe checks it is the one the parent set)."""
    try:  # a private module, imported only here: its location has moved between torch releases
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:
        return None


def cmd_compile_probe(args) -> int:
    """Child side of the persistent-cache probe: load, compile one bucket, print one JSON line."""
    plan = plan_from_args(args)
    spec = devices.resolve_device(plan.device)
    mode = MODE_TABLE[plan.modes[0]]
    runner = build_runner(plan, spec, plan.precisions[0], mode)
    runner.load()
    info = runner.warm_bucket(BucketKey(mode.engine, plan.sizes[0]))
    print(PROBE_MARK + json.dumps({
        "compile_s": info.compile_s,
        "cache_hits": info.cache_hits,
        "cache_misses": info.cache_misses,
        "warmup_s": info.warmup_s,
        "state": info.state.value,
        "error": info.error,
        "env_cache_dir": settings.inductor_cache_dir(),
        "inductor_cache_dir": _inductor_cache_dir(),
        "pid": os.getpid(),
    }), flush=True)
    return 0
