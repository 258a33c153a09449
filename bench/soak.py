"""`python -m bench soak`: many simulated visitors against a real app process, measured.

It starts `app.py` (its own process group) with the host's flags, waits for the default engine's
first bucket to be warm, measures that bucket's idle latency, then lets N visitors loose for a given
time through the public API only (gradio_client, one session each). Each visitor picks preset ×
precision × mode × size at random from what the host offers, sometimes cancels, sometimes sends bad
input. A probe visitor keeps asking for the warm bucket, so its latency while other buckets compile
is measured against its idle median. Meanwhile the resident memory of the app and all its children
is sampled. At the end the app gets SIGTERM and every process it ever had must be gone.

Printed: requests answered ok / with a clear error / failed or hung, peak RSS against the budget,
engines loaded and evicted, compiles run, p50/p95 of warm-bucket requests vs idle, orphans. Exit 1
when a request failed or hung or a process was orphaned.

The visitors talk HTTP through gradio_client (the client library, not gradio itself).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import flags
from bench.app_process import AppProcess
from engine import settings
from engine.config.flags import from_args
from engine.config.validation import MAX_SEED
from engine.metrics import median, percentile
from engine.processes import process_tree, resident_bytes
from engine.protocol import params
from engine.serving.budget import GIB, parse_size
from engine.worker.priority import lower_this_thread_priority

log = logging.getLogger(__name__)

REPO = settings.REPO_ROOT
# Bad input a visitor can send on any host, and words the answer names on a host without --public (the
# reliability test checks them; the soak sends them at random and checks only that the answer is clear).
# Input whose verdict depends on the host (its devices, its model folders, the Hub) stays in that test.
BAD_INPUTS: tuple[tuple[dict, str], ...] = (
    *(({f.name: "x" * (params.MAX_PROMPT_CHARS + 1000)}, "shorten") for f in params.FREE_TEXT),
    ({"prompt": "nul\x00byte"}, "NUL"),
    ({"size": "0x0"}, "outside"),
    ({"size": "-64x64"}, "outside"),
    ({"size": "abc"}, "WIDTHxHEIGHT"),
    ({"size": "64x"}, "WIDTHxHEIGHT"),
    ({"size": "99999x99999"}, "outside"),
    ({"size": "64.5x64"}, "WIDTHxHEIGHT"),
    ({"steps": 0}, "steps"),
    ({"steps": -3}, "steps"),
    ({"steps": 100000}, "steps"),
    ({"steps": 2.5}, "steps"),
    ({"steps": "ten"}, "steps"),
    ({"guidance": -1}, "guidance"),
    ({"guidance": 1e9}, "guidance"),
    ({"guidance": "inf"}, "finite"),
    ({"guidance": "nan"}, "finite"),
    ({"guidance": "lots"}, "guidance"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "abc"}, "seed"),
    ({"preset": "nope"}, "unknown preset"),
    ({"preset": ""}, "preset"),
    ({"preset": "../../etc"}, "outside the allowed model roots"),
    ({"preset": "/definitely/not/a/model"}, "outside the allowed model roots"),
    ({"device": "nope"}, "unknown device"),
    ({"precision": "fp4"}, "unknown precision"),
    ({"precision": ""}, "precision"),
    ({"mode": "turbo"}, "unknown mode"),
    ({"mode": "defer-and-fuse"}, "defer-and-fuse"),
    ({"preset": "tiny-sd3", "tp": 2}, "no tensor-parallel plan"),
    ({"tp": -1}, "tp must be"),
    ({"on_cold": "later"}, "on_cold"),
)
GENERIC_ERRORS = {"", "error", "none", "internal server error"}


class ClientRaceTwice(Exception):
    """A call lost gradio_client's event-stream race twice: counted as a failure."""


