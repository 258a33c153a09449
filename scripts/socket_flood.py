"""Hostile sockets against a real app process, and what a visitor on another address sees meanwhile.

    HF_HUB_OFFLINE=1 python scripts/socket_flood.py [--sockets 20000] [--attack-addresses 1] [--streams 10]
                                                   [--heartbeat-addresses 17 --heartbeats 64]

It starts `app.py` (public mode, tiny preset, no warm-up; extra flags with --app-arg), then:
1. idle: a visitor from 127.0.0.3 times GET / on a new connection each time (its median is the baseline);
2. slowloris: --sockets connections from --attack-addresses loopback addresses (127.0.2.1, ...) each send a
   request line, then a header line every --interval seconds, never ending their headers; a socket the
   server closes is opened again on the next round, as slowloris does. The visitor keeps timing GET /;
3. header streams: --streams senders each send one header of --stream-mib MiB as fast as they can, and
   again when the server closes it, for --stream-duration seconds; the visitor keeps timing GET /.
4. held event streams: --heartbeats GET /gradio_api/heartbeat/<random> per address from
   --heartbeat-addresses addresses (127.0.5.x), each held open as long as the server keeps it and opened
   again --interval seconds after it ends, for --duration seconds; the visitor keeps timing GET /.
The app's web process (only it: workers are other processes) is sampled for open descriptors and resident
memory. Printed: the visitor's median during each attack against idle (ratio), its refusals, the most
descriptors the server held, how the attack sockets ended, the RSS growth and how long each stream lasted.

Raw sockets on asyncio, no HTTP library: the attacker is cheap, so what is measured is the server.
The attack runs in --attack-procs processes at nice 19 (each raises its descriptor limit as far as the hard
limit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
VISITOR = "127.0.0.3"
# The attackers share this machine's cores with the app; on a real host they are elsewhere. At nice 19 what
# slows the visitor is the server's work on the attack, not the attacker's own CPU.
ATTACKER_NICE = 19


# -- the visitor ---------------------------------------------------------------------------------------------
def visit(port: int, timeout: float = 30.0) -> float | None:
    """GET / on a new connection from VISITOR: seconds to the whole answer, None when refused or failed."""
    started = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(VISITOR, 0)) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    except OSError:
        return None
    return time.perf_counter() - started if data.startswith(b"HTTP/1.1 200") else None


class Visitor(threading.Thread):
    def __init__(self, port: int, every: float):
        super().__init__(daemon=True)
        self.port, self.every = port, every
        self.times: list[float] = []
        self.refused = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            took = visit(self.port)
            if took is None:
                self.refused += 1
            else:
                self.times.append(took)
            self.stop.wait(self.every)


# -- the server's web process -----------------------------------------------------------------------------
class Sampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.fds: list[int] = []
        self.rss: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.fds.append(self.process.num_fds())
                self.rss.append(self.process.memory_info().rss)
            except psutil.Error:
                return
            self.stop.wait(0.05)


# -- the attackers (separate processes) ----------------------------------------------------------------------
def raise_fd_limit(want: int) -> int:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = min(want, hard) if hard != resource.RLIM_INFINITY else want
    if new > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def _slow_socket(port, source, interval, stop_at, tally, index):
    """One slowloris socket, opened again whenever the server closes it, until stop_at."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep((index % 1000) / 1000 * min(interval, 1.0))  # spread the opening over a second
    while time.monotonic() < stop_at:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.bind((source, 0))
            await loop.sock_connect(sock, ("127.0.0.1", port))
            tally["opened"] += 1
            await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            tally["open"] += 1
            try:
                line = 0
                while time.monotonic() < stop_at:
                    try:
                        answer = await asyncio.wait_for(loop.sock_recv(sock, 4096), interval)
                    except TimeoutError:
                        line += 1
                        await loop.sock_sendall(sock, b"X-Slow-%d: 1\r\n" % line)
                        continue
                    status = answer[9:12].decode(errors="replace") if answer.startswith(b"HTTP/1.1 ") else "closed"
                    tally[f"ended {status}"] += 1
                    break
            finally:
                tally["open"] -= 1
        except OSError as exc:
            tally[f"error {type(exc).__name__}"] += 1
        finally:
            sock.close()
        await asyncio.sleep(interval)  # the next round opens it again


