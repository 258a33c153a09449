"""The app's API through gradio_client against a launched server (one per module, tiny models)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from gradio_client import Client
from gradio_client.exceptions import AuthenticationError
from helpers import free_port, launch_demo, spy_generate, wait_until
from PIL import Image

from engine.errors import Cancelled
from engine.settings import DEFAULT_PRESET
from ui.generate import PARTIAL_EVERY_S
from ui.handlers import UIDefaults

pytestmark = pytest.mark.slow  # launches the app and generates through gradio_client

GOOD = dict(prompt="a red fox", negative_prompt="", preset="tiny-flux", device="cpu", precision="fp32",
            mode="eager", size="64x64", steps=3, guidance=3.5, seed=11)
# The regional bucket this module warms: tiny-flux's first, whose graph other tests (the engine's, the CLI's,
# the soak's) compile into the session's cache too, so one of them compiles it and the rest load it.
WATCHED = "64x64"


@pytest.fixture(scope="module")
def app(manager):
    demo, url = launch_demo(manager, UIDefaults(device="cpu", mode="eager"))
    yield demo, url
    demo.close()


@pytest.fixture(scope="module")
def app_url(app):
    return app[1]


@pytest.fixture(scope="module")
def client(app_url):
    return Client(app_url, verbose=False)


def test_gradio_queue_statistics_are_off_so_an_event_costs_the_same_however_old_the_server(app, client):
    """Gradio's queue rebuilt a DataFrame of its last 10,000 events after every event (each page's board
    tick is one); the app turns that off, and Gradio's /monitoring dashboard with it."""
    import httpx

    demo, url = app
    for _ in range(3):
        client.predict(api_name="/status")
    queue = demo._queue
    assert queue.ANALYTICS_MAX_EVENTS == 1 and len(queue.event_analytics) <= 1
    assert queue.cached_event_analytics_summary == {"functions": {}}  # never computed
    assert httpx.get(url + "monitoring").status_code == 403


def test_gradio_queue_polls_every_few_milliseconds_not_every_one(app):
    """Fails if Gradio renames the attribute (the app would silently poll every millisecond again)."""
    from ui.blocks import QUEUE_POLL_S

    demo, _ = app
    assert demo._queue.sleep_when_free == QUEUE_POLL_S


def test_queue_positions_go_out_on_a_timer_not_to_every_waiting_event_at_each_start(app):
    """Gradio's default ("auto") sends every waiting event its position each time one starts: n²/2
    messages for a burst of n, at the burst's start, when the web server is busiest."""
    from ui.blocks import QUEUE_STATUS_S

    demo, _ = app
    assert demo._queue.live_updates is False and demo._queue.update_intervals == QUEUE_STATUS_S


def test_the_web_server_runs_on_uvloop_and_httptools(app):
    """The dependencies install both and uvicorn (under Gradio) picks them up on its own: were either
    missing, each request would cost the one web thread more (figures: docs/hosting.md)."""
    demo, _ = app
    config = demo.server.config
    # (the socket bounds wrap whichever protocol class uvicorn picked: ui/sockets.py)
    assert config.http_protocol_class.__name__.removeprefix("Bounded") == "HttpToolsProtocol"
    loop = config.get_loop_factory()()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def test_a_host_who_configured_gradio_queue_statistics_keeps_them(monkeypatch):
    from ui.blocks import QUEUE_STATISTICS_OFF, launch_kwargs, queue_statistics_off

    for name in QUEUE_STATISTICS_OFF:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GRADIO_ANALYTICS_MAX_EVENTS", "500")
    assert queue_statistics_off() is False
    assert "GRADIO_ANALYTICS_CACHE_FREQUENCY" not in os.environ and os.environ["GRADIO_ANALYTICS_MAX_EVENTS"] == "500"
    assert launch_kwargs()["enable_monitoring"] is True
    monkeypatch.delenv("GRADIO_ANALYTICS_MAX_EVENTS")
    assert queue_statistics_off() is True and launch_kwargs()["enable_monitoring"] is False


def test_every_action_has_a_stable_api_name(client):
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/generate", "/status", "/warm", "/compare", "/cancel", "/restart", "/system"} <= names
    params = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/generate"]["parameters"]
    assert [p["parameter_name"] for p in params][:10] == list(GOOD)


