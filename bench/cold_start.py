"""The cold-start probe: how long until every bucket of an engine is warm in a fresh process.

This is what mode aot is for. Four fresh child processes, one after another, each on the same preset,
device and precision, warming every bucket of the preset (the default engine's start-up list):

1. compile, with an empty inductor cache (a new machine or a wiped cache);
2. compile, with that cache now filled (a restart);
3. `python -m engine export`: builds the aot packages (what a Docker build step or CI would run);
4. aot, with those packages and an empty inductor cache (proves nothing is compiled), then the first
   request at each bucket and a few steady ones (no hidden compile), and the process's memory with one
   bucket's packages loaded and with all of them (the packages share the engine's weights).

Each child is `python -m bench bench --_cold-start-child ...` and prints one JSON line. Times are taken
inside the child from its own process start (`psutil.Process().create_time()`), so interpreter start-up,
imports and the weights' load count: "ready" is what a user waits for. The warm-up alone (engine
loaded -> every bucket warm) is reported too. Children get the folders through their environment and
`--cache-dir`, so they are in force before the child imports torch.
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

from bench.bench_options import BenchOptions
from bench.measure import build_runner
from bench.modes import MODE_TABLE
from bench.plan import BenchPlan, plan_from_args
from bench.report import fmt
from bench.stats import median, ratio
from engine import devices, settings
from engine.config.flags import from_args
from engine.config.request import ImageRequest
from engine.devices import INDUCTOR_CACHE_VAR
from engine.protocol import BucketKey, EngineOptions, GenerateRequest, Mode, OnCold

CHILD_MARK = "BENCH_COLD_START "
REPO = Path(__file__).resolve().parents[2]  # the children run `python -m engine` from here
COLD_START_STEPS = 4  # progress-bar steps: two compile children, the export, the aot child


def _files(folder: str | None) -> int:
    if not folder or not Path(folder).is_dir():
        return 0
    return sum(len(files) for _, _, files in os.walk(folder))


def cmd_cold_start_child(args) -> int:
    """Child: load, warm every bucket given, time it from this process's start; aot also serves requests."""
    import psutil

    from engine.pipeline.runner import compiles_in_this_thread

    process = psutil.Process()
    started = process.create_time()
    main_at = time.time()
    plan = plan_from_args(args)
    spec = devices.resolve_device(plan.device)
    mode = MODE_TABLE[plan.modes[0]]
    runner = build_runner(plan, spec, plan.precisions[0], mode)
    runner.load()
    loaded_at = time.time()
    out: dict = {"mode": mode.name, "startup_s": main_at - started, "load_s": loaded_at - main_at,
                 "rss_loaded": process.memory_info().rss, "buckets": [], "pid": os.getpid()}
    compiles_before = compiles_in_this_thread()
    for size in plan.sizes:
        info = runner.warm_bucket(BucketKey(mode.engine, size))
        out["buckets"].append({"size": str(size), "state": info.state.value, "origin": info.origin,
                               "error": info.error, "compile_s": info.compile_s, "warmup_s": info.warmup_s,
                               "cache_hits": info.cache_hits, "cache_misses": info.cache_misses,
                               "rss": process.memory_info().rss, "ready_s": time.time() - started})
    ready_at = time.time()
    out.update(warm_s=ready_at - loaded_at, ready_s=ready_at - started,
               warm_compiles=compiles_in_this_thread() - compiles_before)
    if mode.engine is Mode.AOT and plan.cold_start_runs > 0:
        _requests(runner, plan, mode.engine, out)
    out["inductor_cache_files"] = _files(settings.inductor_cache_dir())
    print(CHILD_MARK + json.dumps(out), flush=True)
    return 0


def _requests(runner, plan: BenchPlan, mode: Mode, out: dict) -> None:
    """The first request at each bucket, then steady ones round-robin: per bucket, first / steady median."""

    def run(size, seed):
        request = GenerateRequest.checked(prompt=plan.prompt, width=size.width, height=size.height, steps=plan.steps,
                                  guidance=plan.preset.guidance, seed=seed, mode=mode, on_cold=OnCold.EAGER)
        result = runner.generate(request)
        out["request_recompiles"] = out.get("request_recompiles", 0) + result.recompiles
        out["eager_fallbacks"] = out.get("eager_fallbacks", 0) + int(result.eager_fallback)
        return result.timings.total_ms

    first = {str(s): run(s, 1) for s in plan.sizes}
    steady: dict[str, list[float]] = {str(s): [] for s in plan.sizes}
    for i in range(plan.cold_start_runs):
        for s in plan.sizes:
            steady[str(s)].append(run(s, 100 + i))
    out["first_request_ms"] = first
    out["steady_ms"] = {k: median(v) for k, v in steady.items()}