@dataclass
class Outcome:
    kind: str  # ok | clear | failed | hung | cancelled
    seconds: float
    detail: str = ""
    warm: bool | None = None
    config: str = ""
    probe: bool = False
    compiling: bool = False  # a compile was running on the host when it started
    engine_compiling: bool = False  # ... in the probe's own engine (its worker process)
    engine_s: float | None = None  # in the engine: its queue + its run (queued_ms + total_ms), no web
    handler_s: float | None = None  # in the app's handler: dispatch + engine (the rest is the web side)
    queued_s: float | None = None  # of engine_s, waiting in the engine's queue (behind another request)
    client_race: bool = False  # gradio_client lost the first try to its event-stream race; sent again


@dataclass
class SoakReport:
    outcomes: list[Outcome] = field(default_factory=list)
    idle_s: list[float] = field(default_factory=list)
    idle_handler_s: list[float] = field(default_factory=list)
    peak_rss: int = 0
    rss_samples: int = 0
    pids_seen: set[int] = field(default_factory=set)
    orphans: list[int] = field(default_factory=list)
    exit_s: float | None = None
    exited: bool | None = None  # the app ended on SIGTERM within the time it is given
    status: dict = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        kinds = ("ok", "cancelled", "clear", "failed", "hung")
        return {k: sum(1 for o in self.outcomes if o.kind == k) for k in kinds}


