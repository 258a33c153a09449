"""`python -m bench load`: a burst of visitors at one bucket, batching off and on, in one run.

For each phase (`--max-batch 1`, then the engine's batching) it starts `app.py` with the default preset,
waits until the bucket and every batch size of it are warm (compiled in the background at start-up),
then lets N visitors (one page session each, speaking Gradio's queue protocol as the page does) submit at
once, `--rounds` times: each round starts when every visitor's previous request came back. Printed per
phase: throughput (images/s over the burst), p50/p95 of the visitors' round trips, the median pipeline
call (a batch's until its last image) and the median web share of a round trip (round trip minus the
app's handler: Gradio's queue, events and transfer), failures, graphs compiled during the burst, and the
batch sizes that served the requests; then the ratios on/off, and the throughput ratio the engine's calls
alone would give (call time per image, off / on: the bound before any web cost). The app gets SIGTERM
after each phase and every process it started must be gone within 10 s.

Exit 1 when a request failed, a graph compiled during the burst, or a process outlived its app.
"""

from __future__ import annotations

import argparse
import collections
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench import flags
from bench.app_process import AppProcess
from bench.soak import PageClient
from engine import settings
from engine.config.flags import from_args
from engine.metrics import median, percentile
from engine.protocol import GENERIC_PROMPT
from engine.protocol.options import MAX_BATCH, MAX_BATCH_WAIT_MS

REPO = settings.REPO_ROOT