def _child(cmd: list[str], env: dict, timeout: float) -> dict:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_MARK)]
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"exited {proc.returncode}: {' | '.join(tail)}")
    return json.loads(found[-1][len(CHILD_MARK):])


def run_cold_start_probe(plan: BenchPlan, device: str, bar=None) -> dict:
    """Compile (empty, then filled inductor cache), export, then aot with packages: each in a fresh process."""
    precision, sizes = plan.precisions[0], plan.preset.buckets
    root = Path(tempfile.mkdtemp(prefix="showcase-bench-cold-start-"))
    cache = root / "cache"  # packages go here; the tiny models are the plan's (linked, not rebuilt)
    cache.mkdir()
    models = Path(plan.cache_dir) / "models"
    if models.is_dir():
        (cache / "models").symlink_to(models.resolve())
    common = ["--preset", plan.preset.name, "--device", device, "--precisions", precision,
              "--sizes", ",".join(str(s) for s in sizes), "--cache-dir", str(cache), *plan.model_args,
              *plan.engine_args]
    threads = ["--threads", str(plan.threads)] if plan.threads else []
    bench = [sys.executable, "-m", "bench", "bench", "--_cold-start-child", "--no-progress",
             "--steps", str(plan.steps), "--cold-start-runs", str(plan.cold_start_runs), *threads, *common]
    export = [sys.executable, "-m", "engine", "export", "--preset", plan.preset.name, "--device", device,
              "--precision", precision, "--sizes", ",".join(str(s) for s in sizes), "--cache-dir", str(cache),
              "--json", "--no-progress", *plan.model_args, *plan.engine_args]
    out: dict = {"precision": precision, "sizes": [str(s) for s in sizes], "steps": plan.steps}
    inductor_compile = root / "inductor-compile"  # empty for the first child, filled for the second
    try:
        for label, mode, folder in (("compile_empty", "compile", inductor_compile),
                                    ("compile_filled", "compile", inductor_compile)):
            if bar:
                bar.set_postfix_str(f"cold start: {label.replace('_', ', ')} cache, fresh process")
            out[label] = _child([*bench, "--modes", mode], {**os.environ, INDUCTOR_CACHE_VAR: str(folder)},
                                plan.probe_timeout_s * len(sizes))
            if bar:
                bar.update()
        if bar:
            bar.set_postfix_str("cold start: python -m engine export")
        start = time.perf_counter()
        proc = subprocess.run(export, capture_output=True, text=True, timeout=plan.probe_timeout_s * 2 * len(sizes),
                              cwd=str(REPO), env={**os.environ, INDUCTOR_CACHE_VAR: str(root / "inductor-export")})
        out["export_s"] = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"export exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
        out["export"] = json.loads(proc.stdout)
        if bar:
            bar.update()
            bar.set_postfix_str("cold start: aot with packages, fresh process")
        out["aot"] = _child([*bench, "--modes", "aot"], {**os.environ, INDUCTOR_CACHE_VAR: str(root / "inductor-aot")},
                            plan.probe_timeout_s * len(sizes))
        if bar:
            bar.update()
            bar.set_postfix_str("cold start: in-process vs worker runtime, fresh processes")
        out["runtimes"] = run_runtime_probe(plan, device, cache, root)
        _ratios(out)
        _runtime_ratios(out)
    except subprocess.TimeoutExpired as exc:
        out["error"] = f"a cold-start process took longer than {exc.timeout:.0f}s"
    except (RuntimeError, ValueError) as exc:
        out["error"] = f"cold-start probe: {exc}"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


# -- the in-process runtime beside the worker runtime -------------------------------------------------
RUNTIME_MARK = "BENCH_RUNTIME "