def test_the_api_page_names_results_and_allowed_values(client):
    """What a client developer reads in view_api(): named results, each parameter's allowed values."""
    shown = client.view_api(print_info=False, return_format="str")
    assert 'api_name="/generate") -> (image, timings)' in shown
    assert 'api_name="/status") -> engines' in shown and "value_" not in shown
    assert "one of fp32, tf32, bf16" in shown and "eager (serve now, uncompiled) or wait" in shown
    assert "WIDTHxHEIGHT of one bucket, or '' / 'all' for every bucket" in shown  # /warm's size


def test_every_endpoint_names_its_parameters_and_types_its_result(client):
    """The Advisor's pair included: view_api() shows each parameter by name with what it takes (not "1st",
    "2nd", ...) and each result typed (not "Any")."""
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    for name in ("/advise_start", "/advise_poll", "/status", "/system", "/warm", "/restart"):
        for param in endpoints[name]["parameters"]:
            assert param["label"] == param["parameter_name"] and param["python_type"]["description"], (name, param)
        for result in endpoints[name]["returns"]:
            assert not re.fullmatch(r"\d+(st|nd|rd|th)", result["label"]), (name, result)
            assert result["python_type"]["type"] != "Any", (name, result)
    shown = client.view_api(print_info=False, return_format="str")
    assert ('predict(preset, device, size, steps, max_minutes, fidelity_points, min_psnr, admin_token, '
            'api_name="/advise_start") -> job') in shown
    assert "the time budget in minutes, 1-30" in shown and "state: Literal['running', 'done'" in shown
    assert 'api_name="/status") -> engines' in shown and "list[dict(engine: str" in shown


def test_generate_returns_the_image_and_the_timings_json(client):
    image_path, timings = client.predict(**GOOD, api_name="/generate")
    with Image.open(image_path) as image:
        assert image.size == (64, 64)
    assert len(timings["timings"]["step_ms"]) == 3  # one per step
    assert set(timings) >= {"request_id", "engine", "mode", "bucket", "seed", "steps", "warm", "eager_fallback",
                            "recompiles", "peak_memory_bytes", "notices", "timings"}
    assert timings["seed"] == 11 and timings["engine"] == "tiny-flux@cpu/fp32"


def test_generate_sends_the_workers_png_as_it_is_and_keeps_no_temporary_file(client, manager, monkeypatch):
    """/generate hands Gradio the worker's PNG file (with the generation parameters it wrote), not a
    decoded and re-encoded image; its partials carry no image (the first PARTIAL_EVERY_S into the run);
    nothing is left in the system temp folder (the file is in Gradio's own folder, ui/webtemp.py)."""
    import json
    import tempfile

    real_generate = manager.generate

    def slowed(spec, on_progress=None, **hooks):  # a fast machine ran 60 tiny steps inside one PARTIAL_EVERY_S
        def progress(*args, **kwargs):
            time.sleep(PARTIAL_EVERY_S / 10)
            return on_progress(*args, **kwargs)
        return real_generate(spec, on_progress=progress if on_progress else None, **hooks)

    monkeypatch.setattr(manager, "generate", slowed)
    leftovers = set(Path(tempfile.gettempdir()).glob("showcase-*.png"))
    job = client.submit(**{**GOOD, "steps": 60}, api_name="/generate")  # ~1.2 s: several partials
    image_path, timings = job.result(timeout=120)
    with Image.open(image_path) as image:
        written = json.loads(image.info["diffusion-showcase"])
    assert written["request_id"] == timings["request_id"] and written["seed"] == 11
    partials = [out for out in job.outputs()[:-1] if isinstance(out[1], dict) and out[1].get("running")]
    assert partials and all(image is None for image, _ in partials)
    assert set(Path(tempfile.gettempdir()).glob("showcase-*.png")) <= leftovers


def test_a_bad_request_gets_a_clear_error_and_the_next_one_succeeds(client):
    with pytest.raises(Exception, match="not available"):
        client.predict(**{**GOOD, "device": "tpu"}, api_name="/generate")
    with pytest.raises(Exception, match="WIDTHxHEIGHT"):
        client.predict(**{**GOOD, "size": "huge"}, api_name="/generate")
    _, timings = client.predict(**GOOD, api_name="/generate")
    assert len(timings["timings"]["step_ms"]) == 3


def test_generate_streams_progress_and_cancel_stops_it(client):
    job = client.submit(**{**GOOD, "steps": 80}, api_name="/generate")
    # gr.Progress reaches the client as progress_data
    progress = wait_until(lambda: (p := job.status().progress_data) and p[0].index and p, 60, message="a step")
    assert progress and progress[0].length == 80 and progress[0].unit == "steps"
    client.predict(api_name="/cancel")
    image, timings = job.result(timeout=60)
    assert image is None and timings["cancelled"] is True
    assert len(timings["timings"]["step_ms"]) < 80


