"""The fleet's per-request overhead: one engine in a Ray actor (engine/fleet/) against the same engine in a
local worker process, at the same warm bucket.

    python -m bench fleet-bench                      # tiny-shapes, cpu, eager 64x64, 2 steps, 30 rounds
    python -m bench fleet-bench --ray 10.0.0.5:6379  # an existing cluster (the engine lands where Ray puts it)

Without --ray the bench starts a cluster of this machine (a head without CPUs and one node; loopback only,
no dashboard) and stops it at the end. Both engines load the same preset, device and precision; after a
few warm-up requests, rounds alternate local, Ray, Ray, local, ... so a load change on the machine hits
both alike. Each request is timed at the client, from submit to result; the engine's own time for it
(Timings.total_ms: encode, denoise, decode) is taken out, leaving what the path around the engine costs
(the socket, the worker's queue, the PNG's trip back). Printed: medians with their spread (p10-p90) of
both, side by side, the difference of the medians against the target, and each engine's cold start (from
asking for it to ready: for the Ray engine, placement and the actor's process included).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

from bench import flags
from engine.config.flags import from_args
from engine.config.request import ImageRequest
from engine.errors import ShowcaseError
from engine.metrics import median, percentile
from engine.protocol import EngineOptions, Mode, Size

TARGET_MS = 15.0  # the Ray engine's median may cost at most this much more per request than a local worker's


@dataclass(frozen=True)
class FleetBenchOptions:
    """`fleet-bench`'s flags."""

    ray: str | None = flags.text(None, "an existing Ray cluster (default: start one of this machine for the run)",
                                 metavar="ADDRESS")
    preset: str = flags.preset("tiny-shapes")
    device: str = flags.device("cpu")
    precision: str = flags.precision("fp32")
    mode: str = flags.mode("eager", "the bucket's mode (a compiled one is warmed first)")
    size: str = flags.size("64x64")
    steps: int = flags.steps(2)
    rounds: int = flags.count(30, "requests on each engine (default 30)")
    cache_dir: str | None = flags.cache_dir()
    json: bool = flags.as_json("print the result as one JSON line")


def add_fleet_bench_parser(sub) -> None:
    flags.add_command(sub, "fleet-bench", FleetBenchOptions, cmd_fleet_bench,
                      help="per-request overhead of an engine in a Ray actor vs a local worker (medians and spreads "
                           "side by side)")


