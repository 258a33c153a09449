"""`python -m bench fairness`: what one visitor's costliest requests do to another visitor's wait.

Runs a public-mode EngineManager in this process (the cost budgets of engine/serving/cost.py, visitors
told apart by their client address as the web app does) on one preset and device, eager, and measures:

- idle: visitor B's small Generate (--small-steps at the smallest bucket) and the costliest Generate a
  visitor may ask for (the most steps the per-request budget allows at the largest bucket, at most
  --max-steps), each alone;
- eight costliest Generates from visitor A at once (steps varied by one so they cannot share a call),
  then B's costliest Generate and B's small one: their latency against idle. With the visitor budget
  (A's requests beyond it are refused at once), without it (all eight queued: the engine's turns
  between clients alone), and without it with B sending as A (first come first served, as before);
- the costliest Compare a visitor may ask for (configurations × the prompts the Compare tab sends, all
  eager on the same engine so no compile enters the figure) run as ui/compare.py runs it, one admission
  and one image at a time, while B sends small Generates one after another: B's latency against one
  configuration's run;
- --flood-callers visitors each keeping one request at the engine (more than its max_queue places: they
  used to fill it and refuse everyone else), and a fresh visitor's small Generates among them: the tries
  each took (served on the first, now that a request past the places waits its turn) and its wait.

Figures go in docs/hosting.md; timings depend on the load of the machine (printed with them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench import flags
from engine import settings
from engine.config.flags import from_args
from engine.config.request import ImageRequest
from engine.errors import ShowcaseError
from engine.metrics import median
from engine.protocol import EngineOptions, Size
from engine.serving import cost
from engine.serving.cost import CostBudget

A, B = "10.0.0.1", "10.0.0.2"  # two visitors' addresses


class Bench:
    def __init__(self, opts: FairnessOptions):
        from engine.serving.manager import EngineManager, HostPolicy  # torch: not for `--help`

        self.opts = opts
        request = cost.parse_cost(opts.max_request_cost, "--max-request-cost")
        visitor = cost.parse_cost(opts.max_visitor_cost, "--max-visitor-cost")
        self.budget = CostBudget(request=request, visitor=visitor)
        self.manager = EngineManager(
            cache_dir=opts.cache_dir or settings.cache_dir(), options=EngineOptions(warm_sizes=(), max_batch=1),
            policy=HostPolicy(public=True, presets=(opts.preset,), cost=self.budget))
        self.preset = self.manager.catalog.preset(opts.preset)
        buckets = sorted(self.preset.buckets, key=lambda s: s.pixels)
        self.small_size, self.big_size = buckets[0], buckets[-1]
        allowed = cost.max_steps(request, self.preset, self.big_size) if request else opts.max_steps
        self.big_steps = max(1, min(opts.max_steps, allowed))

    def generate(self, client: str, size: Size, steps: int, seed: int = 0, **extra) -> float:
        """One visitor Generate; its latency in seconds (wall, as the visitor waits)."""
        from engine.serving.manager import Caller

        start = time.perf_counter()
        self.manager.generate(ImageRequest(preset=self.preset.name, device=self.opts.device, size=str(size),
                                           steps=steps, prompt=self.preset.example_prompt, seed=seed,
                                           caller=Caller.VISITOR, client=client), **extra)
        return time.perf_counter() - start

    def small(self, client: str = B, seed: int = 0) -> float:
        return self.generate(client, self.small_size, self.opts.small_steps, seed)

    def big(self, client: str, steps: int | None = None, seed: int = 0) -> float:
        return self.generate(client, self.big_size, steps or self.big_steps, seed)

    def idle(self) -> dict:
        self.small(seed=99)
        self.big(B, seed=99)  # loaded, and each size run once
        return {"small_s": median([self.small(seed=i) for i in range(self.opts.rounds)]),
                "big_s": median([self.big(B, seed=i) for i in range(max(1, self.opts.rounds // 2))])}

    def eight_costliest(self, idle: dict, visitor_budget: bool, b_client: str = B) -> dict:
        """A sends eight costliest Generates at once; B then sends a costliest one, then a small one. With
        `b_client` = A, B's requests queue behind A's as anyone's did before engines took turns."""
        from engine.serving.manager import HostPolicy

        saved = self.manager.policy
        if not visitor_budget:
            self.manager.policy = HostPolicy(public=True, presets=saved.presets,
                                             cost=CostBudget(request=self.budget.request, visitor=None))
        refused, running = [], threading.Event()
        started = []

        def a_request(i: int) -> None:
            try:
                self.generate(A, self.big_size, self.big_steps - i, seed=i,
                              on_progress=lambda p: running.set())
            except ShowcaseError as exc:
                refused.append(type(exc).__name__)

        threads = [threading.Thread(target=a_request, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
            started.append(time.perf_counter())
        try:
            running.wait(120)
            time.sleep(0.05)  # A's others reach the engine's queue
            b_big = self.big(b_client, seed=7)
            b_small = self.small(b_client, seed=7)
        finally:
            for t in threads:
                t.join(600)
            self.manager.policy = saved
        return {"visitor_budget": visitor_budget, "turns": b_client != A, "a_refused": len(refused), "a_admitted": 8 - len(refused),
                "b_big_s": b_big, "b_big_x_idle": b_big / idle["big_s"],
                "b_small_s": b_small, "b_small_x_idle": b_small / idle["small_s"]}

    def costliest_compare(self, idle: dict) -> dict:
        """The costliest Compare at the smallest bucket, run as ui/compare.py runs it, while B keeps sending
        small Generates."""
        from engine.serving.manager import Caller

        prompts = 1 + (8 if self.preset.fidelity else 0)  # the Compare tab's default fidelity prompts
        per_image = cost.price(self.preset, self.small_size, self.opts.small_steps)
        if self.budget.request is not None:  # the most images the budget allows: prompts first, then configurations
            prompts = max(1, min(prompts, self.budget.request // per_image))
        configs = 6 if self.budget.request is None else max(1, min(6, self.budget.request // (per_image * prompts)))
        price = self.manager.price_compare(self.preset.name, self.small_size, self.opts.small_steps, configs,
                                           prompts, caller=Caller.VISITOR)
        config_s: list[float] = []
        done = threading.Event()

        def compare() -> None:
            try:
                with self.manager.admission(A, price, Caller.VISITOR) as ticket:
                    for c in range(configs):
                        start = time.perf_counter()
                        for p in range(prompts):
                            self.generate(A, self.small_size, self.opts.small_steps, seed=1000 * c + p, ticket=ticket)
                        config_s.append(time.perf_counter() - start)
            finally:
                done.set()

        thread = threading.Thread(target=compare)
        thread.start()
        waits = []
        while not done.is_set():
            waits.append(self.small(seed=len(waits)))
            time.sleep(0.05)
        thread.join()
        one_config = median(config_s)
        return {"configurations": configs, "prompts": prompts, "steps": self.opts.small_steps,
                "size": str(self.small_size), "price": price, "config_median_s": one_config,
                "b_small_n": len(waits), "b_small_median_s": median(waits), "b_small_max_s": max(waits),
                "b_small_max_wait_s": max(waits) - idle["small_s"],
                "max_wait_x_config": (max(waits) - idle["small_s"]) / one_config}

    def flooded(self, idle: dict) -> dict:
        """--flood-callers visitors each keep one request of --flood-steps at the smallest bucket at the engine
        (each within its bounds, more of them than the engine's places); a fresh visitor then sends small
        Generates: how many tries until one is served, and its wait against idle."""
        stop, refused, served = threading.Event(), [], []

        def flood(i: int) -> None:
            seed = 0
            while not stop.is_set():
                seed += 1
                try:
                    self.generate(f"10.1.0.{i}", self.small_size, self.opts.flood_steps, seed=seed)
                    served.append(i)
                except ShowcaseError:
                    refused.append(i)
                    time.sleep(0.2)

        threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(self.opts.flood_callers)]
        for t in threads:
            t.start()
        try:
            # Under way: every flooding visitor served once. Before that the floods' own first requests are as new
            # as the visitor's and fairly go first (in the first second of 20 floods: 2 s of 0.2 s runs).
            while len(set(served)) < self.opts.flood_callers:
                time.sleep(0.1)
            tries, waits, phase = [], [], random.Random(0)
            for round_ in range(self.opts.rounds):
                time.sleep(phase.uniform(0.0, 0.5))  # arrive at any point of a flood's run, not as the last one ends
                attempt = 0
                while True:
                    attempt += 1
                    try:
                        waits.append(self.small(f"10.2.0.{round_}", seed=100 + round_))  # a new visitor each
                        break
                    except ShowcaseError:
                        time.sleep(0.5)
                tries.append(attempt)
        finally:
            stop.set()
            for t in threads:
                t.join(600)
        wait, idle_after = median(waits), median([self.small(seed=200 + i) for i in range(self.opts.rounds)])
        # The target: served on the first or second try, waiting at most 3x idle plus one flood request's own run
        flood_run = median([self.generate(B, self.small_size, self.opts.flood_steps, seed=300 + i)
                            for i in range(self.opts.rounds)])
        bound = 3 * idle_after + flood_run
        return {"idle_after_s": idle_after, "fresh_x_idle_after": wait / idle_after, "callers": self.opts.flood_callers,
                "flood_steps": self.opts.flood_steps, "fresh_tries": tries, "flood_run_s": flood_run,
                "bound_s": bound, "within_bound": max(tries) <= 2 and max(waits) <= bound,
                "fresh_wait_median_s": wait, "fresh_wait_max_s": max(waits), "fresh_waits_s": waits, "fresh_x_idle": wait / idle["small_s"],
                "flood_served": len(served), "flood_refused": len(refused),
                "turns": self.manager.turns.snapshot()["shed"]}

    def run(self) -> dict:
        try:
            idle = self.idle()
            return {"preset": self.preset.name, "device": self.opts.device, "budget": self.budget.describe(),
                    "small": f"{self.opts.small_steps} steps at {self.small_size}",
                    "costliest": f"{self.big_steps} steps at {self.big_size}", "idle": idle,
                    "load_before": os.getloadavg()[0],
                    "eight_costliest": [self.eight_costliest(idle, True), self.eight_costliest(idle, False),
                                        self.eight_costliest(idle, False, b_client=A)],
                    "compare": self.costliest_compare(idle), "flooded": self.flooded(idle),
                    "load_after": os.getloadavg()[0]}
        finally:
            self.manager.shutdown()


def print_summary(s: dict) -> None:
    idle = s["idle"]
    print(f"fairness: {s['preset']} on {s['device']}, budgets {s['budget']}; load {s['load_before']:.2f} -> "
          f"{s['load_after']:.2f}")
    print(f"idle: small ({s['small']}) {idle['small_s']:.3f} s, costliest Generate ({s['costliest']}) "
          f"{idle['big_s']:.3f} s")
    for row in s["eight_costliest"]:
        print(f"eight costliest from A (visitor budget {'on' if row['visitor_budget'] else 'off'}"
              f"{'' if row['turns'] else ', B queued as A: first come first served'}: "
              f"{row['a_admitted']} admitted, {row['a_refused']} refused): B's costliest {row['b_big_s']:.3f} s "
              f"(x{row['b_big_x_idle']:.2f} idle), B's small {row['b_small_s']:.3f} s (x{row['b_small_x_idle']:.2f})")
    c = s["compare"]
    print(f"costliest Compare ({c['configurations']} configurations x {c['prompts']} prompts x {c['steps']} steps "
          f"at {c['size']}, {c['price']} token-steps): one configuration {c['config_median_s']:.3f} s; B's small "
          f"Generate during it ({c['b_small_n']}): median {c['b_small_median_s']:.3f} s, max {c['b_small_max_s']:.3f}"
          f" s, its longest wait {c['max_wait_x_config']:.2f} x one configuration")
    f = s["flooded"]
    print(f"{f['callers']} visitors each keeping a {f['flood_steps']}-step request at the engine "
          f"({f['flood_served']} served, {f['flood_refused']} refused, {f['turns']} shed from the line): a fresh "
          f"visitor's small Generate served on try {', '.join(map(str, f['fresh_tries']))}; its wait median "
          f"{f['fresh_wait_median_s']:.3f} s, max {f['fresh_wait_max_s']:.3f} s (x{f['fresh_x_idle']:.2f} idle; "
          f"x{f['fresh_x_idle_after']:.2f} the idle {f['idle_after_s']:.3f} s measured right after)")
    print(f"target: served on try 1 or 2, waiting <= 3 x idle + one {f['flood_steps']}-step request's run "
          f"({f['flood_run_s']:.3f} s) = {f['bound_s']:.3f} s: {'met' if f['within_bound'] else 'NOT met'} "
          f"(longest wait {f['fresh_wait_max_s']:.3f} s, tries {max(f['fresh_tries'])})")


@dataclass(frozen=True)
class FairnessOptions:
    """`fairness`'s flags."""

    preset: str = flags.preset(settings.DEFAULT_PRESET)
    device: str = flags.device("cpu")
    small_steps: int = flags.steps(8)
    max_steps: int = flags.steps(200, "the costliest Generate's steps at most")
    max_request_cost: str = flags.text(str(cost.DEFAULT_REQUEST_COST))
    max_visitor_cost: str = flags.text(str(cost.DEFAULT_VISITOR_COST))
    rounds: int = flags.count(5, "idle runs of the small request (half for the costliest); the fresh visitor's "
                                 "tries among the floods")
    flood_callers: int = flags.count(20, "visitors each keeping one request at the engine (more than its places)")
    flood_steps: int = flags.steps(32, "steps of each flooding visitor's request (at the smallest bucket)")
    cache_dir: Path | None = flags.cache_dir(check=Path)
    out: str | None = flags.out(None, "write the figures as JSON here")


def add_fairness_parser(sub) -> None:
    flags.add_command(sub, "fairness", FairnessOptions, cmd_fairness, description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      help="one visitor's costliest requests against another visitor's wait (cost budgets, turns)")


def cmd_fairness(args) -> int:
    opts = from_args(FairnessOptions, args)
    summary = Bench(opts).run()
    print_summary(summary)
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(summary, indent=1))
    return 0