def _attack_proc(port, sources, count, interval, duration, out):
    os.nice(ATTACKER_NICE)
    limit = raise_fd_limit(count + 64)
    count = min(count, limit - 64)
    tally = {"opened": 0, "open": 0, "most open": 0, "asked": count}
    from collections import defaultdict

    tally = defaultdict(int, tally)

    async def main():
        stop_at = time.monotonic() + duration
        tasks = [asyncio.create_task(_slow_socket(port, sources[i % len(sources)], interval, stop_at, tally, i))
                 for i in range(count)]
        while time.monotonic() < stop_at:
            tally["most open"] = max(tally["most open"], tally["open"])
            await asyncio.sleep(0.2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    out.put(dict(tally))


def _stream_proc(port, source, mib, until, out):
    """Headers of `mib` MiB as fast as the server takes them, one after another until `until`: per stream,
    seconds until the server closed it, and how it answered."""
    os.nice(ATTACKER_NICE)
    ends = []
    chunk = b"a" * (1 << 20)
    while time.monotonic() < until or not ends:
        started = time.monotonic()
        status = "closed"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(source, 0)) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
                try:
                    for _ in range(mib):
                        sock.sendall(chunk)
                    sock.sendall(b"\r\n\r\n")
                except OSError:
                    pass
                try:
                    answer = sock.recv(4096)
                    status = answer[9:12].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"
                    while sock.recv(65536):
                        pass
                except OSError:
                    pass
        except OSError as exc:
            status = type(exc).__name__
        ends.append((time.monotonic() - started, status))
    out.put(ends)


async def _held_stream(port, source, interval, stop_at, tally):
    """One heartbeat stream held open until the server ends it, then opened again after `interval` seconds."""
    loop = asyncio.get_running_loop()
    while time.monotonic() < stop_at:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.bind((source, 0))
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, b"GET /gradio_api/heartbeat/%s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                                    % os.urandom(8).hex().encode())
            answer = await asyncio.wait_for(loop.sock_recv(sock, 4096), max(0.1, stop_at - time.monotonic()))
            status = answer[9:12].decode(errors="replace") if answer.startswith(b"HTTP/1.1 ") else "closed"
            tally[f"answered {status}"] += 1
            if status == "200":
                tally["held"] += 1
                tally["most held"] = max(tally["most held"], tally["held"])
                try:
                    while await asyncio.wait_for(loop.sock_recv(sock, 4096), max(0.1, stop_at - time.monotonic())):
                        pass
                    tally["ended by the server"] += 1
                finally:
                    tally["held"] -= 1
        except (OSError, TimeoutError) as exc:
            if time.monotonic() < stop_at:
                tally[f"error {type(exc).__name__}"] += 1
        finally:
            sock.close()
        await asyncio.sleep(interval)


def _heartbeat_proc(port, sources, per_source, interval, duration, out):
    os.nice(ATTACKER_NICE)
    raise_fd_limit(len(sources) * per_source + 64)
    from collections import defaultdict

    tally = defaultdict(int)

    async def main():
        stop_at = time.monotonic() + duration
        await asyncio.gather(*(_held_stream(port, source, interval, stop_at, tally) for source in sources
                               for _ in range(per_source)), return_exceptions=True)

    asyncio.run(main())
    out.put(dict(tally))