@contextmanager
def local_cluster():
    """A cluster of this machine on loopback: a head without CPUs and one node; its address."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read by Ray: every node on 127.0.0.1
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "object_store_memory": 80 * 2**20})
    cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20, labels={"showcase-node": "bench-node"})
    cluster.wait_for_nodes()
    try:
        yield cluster.address
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


def _request(opts, seed: int) -> ImageRequest:
    return ImageRequest(opts.preset, prompt="a red circle", device=opts.device, precision=opts.precision,
                        mode=opts.mode, size=opts.size, steps=opts.steps, seed=seed)


def _timed(manager, opts, seed: int) -> tuple[float, float]:
    """(client ms, engine ms) of one request."""
    started = time.perf_counter()
    result = manager.generate(_request(opts, seed), timeout=600)
    return (time.perf_counter() - started) * 1000, result.timings.total_ms


def warm_bucket(manager, opts) -> None:
    """A compiled mode: compile the bucket and wait until it is warm (eager buckets always are)."""
    if not Mode.parse(opts.mode, "mode").compiled:
        return
    manager.warm(opts.preset, opts.device, opts.precision, opts.mode, opts.size)
    engine = manager.engine(manager.gate.make_key(opts.preset, opts.device, opts.precision))
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        states = {str(b.bucket): b.state for b in engine.buckets() if b.bucket.batch == 1}
        state = states.get(f"{opts.mode}:{Size.parse(opts.size)}")
        if state == "warm":
            return
        if state == "failed":
            raise ShowcaseError(f"the {opts.mode} bucket {opts.size} failed to compile")
        time.sleep(0.5)
    raise ShowcaseError(f"the {opts.mode} bucket {opts.size} was not warm within 900 s")


def _spread(values: list[float]) -> dict:
    return {"median": median(values), "p10": percentile(values, 0.1), "p90": percentile(values, 0.9)}


def measure(opts, address: str) -> dict:
    from engine.fleet.cluster import join
    from engine.fleet.config import FleetConfig
    from engine.serving.manager import EngineManager

    fleet = FleetConfig(address=address)
    join(fleet)
    options = EngineOptions(warm_sizes=(), max_batch=1)  # one request per call: no wait for a batch to fill
    managers = {"local": EngineManager(opts.cache_dir, options=options),
                "ray": EngineManager(opts.cache_dir, options=options, fleet=fleet)}
    try:
        ready_s = {}
        for name, manager in managers.items():
            started = time.perf_counter()
            manager.engine(manager.gate.make_key(opts.preset, opts.device, opts.precision)).wait_ready(600)
            ready_s[name] = time.perf_counter() - started  # a cold start: placement, process, imports, weights
            warm_bucket(manager, opts)
            for seed in range(3):  # warm: the bucket (compiled if the mode is), the code paths, the allocator
                _timed(manager, opts, seed)
        samples: dict[str, dict[str, list[float]]] = {name: {"client": [], "outside": []} for name in managers}
        for i in range(opts.rounds):
            order = ("local", "ray") if i % 2 == 0 else ("ray", "local")
            for name in order:
                client_ms, engine_ms = _timed(managers[name], opts, i)
                samples[name]["client"].append(client_ms)
                samples[name]["outside"].append(client_ms - engine_ms)
        node = next(r.get("node") for r in managers["ray"].residency.status_rows() if r.get("kind") == "ray")
    finally:
        for manager in managers.values():
            manager.shutdown()
    result = {name: {kind: _spread(values) for kind, values in row.items()} for name, row in samples.items()}
    overhead = result["ray"]["client"]["median"] - result["local"]["client"]["median"]
    outside = result["ray"]["outside"]["median"] - result["local"]["outside"]["median"]
    return {"bucket": f"{opts.mode}:{opts.size}", "steps": opts.steps, "rounds": opts.rounds, "node": node,
            **result, "overhead_ms": overhead, "outside_overhead_ms": outside, "target_ms": TARGET_MS,
            "met": overhead <= TARGET_MS, "ready_s": ready_s, "load_avg": list(os.getloadavg())}


def report(r: dict) -> str:
    lines = [f"fleet overhead at {r['bucket']}, {r['steps']} steps, {r['rounds']} requests each "
             f"(Ray engine on node {r['node']}); ms, median [p10-p90]:",
             f"{'':28}{'local worker':>26}{'Ray actor':>26}"]
    for kind, label in (("client", "submit to result"), ("outside", "outside the engine's run")):
        cells = [f"{r[n][kind]['median']:8.1f} [{r[n][kind]['p10']:6.1f}-{r[n][kind]['p90']:6.1f}]"
                 for n in ("local", "ray")]
        lines.append(f"{label:28}{cells[0]:>26}{cells[1]:>26}")
    lines.append(f"{'cold start to ready (s)':28}{r['ready_s']['local']:>26.1f}{r['ready_s']['ray']:>26.1f}")
    lines.append(f"Ray minus local, medians: {r['overhead_ms']:+.1f} ms submit to result, "
                 f"{r['outside_overhead_ms']:+.1f} ms outside the engine (target <= +{r['target_ms']:g} ms: "
                 f"{'met' if r['met'] else 'NOT met'}); load average {r['load_avg'][0]:.2f}")
    return "\n".join(lines)


def cmd_fleet_bench(args) -> int:
    opts = from_args(FleetBenchOptions, args)
    if opts.ray:
        result = measure(opts, opts.ray)
    else:
        with local_cluster() as address:
            result = measure(opts, address)
    print(json.dumps(result) if opts.json else report(result))
    return 0