def cmd_runtime_child(args) -> int:
    """Child: an EngineManager with `--_runtime-child` as its runtime. eager: the first image of the preset's
    first bucket from this process's start, then steady images; aot: every bucket warm (packages present)."""
    import psutil

    from engine.serving.manager import EngineManager

    started = psutil.Process().create_time()
    plan = plan_from_args(args)
    runtime, mode = from_args(BenchOptions, args)._runtime_child.split(":")
    manager = EngineManager(cache_dir=plan.cache_dir, options=EngineOptions(warm_sizes=(), warm_modes=()),
                            runtime=runtime, auto_restart=False)
    out: dict = {"runtime": runtime, "mode": mode}
    try:
        kwargs = dict(preset=plan.preset.name, device=plan.device, precision=plan.precisions[0], prompt=plan.prompt,
                      steps=plan.steps)
        if mode == "eager":
            size = str(plan.sizes[0])
            manager.generate(ImageRequest(mode="eager", size=size, seed=0, **kwargs))
            out["first_image_s"] = time.time() - started
            times = []
            for i in range(max(1, plan.cold_start_runs)):
                t0 = time.perf_counter()
                manager.generate(ImageRequest(mode="eager", size=size, seed=100 + i, **kwargs))
                times.append((time.perf_counter() - t0) * 1000)
            out["steady_ms"] = median(times)
        else:
            key = manager.gate.make_key(plan.preset.name, plan.device, plan.precisions[0])
            engine = manager.engine(key)
            engine.wait_ready(plan.probe_timeout_s)
            loaded = time.time()
            buckets = []
            for size in plan.sizes:
                engine.warm(BucketKey(Mode.AOT, size))
            deadline = time.monotonic() + plan.probe_timeout_s * len(plan.sizes)
            while time.monotonic() < deadline:
                infos = [b for b in engine.buckets() if b.bucket.mode is Mode.AOT and b.bucket.size in plan.sizes]
                if infos and all(b.state.value in ("warm", "failed") for b in infos):
                    buckets = [{"size": str(b.bucket.size), "state": b.state.value, "origin": b.origin,
                                "error": b.error} for b in infos]
                    break
                time.sleep(0.05)
            out.update(ready_s=time.time() - started, warm_s=time.time() - loaded, buckets=buckets)
    finally:
        manager.shutdown()
    print(RUNTIME_MARK + json.dumps(out), flush=True)
    return 0


def run_runtime_probe(plan: BenchPlan, device: str, cache: Path, root: Path) -> dict:
    """Fresh processes, one run each: the worker and the in-process runtime serving the preset eagerly
    (first image from process start, steady images), then in-process with the aot packages present."""
    precision = plan.precisions[0]
    base = [sys.executable, "-m", "bench", "bench", "--no-progress", "--preset", plan.preset.name,
            "--device", device, "--precisions", precision, "--steps", str(plan.steps),
            "--cold-start-runs", str(plan.cold_start_runs), "--cache-dir", str(cache), *plan.model_args,
            *plan.engine_args]
    env = {**os.environ, INDUCTOR_CACHE_VAR: str(root / "inductor-runtime")}
    out = {}
    for label, child, sizes in (("workers", "workers:eager", plan.preset.buckets[:1]),
                                ("inprocess", "inprocess:eager", plan.preset.buckets[:1]),
                                ("inprocess_aot", "inprocess:aot", plan.preset.buckets)):
        cmd = [*base, "--sizes", ",".join(str(s) for s in sizes), "--_runtime-child", child]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(REPO),
                              timeout=plan.probe_timeout_s * (1 + len(sizes)))
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith(RUNTIME_MARK)]
        if proc.returncode != 0 or not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"{label} runtime child exited {proc.returncode}: {' | '.join(tail)}")
        out[label] = json.loads(found[-1][len(RUNTIME_MARK):])
    return out