def test_job_cancel_stops_the_engine_request_between_steps(client, manager, monkeypatch):
    """gradio_client's own job.cancel(): Gradio closes the handler, which cancels the engine request."""
    outcomes = spy_generate(manager, monkeypatch)  # how each engine request the UI makes ends
    job = client.submit(**{**GOOD, "steps": 200}, api_name="/generate")
    wait_until(lambda: (p := job.status().progress_data) and p[0].index, 60, message="a step")
    cancelled_at = time.monotonic()
    job.cancel()
    wait_until(lambda: outcomes, 60, message="the engine request ending")
    assert isinstance(outcomes[0], Cancelled), outcomes
    assert int(re.search(r"after step (\d+) of 200", str(outcomes[0])).group(1)) < 200
    print(f"job.cancel(): the engine request ended {time.monotonic() - cancelled_at:.2f} s later")
    _, timings = client.predict(**GOOD, api_name="/generate")  # the engine keeps serving
    assert len(timings["timings"]["step_ms"]) == 3


def test_no_files_are_served_beyond_the_outputs(app_url):
    import urllib.error
    import urllib.request

    for path in ("/etc/passwd", str(Path(__file__).resolve())):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{app_url}gradio_api/file={path}", timeout=5)
        assert err.value.code in (403, 404)


def test_status_lists_every_bucket_and_its_state(client):
    status = client.predict(api_name="/status")
    engine = next(e for e in status if e["engine"] == "tiny-flux@cpu/fp32")
    assert engine["state"] == "ready"
    buckets = {(b["mode"], b["size"]): b["state"] for b in engine["buckets"]}
    assert buckets[("eager", "64x64")] == "warm"
    assert {state for state in buckets.values()} <= {"cold", "queued", "compiling", "warm", "failed"}
    assert {size for _, size in buckets} == {"64x64", "128x128", "64x128", "128x64"}


def test_status_answers_within_a_second_while_a_bucket_compiles(client):
    queued = client.predict(preset="tiny-flux", device="cpu", precision="fp32", mode="regional", size=WATCHED,
                            api_name="/warm")
    assert queued["queued"] == [WATCHED]
    latencies, states = [], []
    deadline = time.monotonic() + 480  # a cold regional compile on 2 busy cores: minutes
    while time.monotonic() < deadline:
        start = time.perf_counter()
        status = client.predict(api_name="/status")
        latencies.append(time.perf_counter() - start)
        engine = next(e for e in status if e["engine"] == "tiny-flux@cpu/fp32")
        bucket = next((b for b in engine["buckets"] if b["mode"] == "regional" and b["size"] == WATCHED), None)
        if bucket is None:  # run alone, the engine may still be loading: no buckets listed yet
            time.sleep(0.2)
            continue
        states.append(bucket["state"])
        if bucket["state"] in ("warm", "failed"):
            break
        time.sleep(0.2)
    print(f"/status while compiling: {len(latencies)} polls, max {max(latencies) * 1000:.0f} ms, "
          f"median {sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms; states {sorted(set(states))}")
    assert states[-1] == "warm", bucket
    assert bucket["compile_s"] > 0 and bucket["warmup_s"] is not None
    assert "compiling" in states  # /status answered while the compile ran, not after it


def test_generate_at_the_warm_bucket_compiles_nothing(client):
    _, timings = client.predict(**{**GOOD, "mode": "regional", "size": WATCHED}, api_name="/generate")
    assert timings["warm"] is True and timings["eager_fallback"] is False and timings["recompiles"] == 0