def held_streams(args, sampler, ctx, out) -> dict:
    """Phase 4: --heartbeat-addresses x --heartbeats held heartbeat streams; the visitor's GET / meanwhile."""
    idle = [t for t in (visit(args.port) for _ in range(args.idle_visits)) if t is not None]
    idle_ms = median_ms(idle)
    sources = [f"127.0.5.{i + 1}" for i in range(args.heartbeat_addresses)]
    mark = len(sampler.fds)
    proc = ctx.Process(target=_heartbeat_proc, args=(args.port, sources, args.heartbeats, args.interval, args.duration,
                                                     out))
    proc.start()
    time.sleep(min(10.0, args.duration / 3))  # the streams open and the first rounds are refused
    visitor = Visitor(args.port, args.visit_every)
    visitor.start()
    tally = out.get(timeout=args.duration + 120)
    visitor.stop.set()
    visitor.join()
    proc.join()
    return {"streams_asked": len(sources) * args.heartbeats, "addresses": len(sources), "attacker": tally,
            "idle_ms": idle_ms, "visitor_ms": median_ms(visitor.times), "visits": len(visitor.times),
            "refused": visitor.refused,
            "ratio": round(median_ms(visitor.times) / idle_ms, 2) if visitor.times and idle_ms else None,
            "server_fds_max": max(sampler.fds[mark:], default=None)}


# -- the run ----------------------------------------------------------------------------------------------
def start_app(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "app.py"), "--host", "127.0.0.1", "--port", str(port), "--public",
           "--preset", args.preset, "--presets", args.preset, "--device", "cpu", "--mode", "eager", "--warm", "none",
           *args.app_arg]
    env = dict(os.environ, PYTHONPATH=str(REPO), GRADIO_ANALYTICS_ENABLED="False")
    log = open(Path(args.out) / "app.log", "w")  # noqa: SIM115 - lives as long as the app
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def header_streams(args, sampler, ctx, out, idle_ms: float) -> dict:
    """Phase 3: --streams senders each send headers of --stream-mib MiB, one after another for
    --stream-duration seconds; RSS growth, how long each stream lasted and how it ended."""
    time.sleep(args.interval)
    idle = [t for t in (visit(args.port) for _ in range(args.idle_visits)) if t is not None]
    idle_ms = median_ms(idle) or idle_ms  # idle again: on a shared machine the baseline drifts
    rss_before = sampler.process.memory_info().rss
    mark = len(sampler.rss)
    visitor = Visitor(args.port, args.visit_every)
    visitor.start()
    until = time.monotonic() + args.stream_duration
    streams = [ctx.Process(target=_stream_proc, args=(args.port, f"127.0.4.{i + 1}", args.stream_mib, until, out))
               for i in range(args.streams)]
    for proc in streams:
        proc.start()
    ends = [end for _ in streams for end in out.get(timeout=args.stream_duration + 300)]
    for proc in streams:
        proc.join()
    time.sleep(1.0)
    visitor.stop.set()
    visitor.join()
    return {
        "rss_before_mib": round(rss_before / 2**20),
        "rss_growth_mib": round((max(sampler.rss[mark:], default=rss_before) - rss_before) / 2**20, 1),
        "streams": len(ends), "seconds_median": round(statistics.median(s for s, _ in ends), 2),
        "seconds_max": round(max(s for s, _ in ends), 2),
        "answers": {status: sum(1 for _, s in ends if s == status) for status in sorted({s for _, s in ends})},
        "idle_ms": idle_ms, "visitor_ms": median_ms(visitor.times),
        "ratio": round(median_ms(visitor.times) / idle_ms, 2) if visitor.times else None,
        "visits": len(visitor.times), "refused": visitor.refused}