class Phase:
    def __init__(self, opts: LoadOptions, name: str, max_batch: int | None):
        self.opts, self.name, self.max_batch = opts, name, max_batch
        self.app = AppProcess(self.app_args(), Path(opts.out) / f"app-{name}.log", f"load {name}")
        self.url = ""
        self.latencies: list[float] = []
        self.web_ms: list[float] = []  # round trip minus the app's handler: Gradio's queue, events, transfer
        self.calls: dict = {}  # each pipeline call that made images: (batch size, its time in ms)
        self.batch_sizes: collections.Counter = collections.Counter()
        self.failed: list[str] = []
        self.recompiles = 0
        self.wall_s = 0.0
        self.images = 0
        self.orphans: list[int] = []
        self.served: dict = {}
        from engine.config.presets import get_preset

        self.prompts = get_preset(opts.preset).examples or (GENERIC_PROMPT,)  # each visitor its own prompt

    def app_args(self) -> list[str]:
        opts = self.opts
        args = ["--device", opts.device, "--preset", opts.preset, "--warm", opts.size, "--mode", opts.mode,
                "--client-events", "0"]  # every visitor connects from this machine's address
        if self.max_batch is not None:
            args += ["--max-batch", str(self.max_batch)]
        if opts.batch_wait_ms is not None:
            args += ["--batch-wait-ms", str(opts.batch_wait_ms)]
        if opts.cache_dir:
            args += ["--cache-dir", str(opts.cache_dir)]
        return args + opts.app_arg

    def page(self) -> PageClient:
        from gradio_client import Client

        return self.app.connect(lambda: PageClient(Client(self.url, verbose=False), timeout=self.opts.timeout), 300)

    def params(self, visitor: int, round_: int) -> dict:
        prompts = self.prompts
        return dict(prompt=prompts[(visitor + round_) % len(prompts)], preset=self.opts.preset,
                    device=self.opts.device, precision="fp32", mode=self.opts.mode, size=self.opts.size,
                    steps=str(self.opts.steps), guidance="", seed=str(1000 * round_ + visitor), on_cold="eager",
                    tp="1")

    def wait_warm(self, page: PageClient) -> list[int]:
        """Until the bucket is warm at every batch size of the engine; returns those sizes."""
        deadline = time.monotonic() + self.opts.warm_timeout
        page.predict(self.params(0, 0))  # loads the engine
        while time.monotonic() < deadline:
            for engine in page.call("status")[0]:
                if not str(engine.get("engine", "")).startswith(f"{self.opts.preset}@"):
                    continue
                sizes = (engine.get("batching") or {}).get("batch_sizes") or [1]
                warm = {b.get("batch", 1) for b in engine.get("buckets", []) if b.get("mode") == self.opts.mode
                        and b.get("size") == self.opts.size and b.get("state") == "warm"}
                if self.opts.mode == "eager" or set(sizes) <= warm:
                    return sizes
            time.sleep(1.0)
        raise RuntimeError(f"{self.opts.mode}:{self.opts.size} was not warm at every batch size within "
                           f"{self.opts.warm_timeout}s")

    def burst(self) -> None:
        n = self.opts.visitors
        pages = [self.page() for _ in range(n)]
        barrier = threading.Barrier(n)
        lock = threading.Lock()

        def visitor(i: int, rounds: int, record: bool) -> None:
            for r in range(rounds):
                barrier.wait()
                start = time.perf_counter()
                try:
                    timings = pages[i].predict(self.params(i, r))
                except Exception as exc:  # noqa: BLE001 - counted, shown
                    if record:
                        with lock:
                            self.failed.append(f"visitor {i}: {exc}")
                    continue
                seconds = time.perf_counter() - start
                if record:
                    with lock:
                        self.latencies.append(seconds)
                        self.batch_sizes[int(timings.get("batch_size", 1))] += 1
                        self.recompiles += int(timings.get("recompiles") or 0)
                        if timings.get("handler_ms") is not None:
                            self.web_ms.append(seconds * 1000 - float(timings["handler_ms"]))
                        self.record_call(timings)

        for record, rounds in ((False, 1), (True, self.opts.rounds)):  # one round to settle, then measured
            threads = [threading.Thread(target=visitor, args=(i, rounds, record), daemon=True) for i in range(n)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if record:
                self.wall_s = time.perf_counter() - start
        self.images = len(self.latencies)

    def record_call(self, result: dict) -> None:
        """The pipeline call that made this result: a batch's members share its clock (the same encode and
        step times) and each one's total ends when its own image was decoded, so a call's time is the
        latest of its members' totals."""
        timings = result.get("timings") or {}
        if timings.get("total_ms") is None:
            return
        size = int(result.get("batch_size", 1))
        call = (timings.get("encode_ms"), tuple(timings.get("step_ms") or ())) if size > 1 else len(self.calls)
        self.calls[call] = (size, max(self.calls.get(call, (size, 0.0))[1], float(timings["total_ms"])))

    def read_status(self, page: PageClient) -> None:
        for engine in page.call("status")[0]:
            if str(engine.get("engine", "")).startswith(f"{self.opts.preset}@"):
                self.served = (engine.get("batching") or {}).get("served", {})

    def stop(self) -> None:
        self.orphans = self.app.stop().orphans

    def run(self) -> None:
        self.app.start()
        self.url = self.app.url
        try:
            page = self.page()
            sizes = self.wait_warm(page)
            print(f"[load] {self.name}: warm at batch sizes {sizes}; {self.opts.visitors} visitors x "
                  f"{self.opts.rounds} rounds", flush=True)
            self.burst()
            self.read_status(page)
        finally:
            self.stop()

    def summary(self) -> dict:
        return {
            "phase": self.name, "images": self.images, "wall_s": round(self.wall_s, 3),
            "images_per_s": round(self.images / self.wall_s, 2) if self.wall_s else None,
            "p50_s": _round(median(self.latencies)),
            "p95_s": _round(percentile(self.latencies, 0.95)),
            "web_p50_ms": _round(median(self.web_ms)),
            "call_p50_ms": _round(median([total for _, total in self.calls.values()])),
            # what the engine alone spends on one image
            "call_per_image_p50_ms": _round(median([total / size for size, total in self.calls.values()])),
            "calls": len(self.calls),
            "failed": len(self.failed), "recompiles": self.recompiles,
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "calls_per_batch_size": self.served, "orphans": self.orphans,
            "failures": self.failed[:5],
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def print_summary(rows: list[dict], ratios: dict) -> None:
    print(f"\n{'phase':<14}{'images/s':>10}{'p50 s':>9}{'p95 s':>9}{'call ms':>9}{'web ms':>8}{'failed':>8}"
          f"{'recompiles':>12}  batch sizes (requests)  calls per size")
    for r in rows:
        print(f"{r['phase']:<14}{r['images_per_s'] or 0:>10.2f}{r['p50_s'] or 0:>9.3f}{r['p95_s'] or 0:>9.3f}"
              f"{r['call_p50_ms'] or 0:>9.1f}{r['web_p50_ms'] or 0:>8.1f}{r['failed']:>8}{r['recompiles']:>12}  {json.dumps(r['batch_sizes'])}  "
              f"{json.dumps({k: v.get('calls') for k, v in r['calls_per_batch_size'].items()})}")
        for failure in r["failures"]:
            print(f"    failed: {failure}")
        if r["orphans"]:
            print(f"    processes left after SIGTERM: {r['orphans']}")
    if ratios:
        print(f"\nbatching on / off: images/s x{ratios['throughput']:.2f} (target >= 1.6), "
              f"p95 x{ratios['p95']:.2f} (target <= 0.8), p50 x{ratios['p50']:.2f}")
        if ratios.get("engine"):
            print(f"the engine's calls alone (call time per image, off / on): x{ratios['engine']:.2f}; the rest is "
                  "the web round trip, which a batched burst runs at its start and end")


@dataclass(frozen=True)
class LoadOptions:
    """`load`'s flags."""

    visitors: int = flags.count(8)
    rounds: int = flags.count(10, "measured bursts (after one to settle)")
    preset: str = flags.preset(settings.DEFAULT_PRESET)
    device: str = flags.device("cpu")
    mode: str = flags.mode("compile")
    size: str = flags.size("64x64")
    steps: int = flags.steps(8)
    max_batch: int | None = flags.count(None, "the batching phase's --max-batch (default: the device's)",
                                        high=MAX_BATCH)
    batch_wait_ms: float | None = flags.number(None, 0.0, MAX_BATCH_WAIT_MS)
    phases: str = flags.text("off,on", "off (--max-batch 1), on, in this order (repeat to alternate)")
    warm_timeout: float = flags.seconds(900)
    timeout: float = flags.seconds(300, "seconds a request may take")
    cache_dir: Path | None = flags.cache_dir(check=Path)
    out: str = flags.out("artifacts/load", "app logs and summary.json")
    app_arg: list[str] = flags.app_args()


def add_load_parser(sub) -> None:
    flags.add_command(sub, "load", LoadOptions, cmd_load, description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      help="a burst of visitors at one bucket against a real app, batching off and on")


def cmd_load(args) -> int:
    opts = from_args(LoadOptions, args)
    rows = []
    for name in [p for p in opts.phases.split(",") if p]:
        phase = Phase(opts, name, 1 if name == "off" else opts.max_batch)
        phase.run()
        rows.append(phase.summary())
    by = {}
    for r in rows:
        by.setdefault(r["phase"], []).append(r)
    ratios = {}
    if by.get("on") and by.get("off"):
        def med(phase, key):
            return median([r[key] for r in by[phase] if r[key]])

        ratios = {"throughput": med("on", "images_per_s") / med("off", "images_per_s"),
                  "p95": med("on", "p95_s") / med("off", "p95_s"), "p50": med("on", "p50_s") / med("off", "p50_s")}
        if med("on", "call_per_image_p50_ms") and med("off", "call_per_image_p50_ms"):  # the engine's calls alone
            ratios["engine"] = med("off", "call_per_image_p50_ms") / med("on", "call_per_image_p50_ms")
    print_summary(rows, ratios)
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    (Path(opts.out) / "summary.json").write_text(json.dumps({"phases": rows, "ratios": ratios}, indent=1))
    bad = any(r["failed"] or r["recompiles"] or r["orphans"] for r in rows)
    return 1 if bad else 0
