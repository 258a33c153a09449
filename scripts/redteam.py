"""What a hostile visitor's requests write to the disk, to the log and to /metrics, against a real app process.

    HF_HUB_OFFLINE=1 python scripts/redteam.py [--deep-link-rounds 300] [--forged-calls 500] [--step-caches 1000]

It starts `app.py --public` (tiny-shapes, eager, no warm-up, a fresh --cache-dir, an admin token for /metrics;
extra flags with --app-arg), then, from one visitor address (127.0.0.2):
1. deep links: --deep-link-rounds rounds of a state change (the configuration check the page runs) and
   `GET /gradio_api/deep_link?session_hash=S`; printed: the answers, the bytes written under the system temp
   folder's `gradio/` and anywhere else in the system temp folder (new entries), and under --cache-dir;
2. forged event streams: --forged-calls `GET /gradio_api/call/generate/<32 hex>`; printed: the answers and
   the lines (and tracebacks) they added to the app's log;
3. step-cache parameters: --step-caches 1-step Generates, each with a step cache of distinct parameters
   (first-block:T, magcache:T, taylorseer:I:W, faster-cache:I, pyramid:I in turn); printed: the series in
   /metrics after the first of each kind and at the end.
The app gets SIGTERM at the end; what is left under the system temp folder is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
VISITOR = "127.0.0.2"
TOKEN = secrets.token_hex(16)


def files(folder: Path) -> dict[str, int]:
    if folder.is_file():
        return {str(folder): folder.stat().st_size}
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                out[os.path.join(root, name)] = os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return out


def temp_entries() -> set[str]:
    return set(os.listdir(tempfile.gettempdir()))


def start_app(args, cache: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "app.py"), "--host", "127.0.0.1", "--port", str(args.port), "--public",
           "--preset", "tiny-shapes", "--presets", "tiny-shapes", "--device", "cpu", "--mode", "eager", "--warm",
           "none", "--cache-dir", str(cache), "--admin-token", TOKEN, *args.app_arg]
    env = dict(os.environ, PYTHONPATH=str(REPO), GRADIO_ANALYTICS_ENABLED="False")
    log = open(Path(args.out) / "app.log", "w")  # noqa: SIM115 - lives as long as the app
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_up(http: httpx.Client, url: str, app: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while True:
        try:
            if http.get(url + "/").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if app.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the app did not start: see {app.args}")
        time.sleep(0.5)


def log_lines(path: Path, start: int) -> tuple[int, int, int]:
    """(lines, tracebacks, bytes) the log gained past byte `start`."""
    text = path.read_bytes()[start:].decode(errors="replace")
    return len(text.splitlines()), text.count("Traceback (most recent call last)"), len(text)


def deep_links(client, http: httpx.Client, url: str, rounds: int, cache: Path) -> dict:
    shared = Path(tempfile.gettempdir()) / "gradio"
    before, before_cache, entries = files(shared), files(cache), temp_entries()
    answers: Counter[int] = Counter()
    for i in range(rounds):
        client.predict(prompt=f"round {i}", preset="tiny-shapes", device="cpu", precision="fp32", mode="eager",
                       size="64x64", steps="1", api_name="/generate")
        answers[http.get(f"{url}/gradio_api/deep_link", params={"session_hash": client.session_hash}).status_code] += 1
    after, after_cache = files(shared), files(cache)
    grown = sum(size - before.get(name, 0) for name, size in after.items() if size != before.get(name))
    # New entries of the shared temp folder may be other processes' (another app's manager): listed by name.
    new_entries = {e: sum(files(Path(tempfile.gettempdir()) / e).values()) for e in sorted(temp_entries() - entries)}
    return {"rounds": rounds, "answers": dict(answers), "bytes_written_to_system_temp_gradio": grown,
            "new_system_temp_entries": dict(list(new_entries.items())[:10]),
            "cache_dir_bytes_before": sum(before_cache.values()), "cache_dir_bytes_after": sum(after_cache.values()),
            "deep_link_files": sum(1 for name in after_cache if "deep_links" in name)
            + sum(1 for name in after if "deep_links" in name and name not in before)}


def forged_calls(http: httpx.Client, url: str, count: int, log: Path) -> dict:
    start = log.stat().st_size
    answers: Counter = Counter()
    started = time.perf_counter()
    for _ in range(count):
        try:
            answers[http.get(f"{url}/gradio_api/call/generate/{os.urandom(16).hex()}").status_code] += 1
        except httpx.HTTPError as exc:  # (the code before: an answer cut short)
            answers[type(exc).__name__] += 1
    took = time.perf_counter() - started
    time.sleep(1.0)
    lines, tracebacks, size = log_lines(log, start)
    return {"requests": count, "answers": dict(answers), "log_lines": lines, "tracebacks": tracebacks,
            "log_bytes": size, "seconds": round(took, 1)}


def series(http: httpx.Client, url: str) -> int:
    text = http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def step_caches(client, http: httpx.Client, url: str, count: int) -> dict:
    def cache(i: int) -> str:
        return [f"first-block:{0.001 + i * 0.0091:.4f}", f"magcache:{0.002 + i * 0.0087:.4f}",
                f"taylorseer:{i % 199 + 1}:{i % 7 + 1}", f"faster-cache:{i % 199 + 1}", f"pyramid:{i % 199 + 1}"][i % 5]

    ok, refused, first = 0, Counter(), None
    for i in range(count):
        try:
            client.predict(prompt="a red circle", preset="tiny-shapes", device="cpu", precision="fp32", mode="eager",
                           size="64x64", steps="2", step_cache=cache(i), seed=str(i), api_name="/generate")
            ok += 1
        except Exception as exc:  # counted: a refusal is an answer too
            refused[str(exc)[:80]] += 1
        if i == 4:
            first = series(http, url)
    return {"requests": count, "ok": ok, "refused": dict(refused), "series_after_first_of_each_kind": first,
            "series_at_end": series(http, url)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deep-link-rounds", type=int, default=300)
    p.add_argument("--forged-calls", type=int, default=500)
    p.add_argument("--step-caches", type=int, default=1000)
    p.add_argument("--port", type=int, default=7913)
    p.add_argument("--out", default="artifacts/redteam")
    p.add_argument("--app-arg", action="append", default=[], help="extra app.py argument (repeatable)")
    args = p.parse_args(argv)
    from gradio_client import Client

    Path(args.out).mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="redteam-cache-", dir=args.out))
    url = f"http://127.0.0.1:{args.port}"
    entries = temp_entries()
    app = start_app(args, cache)
    result: dict = {}
    try:
        with httpx.Client(timeout=60, transport=httpx.HTTPTransport(local_address=VISITOR)) as http:
            wait_up(http, url, app)
            client = Client(url + "/", verbose=False, download_files=False)
            if args.deep_link_rounds:
                result["deep_links"] = deep_links(client, http, url, args.deep_link_rounds, cache)
            if args.forged_calls:
                result["forged_calls"] = forged_calls(http, url, args.forged_calls, Path(args.out) / "app.log")
            if args.step_caches:
                result["step_caches"] = step_caches(client, http, url, args.step_caches)
    finally:
        os.killpg(app.pid, signal.SIGTERM)
        try:
            app.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(app.pid, signal.SIGKILL)
    result["system_temp_entries_left"] = sorted(temp_entries() - entries)[:10]
    result["cache_dir_web_left"] = sorted(os.listdir(cache / "web")) if (cache / "web").is_dir() else []
    print(json.dumps(result, indent=2))
    (Path(args.out) / "redteam.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