def test_compare_returns_images_and_a_speedup_table(client):
    gallery, payload = client.predict(
        prompt="a red fox", preset="tiny-flux", size=WATCHED, steps=3, guidance=3.5, seed=1, devices=["cpu"],
        precisions=["fp32"], modes=["eager", "regional"], wait_for_warm=True, api_name="/compare")
    assert len(gallery) == 2
    results = {r["config"]: r for r in payload["results"]}
    # The reference (eager fp32, no step cache) runs first; under every other image, its drift against
    # the reference's image (regional vs eager: tiny, not zero).
    assert payload["reference"] == "cpu/fp32/eager" and results["cpu/fp32/eager"]["reference"] is True
    assert "drift_max_diff" not in results["cpu/fp32/eager"]
    assert results["cpu/fp32/regional"]["drift_max_diff"] <= 3
    assert gallery[1]["caption"].startswith("cpu/fp32/regional · ") and " s / image" in gallery[1]["caption"]
    assert f"drift {results['cpu/fp32/regional']['drift']}" in gallery[1]["caption"]
    assert "drift" not in gallery[0]["caption"]
    assert results["cpu/fp32/regional"]["warm"] is True
    assert results["cpu/fp32/regional"]["compile_s"] > 0
    speedups = {row["config"]: row for row in payload["speedup"]}
    assert speedups["cpu/fp32/eager"]["speedup_step"] == pytest.approx(1.0)
    assert speedups["cpu/fp32/regional"]["speedup_step"] > 0
    # timed round-robin after the quality images: one paired figure per configuration, in the JSON and caption
    figure = results["cpu/fp32/regional"]["speedup_figure"]
    assert figure["images"] >= 3 and speedups["cpu/fp32/regional"]["speedup_total"] == figure["speedup"]
    assert figure["text"] in gallery[1]["caption"]


def test_compare_takes_a_typed_list_of_configurations(client):
    gallery, payload = client.predict(
        prompt="a red fox", preset="tiny-flux", size="64x64", steps=2, guidance=3.5, seed=1, devices=["cpu"],
        configurations="eager/fp32; eager/bf16; compile/fp32/first-block:0.2", timing_s=5, api_name="/compare")
    results = {r["config"]: r for r in payload["results"]}
    assert list(results) == ["cpu/fp32/eager", "cpu/bf16/eager", "cpu/fp32/compile/first-block:0.2"]
    assert results["cpu/fp32/compile/first-block:0.2"]["error"].startswith("not run: step cache first-block")
    assert results["cpu/bf16/eager"]["speedup_figure"]["images"] >= 3 and len(gallery) == 2


def test_warm_refuses_what_cannot_be_warmed(client):
    with pytest.raises(Exception, match="not a bucket"):
        client.predict(preset="tiny-flux", device="cpu", precision="fp32", mode="regional", size="96x96",
                       api_name="/warm")


def test_system_never_shows_secrets(client, monkeypatch):
    monkeypatch.setenv("SHOWCASE_AUTH", "admin:hunter2")  # read per request: the server is in this process
    report = client.predict(api_name="/system")
    assert report["environment"]["SHOWCASE_AUTH"] == "(set; value hidden)"
    assert "hunter2" not in str(report)
    assert any(d["name"] == "cpu" and d["available"] for d in report["devices"])


# -- app.py ----------------------------------------------------------------------------------------
def test_app_flags_default_to_a_private_local_server(monkeypatch):
    import app

    for name in ("SHOWCASE_HOST", "SHOWCASE_PORT", "GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT", "SHOWCASE_AUTH"):
        monkeypatch.delenv(name, raising=False)
    args = app.build_parser().parse_args([])
    assert (args.host, args.port, args.share, args.auth) == ("127.0.0.1", 7860, False, None)
    assert (args.preset, args.device, args.precision, args.mode) == (DEFAULT_PRESET, "auto", "fp32", "compile")
    assert app.warm_sizes("all") is None and app.warm_sizes("none") == () and app.warm_sizes("64x64") == ("64x64",)
    assert app.parse_auth("me:pa:ss") == ("me", "pa:ss")
    with pytest.raises(SystemExit):
        app.parse_auth("nopassword")


def test_app_serves_behind_auth_and_exits_cleanly_on_sigterm(cache_dir, tiny_models):
    import os
    import signal
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    import psutil

    repo = Path(__file__).resolve().parent.parent
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "app.py", "--port", str(port), "--device", "cpu", "--mode", "regional", "--warm", "none",
         "--cache-dir", str(cache_dir), "--auth", "viewer:s3cret"],
        cwd=repo, env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.5)
        with pytest.raises(AuthenticationError, match="credentials were not provided"):
            Client(url, verbose=False)  # no login, no API
        client = Client(url, auth=("viewer", "s3cret"), verbose=False)
        while time.monotonic() < deadline:  # the default engine was started at launch, in the background
            status = client.predict(api_name="/status")
            if status and status[0]["state"] == "ready":
                break
            time.sleep(0.5)
        assert status[0]["engine"] == f"{DEFAULT_PRESET}@cpu/fp32" and status[0]["state"] == "ready"
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert workers, "the engine runs in a worker process"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"orphaned worker processes: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
