"""Issue 6: bad input, load, faults and access through the app's public API (gradio_client).

Every loop here is bounded in count and time and talks to 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from gradio_client import Client
from helpers import BAD_INPUTS, free_port, launch_demo, max_pixel_difference, wait_until
from PIL import Image

from engine.protocol import EngineOptions
from engine.serving.manager import EngineManager
from ui.handlers import Handlers, UIDefaults

pytestmark = pytest.mark.slow  # launches the app and drives real engines through its API

REPO = Path(__file__).resolve().parent.parent
GOOD = dict(prompt="a red fox", negative_prompt="", preset="tiny-flux", device="cpu", precision="fp32",
            mode="eager", size="64x64", steps=3, guidance=3.5, seed=11)


def launch(manager, queue_size: int):
    return launch_demo(manager, UIDefaults(device="cpu", mode="eager"), queue_size=queue_size)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    """An allowed model root holding a folder that asks for remote code and one that is no pipeline."""
    root = tmp_path_factory.mktemp("model-root")
    (root / "remote-code").mkdir()
    (root / "remote-code" / "model_index.json").write_text(
        json.dumps({"_class_name": ["my_module", "MyPipeline"], "_diffusers_version": "0.42.1"}))
    (root / "not-a-pipeline").mkdir()
    return root


@pytest.fixture(scope="module")
def manager_and_url(cache_dir, tiny_models, model_root):
    manager = EngineManager(cache_dir=cache_dir, allowed_roots=[model_root],
                            options=EngineOptions(warm_sizes=(), max_queue=64))
    demo, url = launch(manager, queue_size=64)
    yield manager, url
    demo.close()
    manager.shutdown()


@pytest.fixture(scope="module")
def client(manager_and_url):
    return Client(manager_and_url[1], verbose=False)


def generate(client, **overrides):
    return client.predict(**{**GOOD, **overrides}, api_name="/generate")


def bad_inputs(model_root: Path):
    """(overrides, words the error must contain) — at least 40 kinds of bad input: the soak's table
    (bench/soak.py BAD_INPUTS) and what is bad on this host (its model folders, devices absent here, the
    Hub offline)."""
    return [
        *BAD_INPUTS,
        ({"preset": str(model_root / "missing")}, "does not exist"),
        ({"preset": str(model_root / "remote-code")}, "remote code is never trusted"),
        ({"preset": str(model_root / "not-a-pipeline")}, "no model_index.json"),
        ({"preset": "someone/not-a-cached-model"}, "cannot reach Hub model"),
        ({"device": "tpu"}, "tpu"),
        ({"device": "neuron"}, "neuron"),
        ({"device": "cuda"}, "cuda"),
        ({"device": "mps"}, "mps"),
        ({"device": "xpu"}, "xpu"),
    ]


def test_forty_bad_requests_get_clear_errors_then_a_good_one_succeeds(client, model_root):
    cases = bad_inputs(model_root)
    assert len(cases) >= 40
    for overrides, words in cases:
        with pytest.raises(Exception) as info:  # noqa: PT011 - gradio_client raises AppError with the message
            generate(client, **overrides)
        message = str(info.value)
        assert words.lower() in message.lower(), f"{overrides}: {message}"
        assert "Traceback" not in message
    image, timings = generate(client)
    assert timings["bucket"] == "64x64" and len(timings["timings"]["step_ms"]) == 3
    assert Path(image).is_file()


def test_twenty_clients_times_ten_requests_no_failures_no_cross_talk(manager_and_url, client):
    manager, url = manager_and_url
    seeds = [101, 102, 103, 104, 105]
    reference = {s: Image.open(generate(client, seed=s)[0]) for s in seeds}
    app = psutil.Process()

    def tree_rss() -> int:
        procs = [app, *app.children(recursive=True)]
        return sum(p.memory_info().rss for p in procs if p.is_running())

    for s in seeds:  # warm-up round: every code path once
        generate(client, seed=s)
    rss_warm = tree_rss()
    failures, mismatches, done = [], [], []
    deadline = time.monotonic() + 600

    def worker(index: int) -> None:
        c = Client(url, verbose=False)
        for i in range(10):
            if time.monotonic() > deadline:
                failures.append((index, i, "out of time"))
                return
            seed = seeds[(index + i) % len(seeds)]
            try:
                image, _ = generate(c, seed=seed)
            except Exception as exc:  # noqa: BLE001 - counted, the test fails below
                failures.append((index, i, str(exc)))
                continue
            if max_pixel_difference(Image.open(image), reference[seed]) > 2:  # another request's image
                mismatches.append((index, i, seed))
            done.append(1)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(20)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, deadline - time.monotonic()))
    elapsed = time.monotonic() - started
    rss_after = tree_rss()
    print(f"200 requests in {elapsed:.1f}s; app+workers RSS {rss_warm / 2**20:.0f} MiB after warm-up, "
          f"{rss_after / 2**20:.0f} MiB after 200 requests")
    assert not failures, failures[:5]
    assert not mismatches, mismatches[:5]
    assert len(done) == 200
    # Stated bound: within 25% + 200 MiB of the footprint after warm-up (no per-request leak).
    assert rss_after <= rss_warm * 1.25 + 200 * 2**20


def test_a_full_queue_answers_busy_instead_of_hanging(manager_and_url):
    manager, _ = manager_and_url
    demo, url = launch(manager, queue_size=1)
    slots = Handlers(manager.serving()).run_slots()  # handlers that run at once; one more waits in the queue
    try:
        c = Client(url, verbose=False)
        jobs = [c.submit(**{**GOOD, "steps": 200, "size": "128x128", "seed": k}, api_name="/generate")
                for k in range(slots + 3)]
        messages = []
        deadline = time.monotonic() + 60
        for job in jobs:
            try:
                job.result(timeout=max(1.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001
                messages.append(str(exc))
        assert any("full" in m.lower() or "busy" in m.lower() for m in messages), messages
    finally:
        c.predict(api_name="/cancel")
        demo.close()


def test_a_killed_worker_fails_its_request_quickly_then_the_next_succeeds(manager_and_url, client):
    manager, _ = manager_and_url
    generate(client)  # the engine is up
    from engine.protocol import EngineKey

    engine = manager.engine(EngineKey("tiny-flux", "cpu", "fp32"))
    pid = engine.pid
    job = client.submit(**{**GOOD, "steps": 200, "size": "128x128"}, api_name="/generate")
    wait_until(engine.pending, 60, 0.02, "the request reaching the worker")
    wait_until(lambda: (p := job.status().progress_data) and p[0].index, 60, message="a step")  # it is running
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(Exception, match="stopped|restart"):  # the exit seen, not the 30 s timeout
        job.result(timeout=30)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            image, timings = generate(client)
            break
        except Exception:  # noqa: BLE001 - the worker is restarting
            time.sleep(0.5)
    assert timings["bucket"] == "64x64" and manager.engine(EngineKey("tiny-flux", "cpu", "fp32")).pid != pid


def test_sigterm_with_a_tensor_parallel_sidecar_leaves_no_processes(cache_dir, tiny_models):
    """SIGTERM shuts down gracefully: no worker, torchrun or rank process survives. HF_TOKEN never leaks."""
    port = free_port()
    secret = "hf_never_log_this_token_123"
    proc = subprocess.Popen(
        [sys.executable, "app.py", "--port", str(port), "--device", "cpu", "--mode", "eager", "--warm", "none",
         "--tp", "2", "--cache-dir", str(cache_dir), "-v"],
        cwd=REPO, env={**os.environ, "HF_TOKEN": secret, "GRADIO_ANALYTICS_ENABLED": "False"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 240
        client = None
        while time.monotonic() < deadline and client is None:
            try:
                client = Client(url, verbose=False)
            except Exception:  # noqa: BLE001 - not listening yet
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.5)
        status = []
        while time.monotonic() < deadline:
            status = client.predict(api_name="/status")
            if status and status[0]["state"] in ("ready", "down"):
                break
            time.sleep(0.5)
        assert status[0]["state"] == "ready", status
        assert status[0]["engine"].endswith("tp2")
        system = json.dumps(client.predict(api_name="/system"))
        assert secret not in system
        family = psutil.Process(proc.pid).children(recursive=True)
        assert any("torchrun" in " ".join(p.cmdline()) or "engine.tp.sidecar" in " ".join(p.cmdline())
                   for p in family if p.is_running())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(family, timeout=15)
        assert not alive, [p.cmdline() for p in alive]
        output = proc.stdout.read()
        assert secret not in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_default_server_is_private():
    import app

    args = app.build_parser().parse_args([])
    assert args.host == "127.0.0.1" and args.share is False and args.auth is None


def test_a_truncated_compiled_module_in_the_cache_is_removed_before_the_retry(tmp_path):
    """A process killed while inductor wrote its C++ module leaves a 0-byte .so that inductor's code cache
    would load again by its hash, even with the FX graph cache off: the retry removes what the error names,
    and only inside the inductor cache folder."""
    from engine.config.caches import remove_corrupt_artifacts

    cache = tmp_path / "inductor"
    corrupt = cache / "3c" / "c3cgetv7q3e4.main.so"
    corrupt.parent.mkdir(parents=True)
    corrupt.write_bytes(b"")
    outside = tmp_path / "elsewhere.so"
    outside.write_bytes(b"keep")
    try:
        try:
            raise ImportError(f"{corrupt}: file too short")
        except ImportError as cause:
            raise RuntimeError(f"InductorError: ImportError (also {outside}: file too short)") from cause
    except RuntimeError as exc:
        removed = remove_corrupt_artifacts(exc, cache)
    assert removed == [str(corrupt)] and not corrupt.exists() and outside.exists()
    assert remove_corrupt_artifacts(RuntimeError("no path here"), cache) == []


def test_without_a_known_inductor_cache_nothing_is_removed(tmp_path, monkeypatch):
    from engine.config.caches import remove_corrupt_artifacts

    stray = tmp_path / "x.main.so"
    stray.write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert remove_corrupt_artifacts(ImportError(f"{stray}: file too short")) == [] and stray.exists()