def slowloris_and_headers(args, sampler, ctx, out, result) -> None:
    """Phases 2 and 3: slowloris sockets, then header streams (--streams); their figures go into `result`."""
    procs_n = args.attack_procs or max(1, math.ceil(args.sockets / 9000))
    sources = [f"127.0.2.{i % 250 + 1}" if i < 250 else f"127.0.3.{i % 250 + 1}"
               for i in range(args.attack_addresses)]
    share = [args.sockets // procs_n + (1 if i < args.sockets % procs_n else 0) for i in range(procs_n)]
    procs = [ctx.Process(target=_attack_proc, args=(args.port, sources, n, args.interval, args.duration, out))
             for n in share]
    fds_before = len(sampler.fds)
    for proc in procs:
        proc.start()
    time.sleep(min(10.0, args.duration / 3))  # the sockets open and the first rounds are refused
    visitor = Visitor(args.port, args.visit_every)
    visitor.start()
    tallies = [out.get(timeout=args.duration + 120) for _ in procs]
    visitor.stop.set()
    visitor.join()
    for proc in procs:
        proc.join()
    total: dict = {}
    for tally in tallies:
        for key, value in tally.items():
            total[key] = total.get(key, 0) + value
    result["slowloris"] = {
        "visitor_ms": median_ms(visitor.times), "visits": len(visitor.times), "refused": visitor.refused,
        "ratio": round(median_ms(visitor.times) / result["idle_ms"], 2) if visitor.times else None,
        "server_fds_max": max(sampler.fds[fds_before:], default=None), "attacker": total}

    # 3. header streams
    if args.streams:
        result["header_streams"] = header_streams(args, sampler, ctx, out, result["idle_ms"])


def median_ms(times: list[float]) -> float | None:
    return round(statistics.median(times) * 1000, 1) if times else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sockets", type=int, default=20000, help="slowloris sockets")
    p.add_argument("--attack-addresses", type=int, default=1, help="loopback addresses they come from (127.0.2.x)")
    p.add_argument("--attack-procs", type=int, default=0, help="attacker processes (default: one per 9,000 sockets)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between a slow socket's header lines")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of slowloris")
    p.add_argument("--streams", type=int, default=10)
    p.add_argument("--stream-mib", type=int, default=50)
    p.add_argument("--stream-duration", type=float, default=20.0, help="seconds the stream senders keep sending")
    p.add_argument("--heartbeat-addresses", type=int, default=0, help="addresses holding heartbeat streams (phase 4)")
    p.add_argument("--heartbeats", type=int, default=64, help="held heartbeat streams per address")
    p.add_argument("--idle-visits", type=int, default=20)
    p.add_argument("--visit-every", type=float, default=0.5)
    p.add_argument("--preset", default="tiny-shapes")
    p.add_argument("--port", type=int, default=7911)
    p.add_argument("--out", default="artifacts/socket_flood")
    p.add_argument("--app-arg", action="append", default=[], help="extra app.py argument (repeatable)")
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    app = start_app(args, args.port)
    result: dict = {"sockets": args.sockets, "attack_addresses": args.attack_addresses, "cores": os.cpu_count(),
                    "load_before": os.getloadavg()[0]}
    try:
        deadline = time.monotonic() + 180
        while visit(args.port, timeout=2) is None:
            if app.poll() is not None or time.monotonic() > deadline:
                print(f"the app did not start: see {args.out}/app.log", file=sys.stderr)
                return 1
            time.sleep(0.5)
        time.sleep(5)  # the default engine's worker loads meanwhile
        sampler = Sampler(app.pid)
        sampler.start()
        idle = [t for t in (visit(args.port) for _ in range(args.idle_visits)) if t is not None]
        result["idle_ms"] = median_ms(idle)
        result["fds_idle"] = sampler.process.num_fds()

        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        if args.heartbeat_addresses:  # 4. held event streams (alone: the other phases off with --sockets 0)
            result["held_streams"] = held_streams(args, sampler, ctx, out)
        if args.sockets:  # 2. slowloris, 3. header streams
            slowloris_and_headers(args, sampler, ctx, out, result)
        sampler.stop.set()
        result["load_after"] = os.getloadavg()[0]
    finally:
        os.killpg(app.pid, signal.SIGTERM)
        try:
            app.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(app.pid, signal.SIGKILL)
    print(json.dumps(result, indent=2))
    (Path(args.out) / "socket_flood.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