class PageClient:
    """What the page's JavaScript does for one call, and nothing more: the probe's client, and the soak's
    own /status reads.

    gradio_client waits on a job with 50 ms sleeps in two threads per request and handles every stream
    message in Python; on a 2-core host that also runs the app and four visitors, that client work is
    starved along with the app and its delays land in the measured round trip (and, for the soak's own
    reads, its CPU is taken from the app it measures). This client speaks the queue protocol directly:
    POST queue/join, read the session's event stream until the call completes, then fetch the image as a
    browser does. (--probe-client gradio_client measures with gradio_client instead.)"""

    def __init__(self, client, timeout: float):
        import uuid

        import httpx

        self.base = client.src_prefixed  # ".../gradio_api/"
        dependencies = client.config["dependencies"]
        self.fn_index = {d.get("api_name"): d.get("id", i) for i, d in enumerate(dependencies) if d.get("api_name")}
        info = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
        self.names = {api.lstrip("/"): [p["parameter_name"] for p in e["parameters"]] for api, e in info.items()}
        # What gradio_client sends for a parameter a call leaves out: the endpoint's own default.
        self.defaults = {api.lstrip("/"): {p["parameter_name"]: p["parameter_default"] for p in e["parameters"]
                                           if p.get("parameter_has_default")} for api, e in info.items()}
        self.http = httpx.Client(timeout=timeout)
        # One session for the page's life, as the page's client makes it: the server builds a session's
        # state (a config per block, costly for a UI this size) once, not per request.
        self.session = uuid.uuid4().hex[:11]

    def call(self, api_name: str, params: dict | None = None) -> list:
        """The output data of one call (raises RuntimeError with the server's message on an error)."""
        params = params or {}
        session = self.session
        params = {**self.defaults[api_name], **params}
        payload = {"data": [params[name] for name in self.names[api_name]], "fn_index": self.fn_index[api_name],
                   "session_hash": session, "event_data": None, "trigger_id": None}
        joined = self.http.post(self.base + "queue/join", json=payload)
        joined.raise_for_status()
        event_id = joined.json()["event_id"]
        with self.http.stream("GET", self.base + "queue/data", params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data:"):
                    continue
                message = json.loads(line[5:])
                if message.get("event_id") != event_id or message.get("msg") != "process_completed":
                    continue
                output = message.get("output") or {}
                if not message.get("success"):
                    raise RuntimeError(output.get("error") or "error")
                return output["data"]
        raise RuntimeError("the event stream ended before the call completed")

    def predict(self, params: dict) -> dict:
        """The timings dict of one /generate, its image fetched as the page does."""
        image, timings = self.call("generate", params)[:2]
        if isinstance(image, dict) and image.get("url"):
            self.http.get(image["url"]).raise_for_status()
        return timings


def _settle_event_stream(client, timeout: float = 2.0) -> None:
    """Wait (briefly) until gradio_client has read the server's close of the session's event stream.

    gradio_client keeps one event stream per session; the server closes it right after the session's last
    event completes. A request submitted before the client's reader thread has read that close is attached
    to the closing stream and ends in a bare CancelledError although the server runs it (seen once in 558
    soak requests: the visitors are niced, so their reader threads run late on a loaded machine). A browser
    does not share that client, so the soak waits for the close instead of counting the client's race as a
    server failure."""
    deadline = time.monotonic() + timeout
    while getattr(client, "stream_open", False) and time.monotonic() < deadline:
        time.sleep(0.005)


class Soak:
    def __init__(self, opts: SoakOptions):
        self.opts = opts
        self.report = SoakReport()
        self.stop = threading.Event()
        self.app = AppProcess(self.app_args(opts), Path(opts.out or "artifacts/soak") / "app.log", "soak")
        self.url = ""
        import multiprocessing as mp

        # The app reports a compile running: shared with the client processes.
        self.compiling_shared = mp.get_context("spawn").Event()
        self.compiling = self.compiling_shared
        self.engine_compiling = mp.get_context("spawn").Event()  # in the probe's engine
        self.presets = [p for p in opts.presets.split(",") if p] if opts.presets else [settings.DEFAULT_PRESET]
        self.precisions = opts.precisions.split(",")
        self.modes = opts.modes.split(",")
        self.rng = random.Random(opts.seed)

    # -- the app -----------------------------------------------------------------------------------
    @staticmethod
    def app_args(opts: SoakOptions) -> list[str]:
        presets = [p for p in opts.presets.split(",") if p] if opts.presets else [settings.DEFAULT_PRESET]
        args = ["--device", opts.device, "--preset", presets[0], "--warm", opts.warm, "--mode", opts.probe_mode,
                "--memory-budget", opts.memory_budget, "--compile-jobs", str(opts.compile_jobs)]
        if opts.public:
            args += ["--public", "--presets", ",".join(presets), "--precisions", opts.precisions,
                     "--modes", opts.modes]
            # Every simulated visitor connects from this machine's address: the per-address bound would
            # count them as one client (they stand in for browsers on other machines).
            args += ["--client-events", "0"]
        if opts.cache_dir:
            args += ["--cache-dir", str(opts.cache_dir)]
        return args + opts.app_arg

    def client(self):
        from gradio_client import Client

        return self.app.connect(lambda: Client(self.url, verbose=False), 180)

    # -- sampling ----------------------------------------------------------------------------------
    def sample_memory(self) -> None:
        lower_this_thread_priority(10)  # the harness must not take the cores from what it measures
        pids, listed = [self.app.pid], 0.0
        while not self.stop.is_set():
            if time.monotonic() - listed > 2.0:  # the tree changes slowly: list it every 2 s
                pids, listed = process_tree(self.app.pid), time.monotonic()
                if not pids:
                    return
            total = 0
            for pid in pids:
                rss = resident_bytes(pid)
                if rss is not None:
                    total += rss
                    self.report.pids_seen.add(pid)
            self.report.peak_rss = max(self.report.peak_rss, total)
            self.report.rss_samples += 1
            time.sleep(0.25)

    def watch_compiles(self, page: PageClient) -> None:
        """Is a bucket compiling anywhere? From /status (cheap: states the workers pushed), read as a page
        reads it (gradio_client's polling threads cost the soak's process 12 % of a core)."""
        lower_this_thread_priority(10)
        while not self.stop.is_set():
            try:
                engines = page.call("status")[0]
                running = [e.get("engine", "") for e in engines
                           if any(b.get("state") == "compiling" for b in e.get("buckets", []))]
                self.compiling.set() if running else self.compiling.clear()
                own = any(e.startswith(f"{self.presets[0]}@") and e.endswith(f"/{self.precisions[0]}") for e in running)
                self.engine_compiling.set() if own else self.engine_compiling.clear()
            except Exception:
                pass
            time.sleep(0.5)

    # -- requests ----------------------------------------------------------------------------------
    def request(self, client, params: dict, *, probe: bool = False, cancel_after: float | None = None,
                browser: PageClient | None = None) -> Outcome:
        config = f"{params['preset']}/{params['precision']}/{params['mode']}/{params['size']}"
        compiling = self.compiling.is_set()
        _settle_event_stream(client)
        start = time.monotonic()
        try:
            if browser is not None:
                timings = browser.predict(params)
                return self._answered(timings, start, config, probe, compiling)
            if cancel_after is None:
                (_, timings), race = self._result(client, lambda: client.submit(**params, api_name="/generate"))
                outcome = self._answered(timings, start, config, probe, compiling)
                outcome.client_race = race
                return outcome
            job = client.submit(**params, api_name="/generate")
            time.sleep(cancel_after)
            # The app's /cancel: synchronous and scoped to this visitor's session (gradio_client's
            # job.cancel() posts its cancel later, from a thread, where it can meet the next request).
            _, race = self._result(client, lambda: client.submit(api_name="/cancel"))
            try:
                job.result(timeout=self.opts.hang_s)
            except Exception:
                pass
            return Outcome("cancelled", time.monotonic() - start, config=config, client_race=race)
        except TimeoutError as exc:
            return Outcome("hung", time.monotonic() - start, f"no answer in {self.opts.hang_s}s: {exc}", config=config)
        except Exception as exc:
            text = str(exc).strip()
            failed = isinstance(exc, ClientRaceTwice) or text.lower() in GENERIC_ERRORS or "Traceback" in text
            kind = "failed" if failed else "clear"
            if "timed out" in text.lower() or "timeout" in type(exc).__name__.lower():
                kind = "hung"
            return Outcome(kind, time.monotonic() - start, f"{type(exc).__name__}: {text[:300]}", config=config,
                           probe=probe)

    def _result(self, client, submit):
        """(the job's result, whether it was sent twice). A bare CancelledError nobody asked for means
        gradio_client attached the job to the session's event stream as the server closed that stream (see
        _settle_event_stream; about 1 in 800 calls on a loaded 2-core box, right after another answer): sent
        again once, and counted apart, not hidden. A second one counts as a failure."""
        try:
            return submit().result(timeout=self.opts.hang_s), False
        except concurrent.futures.CancelledError:
            _settle_event_stream(client, timeout=10.0)
            try:
                return submit().result(timeout=self.opts.hang_s), True
            except concurrent.futures.CancelledError as exc:
                raise ClientRaceTwice("CancelledError on the second try too (gradio_client's stream race?)") from exc

    @staticmethod
    def _answered(timings: dict, start: float, config: str, probe: bool, compiling: bool) -> Outcome:
        t = timings.get("timings") or {}
        engine_ms = (t.get("total_ms") or 0) + (t.get("queued_ms") or 0) or None
        handler_ms = timings.get("handler_ms")
        return Outcome("ok", time.monotonic() - start, warm=bool(timings.get("warm")), config=config,
                       probe=probe, compiling=compiling, engine_s=engine_ms / 1000 if engine_ms else None,
                       handler_s=handler_ms / 1000 if handler_ms else None,
                       queued_s=(t.get("queued_ms") or 0) / 1000)

    def browser_probe(self, client) -> PageClient | None:
        return PageClient(client, self.opts.hang_s) if self.opts.probe_client == "browser" else None

    def random_params(self) -> tuple[dict, str]:
        params = dict(prompt="a red circle on a blue background",
                      preset=self.rng.choice(self.presets), device=self.opts.device,
                      precision=self.rng.choice(self.precisions), mode=self.rng.choice(self.modes),
                      size=self.rng.choice(self.opts.sizes.split(",")), steps=str(self.rng.randint(2, 4)),
                      guidance="", seed=str(self.rng.randint(0, 1000)), on_cold="eager", tp="1")
        expect = ""
        if self.rng.random() < self.opts.bad_rate:
            bad, expect = self.rng.choice(BAD_INPUTS)
            params.update(bad)
        return params, expect

    def visitor(self, index: int, deadline: float, out) -> None:
        client = self.client()
        rng = random.Random(self.opts.seed + index)
        self.rng = random.Random(self.opts.seed * 1000 + index)
        previous = None
        sent = 0
        # The first request always goes out: a visitor process (niced, importing its client) can take longer than
        # a short run's duration to start on a loaded machine, and a run whose visitors sent nothing measures nothing.
        while not sent or time.time() < deadline:
            sent += 1
            params, _ = self.random_params()
            cancel_after = rng.uniform(0.05, 0.5) if rng.random() < self.opts.cancel_rate else None
            outcome = self.request(client, params, cancel_after=cancel_after)
            if outcome.kind == "failed" and previous is not None:  # what came just before, to explain it
                outcome.detail += f" [visitor {index}'s previous request: {previous.kind}, {previous.config}]"
            out.put(outcome)
            previous = outcome
            time.sleep(rng.uniform(0.0, self.opts.think_s))

    def probe_params(self) -> dict:
        return dict(prompt="a red circle on a blue background", preset=self.presets[0],
                    device=self.opts.device, precision=self.precisions[0], mode=self.opts.probe_mode,
                    size=self.opts.sizes.split(",")[0], steps="2", guidance="", seed="1", on_cold="eager", tp="1")

    def probe(self, deadline: float, out) -> None:
        client = self.client()
        browser = self.browser_probe(client)
        while time.time() < deadline:
            own_engine_compiling = self.engine_compiling.is_set()
            outcome = self.request(client, self.probe_params(), probe=True, browser=browser)
            outcome.engine_compiling = own_engine_compiling
            out.put(outcome)
            time.sleep(self.opts.probe_interval)

    def wait_warm_probe(self, client) -> None:
        """Until the probe's bucket is warm (the default engine compiles it at start-up)."""
        deadline = time.monotonic() + self.opts.warm_timeout
        while time.monotonic() < deadline:
            _, timings = client.predict(**self.probe_params(), api_name="/generate")
            if timings.get("warm"):
                return
            time.sleep(1.0)
        raise RuntimeError(f"the probe bucket was not warm within {self.opts.warm_timeout}s")

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> SoakReport:
        self.app.start()
        self.url = self.app.url
        sampler = threading.Thread(target=self.sample_memory, daemon=True)
        sampler.start()
        try:
            client = self.client()
            self.wait_warm_probe(client)
            browser = self.browser_probe(client)  # idle runs measure with the probe's own client
            for _ in range(self.opts.idle_runs):
                start = time.monotonic()
                if browser is not None:
                    timings = browser.predict(self.probe_params())
                else:
                    _, timings = client.predict(**self.probe_params(), api_name="/generate")
                self.report.idle_s.append(time.monotonic() - start)
                if timings.get("handler_ms"):
                    self.report.idle_handler_s.append(timings["handler_ms"] / 1000)
            threading.Thread(target=self.watch_compiles, args=(PageClient(client, 30.0),), daemon=True).start()
            self.run_clients()
            try:
                self.report.status = {"engines": client.predict(api_name="/status"),
                                      "system": client.predict(api_name="/system")}
            except Exception as exc:
                self.report.status = {"error": str(exc)}
        finally:
            self.stop.set()
            self.shutdown_app()
        return self.report

    def run_clients(self) -> None:
        """Every visitor, and the probe, in a process of its own (as separate browsers are): in one
        process their client threads would queue for one interpreter lock and the probe would measure
        that, not the server."""
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        deadline = time.time() + self.opts.duration
        roles = [("visitor", i) for i in range(self.opts.visitors)] + [("probe", 0)]
        procs = [ctx.Process(target=_client_main, args=(role, i, self.url, self.opts, deadline,
                                                         (self.compiling_shared, self.engine_compiling), out), daemon=True) for role, i in roles]
        for p in procs:
            p.start()
        finished = 0
        hard_stop = deadline + self.opts.hang_s + 60
        while finished < len(procs) and time.time() < hard_stop:
            try:
                item = out.get(timeout=1.0)
            except Exception:
                finished = sum(1 for p in procs if not p.is_alive())
                continue
            if item is None:
                finished += 1
            else:
                self.report.outcomes.append(item)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()

    def shutdown_app(self) -> None:
        """SIGTERM the app and record how it went (every pid the sampler saw counts)."""
        stopped = self.app.stop(set(self.report.pids_seen))
        self.report.exit_s, self.report.exited = stopped.exit_s, stopped.exited
        self.report.orphans += stopped.orphans


def lower_visitor_priority(niceness: int) -> None:
    """Nice this visitor process, in a way Linux's autogroup scheduling honours: where autogroup is on, the
    CPU is shared between sessions first and niceness counts only inside a session, so the visitor moves
    to a session of its own and lowers that session's weight (/proc/self/autogroup; raising it needs no
    privilege)."""
    os.nice(niceness)
    try:
        os.setsid()
        Path("/proc/self/autogroup").write_text(str(niceness))
    except OSError:
        pass  # not Linux, or no autogroup: the process niceness above is what counts


def _client_main(role: str, index: int, url: str, opts: SoakOptions, deadline: float, compiling, out) -> None:
    """One visitor (or the probe) in its own process: requests until `deadline` (wall clock), each
    outcome put on `out`, then None."""
    soak = Soak(opts)
    soak.url, (soak.compiling, soak.engine_compiling) = url, compiling
    if role != "probe" and opts.visitor_niceness:
        # Visitors stand in for browsers on other machines: their own client work (HTTP, SSE, image
        # downloads) must not take the 2 cores from the server they load. The probe, which measures, is not niced.
        lower_visitor_priority(opts.visitor_niceness)
    try:
        if role == "probe":
            soak.probe(deadline, out)
        else:
            soak.visitor(index, deadline, out)
    finally:
        out.put(None)


def summarize(report: SoakReport, opts: SoakOptions) -> dict:
    counts = report.counts()
    probe = [o.seconds for o in report.outcomes if o.probe and o.kind == "ok" and o.warm]
    probe_compiling = [o.seconds for o in report.outcomes if o.probe and o.kind == "ok" and o.warm and o.compiling]
    warm_all = [o.seconds for o in report.outcomes if o.kind == "ok" and o.warm and not o.probe]
    probe_own_compiling = [o.seconds for o in report.outcomes
                           if o.probe and o.kind == "ok" and o.warm and o.engine_compiling]
    probe_engine = [o.engine_s for o in report.outcomes if o.probe and o.kind == "ok" and o.warm and o.engine_s]
    probe_handler = [o.handler_s for o in report.outcomes if o.probe and o.kind == "ok" and o.warm and o.handler_s]
    idle = median(report.idle_s) if report.idle_s else None
    budget = parse_size(opts.memory_budget)
    engines = report.status.get("engines") or []
    system = report.status.get("system") or {}
    host = system.get("host") or {}
    compiles = host.get("compiles") or {}
    p95 = percentile(probe, 0.95)
    p95_c = percentile(probe_compiling, 0.95)
    summary = {
        "visitors": opts.visitors, "duration_s": opts.duration, "requests": len(report.outcomes), **counts,
        "failed_or_hung": counts["failed"] + counts["hung"],
        "client_race_retries": sum(o.client_race for o in report.outcomes),
        "peak_rss_gib": round(report.peak_rss / GIB, 3), "budget_gib": round(budget / GIB, 3) if budget else None,
        "rss_target_gib": round((budget + GIB) / GIB, 3) if budget else None,
        "engines_loaded_at_end": sum(1 for e in engines if e.get("state") not in ("evicted",)),
        "engines_started": host.get("engines_started"), "engines_evicted": host.get("evictions"),
        "compiles_run": compiles.get("finished"),
        "idle_median_s": idle, "probe_p50_s": percentile(probe, 0.5), "probe_p95_s": p95,
        "probe_p95_while_compiling_s": p95_c, "probe_samples_while_compiling": len(probe_compiling),
        # compiles in the probe's own worker (what stepping aside is for) vs the host's CPU share overall
        "probe_p95_own_engine_compiling_s": percentile(probe_own_compiling, 0.95),
        "probe_samples_own_engine_compiling": len(probe_own_compiling),
        "p95_over_idle": round(p95 / idle, 2) if p95 and idle else None,
        "p95_while_compiling_over_idle": round(p95_c / idle, 2) if p95_c and idle else None,
        "warm_requests_p50_s": percentile(warm_all, 0.5), "warm_requests_p95_s": percentile(warm_all, 0.95),
        "probe_engine_p50_s": percentile(probe_engine, 0.5), "probe_engine_p95_s": percentile(probe_engine, 0.95),
        "idle_handler_median_s": median(report.idle_handler_s) if report.idle_handler_s else None,
        "probe_handler_p50_s": percentile(probe_handler, 0.5),
        "probe_handler_p95_s": percentile(probe_handler, 0.95),
        "exit_s": round(report.exit_s, 2) if report.exit_s is not None else None, "exited": report.exited,
        "orphans": report.orphans,
        "failures": [o.detail for o in report.outcomes if o.kind in ("failed", "hung")][:10],
        # What the clear errors said, most frequent first (bad input on purpose, budget refusals, ...).
        "clear_errors": collections.Counter(_gist(o.detail) for o in report.outcomes if o.kind == "clear")
        .most_common(8),
        "host": host,
    }
    return summary


def _gist(detail: str) -> str:
    """An error's kind and first words, so the summary can count alike errors together."""
    text = detail.split(": ", 1)[-1]
    return " ".join(text.split()[:8])


def print_summary(s: dict) -> None:
    def fmt(v, unit=""):
        return "—" if v is None else (f"{v:.3f}{unit}" if isinstance(v, float) else f"{v}{unit}")

    print(f"\nsoak: {s['visitors']} visitors x {s['duration_s']} s, {s['requests']} requests")
    print(f"  answered ok {s['ok']}, cancelled {s['cancelled']}, clear error {s['clear']}, "
          f"failed {s['failed']}, hung {s['hung']}; sent again after gradio_client's stream race "
          f"{s['client_race_retries']}")
    print(f"  peak RSS app+workers {fmt(s['peak_rss_gib'], ' GiB')} (budget {fmt(s['budget_gib'], ' GiB')}, "
          f"target <= {fmt(s['rss_target_gib'], ' GiB')})")
    print(f"  engines started {fmt(s['engines_started'])}, evicted {fmt(s['engines_evicted'])}, "
          f"loaded at the end {s['engines_loaded_at_end']}; compiles run {fmt(s['compiles_run'])}")
    print(f"  warm-bucket probe: idle median {fmt(s['idle_median_s'], ' s')}, p50 {fmt(s['probe_p50_s'], ' s')}, "
          f"p95 {fmt(s['probe_p95_s'], ' s')} ({fmt(s['p95_over_idle'], 'x')} idle); while compiling p95 "
          f"{fmt(s['probe_p95_while_compiling_s'], ' s')} ({fmt(s['p95_while_compiling_over_idle'], 'x')}, "
          f"{s['probe_samples_while_compiling']} samples); while its own engine compiled p95 "
          f"{fmt(s['probe_p95_own_engine_compiling_s'], ' s')} ({s['probe_samples_own_engine_compiling']} samples)")
    print(f"  probe's time in the engine (queue + run, no web round trip): p50 {fmt(s['probe_engine_p50_s'], ' s')}, "
          f"p95 {fmt(s['probe_engine_p95_s'], ' s')}")
    print(f"  probe's time in the app's handler (dispatch + engine): idle median {fmt(s['idle_handler_median_s'], ' s')}, "
          f"p50 {fmt(s['probe_handler_p50_s'], ' s')}, p95 {fmt(s['probe_handler_p95_s'], ' s')}")
    print(f"  app exit after SIGTERM {fmt(s['exit_s'], ' s')}; orphan processes {len(s['orphans'])}")
    for f in s["failures"]:
        print(f"  failure: {f}")
    for gist, count in s["clear_errors"]:
        print(f"  clear error x{count}: {gist}")


@dataclass(frozen=True)
class SoakOptions:
    """`soak`'s flags (the visitor processes get a copy)."""

    visitors: int = flags.count(4)
    duration: float = flags.seconds(180.0, "seconds of visitor traffic")
    memory_budget: str = flags.text("3GiB")
    compile_jobs: int = flags.count(1, high=flags.MAX_THREADS)
    presets: str = flags.text(f"{settings.DEFAULT_PRESET},tiny-sd3",
                              "what visitors may pick (the first is the app's default engine, the probe's)")
    precisions: str = flags.text("fp32,bf16,fp16")
    modes: str = flags.text("eager,compile,regional")
    sizes: str = flags.sizes("64x64,128x128,64x128,128x64")
    device: str = flags.device("cpu")
    probe_mode: str = flags.mode("regional", "mode of the warm bucket the probe visitor measures")
    warm: str = flags.text("64x64", "app.py --warm for the default engine")
    public: bool = flags.either(True)
    cancel_rate: float = flags.number(0.1, 0.0, 1.0)
    bad_rate: float = flags.number(0.1, 0.0, 1.0)
    think_s: float = flags.seconds(1.0, "a visitor waits up to this long between requests")
    probe_interval: float = flags.seconds(0.5)
    probe_client: str = flags.text("browser", "how the probe talks to the app: the queue protocol directly, as a "
                                   "page does, or through gradio_client (whose polling threads add their own delays "
                                   "on a busy host)", choices=("browser", "gradio_client"))
    visitor_niceness: int = flags.count(19, "CPU niceness of the visitor processes (they stand in for remote "
                                        "browsers; 0 = none)", low=0, high=19)
    idle_runs: int = flags.count(15)
    hang_s: float = flags.seconds(300.0, "a request without an answer this long is hung")
    warm_timeout: float = flags.seconds(600.0)
    cache_dir: Path | None = flags.cache_dir(check=Path)
    seed: int = flags.count(0, low=0, high=MAX_SEED)
    out: str | None = flags.out("artifacts/soak", "folder for soak.json and the app log")
    app_arg: list[str] = flags.app_args()


def add_soak_parser(sub) -> None:
    flags.add_command(sub, "soak", SoakOptions, cmd_soak, description=__doc__.split("\n\n")[0],
                      help="simulated visitors against a real app process")


def cmd_soak(args) -> int:
    opts = from_args(SoakOptions, args)
    report = Soak(opts).run()
    summary = summarize(report, opts)
    print_summary(summary)
    if opts.out:
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps(summary, indent=2))
        # every request, for a closer look (e.g. where the probe's round trip went: handler_s, engine_s)
        (out / "outcomes.jsonl").write_text("".join(json.dumps(asdict(o)) + "\n" for o in report.outcomes))
    return 1 if summary["failed_or_hung"] or summary["orphans"] else 0