def _runtime_ratios(out: dict) -> None:
    runtimes, empty = out.get("runtimes"), out.get("compile_empty")
    if not runtimes or "ratios" not in out:
        return
    workers, inproc, aot_in = runtimes["workers"], runtimes["inprocess"], runtimes["inprocess_aot"]
    not_loaded = [b["size"] for b in aot_in["buckets"] if b["origin"] != "loaded from package"]
    out["ratios"].update({
        "inprocess_first_image": ratio(inproc["first_image_s"], workers["first_image_s"]),
        "inprocess_steady": ratio(inproc["steady_ms"], workers["steady_ms"]),
        "inprocess_aot_cold_start": None if not_loaded else ratio(aot_in["ready_s"], empty["ready_s"]),
    })
    out["notes"].update({
        "inprocess_first_image": (f"first image {fmt(inproc['first_image_s'], 2)} s in-process vs "
                                  f"{fmt(workers['first_image_s'], 2)} s workers, from process start"),
        "inprocess_steady": f"image {fmt(inproc['steady_ms'], 1)} ms in-process vs {fmt(workers['steady_ms'], 1)} ms",
        "inprocess_aot_cold_start": (f"every bucket warm {fmt(aot_in['ready_s'], 1)} s in-process with packages vs "
                                     f"{fmt(empty['ready_s'], 1)} s compile (empty cache)"
                                     + (f"; not loaded: {not_loaded}" if not_loaded else "")),
    })


def _ratios(out: dict) -> None:
    empty, filled, aot = out["compile_empty"], out["compile_filled"], out["aot"]
    not_loaded = [b["size"] for b in aot["buckets"] if b["origin"] != "loaded from package"]
    failed = [f"{c['mode']} {b['size']}: {b['error']}" for c in (empty, filled, aot) for b in c["buckets"]
              if b["state"] != "warm"]
    if failed or not_loaded:
        out["error"] = "; ".join(failed + [f"aot {s} was not loaded from a package" for s in not_loaded])
        return
    firsts = {s: ratio(ms, aot["steady_ms"].get(s)) for s, ms in aot.get("first_request_ms", {}).items()}
    worst = max(firsts, key=lambda s: firsts[s] or 0) if firsts else None
    # One first request per bucket against the median of its steady ones: the median over buckets, as the
    # warm-hit ratio takes the median over configurations (a single sample on a shared machine is noisy).
    first_median = median([v for v in firsts.values() if v is not None])
    rss_one, rss_all = aot["buckets"][0]["rss"], aot["buckets"][-1]["rss"]
    out["ratios"] = {
        "aot_cold_start_empty": ratio(aot["ready_s"], empty["ready_s"]),
        "aot_cold_start_filled": ratio(aot["ready_s"], filled["ready_s"]),
        "aot_warmup_filled": ratio(aot["warm_s"], filled["warm_s"]),
        "aot_first_request": first_median,
        "aot_memory": ratio(rss_all, rss_one),
        "aot_recompiles": float(aot["warm_compiles"] + aot.get("request_recompiles", 0)),
    }
    n = len(aot["buckets"])
    ready = (f"ready after {fmt(aot['ready_s'], 1)} s (aot) vs {fmt(empty['ready_s'], 1)} s (compile, empty cache) "
             f"vs {fmt(filled['ready_s'], 1)} s (compile, filled cache), {n} buckets, from process start")
    out["notes"] = {
        "aot_cold_start_empty": ready,
        "aot_cold_start_filled": ready,
        "aot_warmup_filled": (f"warm-up {fmt(aot['warm_s'], 2)} s (aot) vs {fmt(filled['warm_s'], 2)} s (compile, "
                              f"filled cache) vs {fmt(empty['warm_s'], 1)} s (empty); load "
                              f"{fmt(aot['load_s'], 1)} s, start-up {fmt(aot['startup_s'], 1)} s"),
        "aot_first_request": ("per bucket " + ", ".join(f"{s} {fmt(v, 2)}" for s, v in firsts.items())
                              + f"; worst {worst}: first {fmt(aot['first_request_ms'].get(worst), 1)} ms vs steady "
                              f"{fmt(aot['steady_ms'].get(worst), 1)} ms" if worst else ""),
        "aot_memory": (f"RSS {rss_one / 2**20:.0f} MiB with one bucket, {rss_all / 2**20:.0f} MiB with {n} "
                       f"(engine loaded: {aot['rss_loaded'] / 2**20:.0f} MiB)"),
        "aot_recompiles": (f"{aot['warm_compiles']} while loading, {aot.get('request_recompiles', 0)} in requests; "
                           f"{aot['inductor_cache_files']} files in its (initially empty) inductor cache; "
                           f"export took {fmt(out.get('export_s'), 0)} s"),
    }
