"""Issue 37 (items 3 and 4, and the lesser ones of the web side): what a visitor's requests may write to the
disk and to the log, and what they read back.

One public app on 127.0.0.1 with Gradio's temporary folder under its cache folder, as app.py launches it
(ui/webtemp.py); the visitor is another loopback address (127.0.0.2).
"""

from __future__ import annotations

import logging
import os
import platform
import tempfile
import uuid
from pathlib import Path

import httpx
import pytest
from gradio_client import Client
from helpers import engine_manager, launch_demo

from engine.protocol import Mode, Precision
from engine.serving.manager import HostPolicy
from ui.handlers import UIDefaults

VISITOR = "127.0.0.2"
GENERATE = dict(prompt="a red circle", preset="tiny-shapes", device="cpu", precision="fp32", mode="eager",
                size="64x64", steps="2", api_name="/generate")


def visitor() -> httpx.Client:
    return httpx.Client(timeout=30, transport=httpx.HTTPTransport(local_address=VISITOR))


@pytest.fixture(scope="module")
def app(tmp_path_factory, cache_dir, tiny_models):
    import importlib
    import sys

    from ui import webtemp

    # use_cache_folder points Gradio's modules at this app's folder, each read once at import: import them all
    # now and put every one back after, or a later app of this test process (the layout module's) served its
    # files from Gradio's default folder while /file= still allowed only this removed one: its A/B slider
    # never loaded, in the whole suite only.
    modules = {}
    for name in ("gradio.mcp", "gradio.route_utils", "gradio.routes", "gradio.screen_recording_utils"):
        try:
            modules[name] = importlib.import_module(name)
        except ImportError:  # the mcp extra missing
            continue
    saved = {name: getattr(module, "DEFAULT_TEMP_DIR", None) for name, module in modules.items()}
    cache = tmp_path_factory.mktemp("app-cache")
    before = os.environ.get("GRADIO_TEMP_DIR")
    outputs = webtemp.use_cache_folder(cache)
    policy = HostPolicy(public=True, presets=("tiny-shapes",), precisions=(Precision.FP32,), modes=(Mode.EAGER,))
    try:
        with engine_manager(cache_dir, policy=policy) as manager:
            demo, url = launch_demo(manager, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager"))
            try:
                yield demo, url.rstrip("/"), cache, outputs
            finally:
                demo.close()
    finally:
        webtemp.remove(outputs)
        webtemp._owned = None  # noqa: SLF001 - its folder is gone; nothing of this process tidies it now
        if before is None:
            os.environ.pop("GRADIO_TEMP_DIR", None)
        else:
            os.environ["GRADIO_TEMP_DIR"] = before
        for name, value in saved.items():
            if value is not None:
                sys.modules[name].DEFAULT_TEMP_DIR = value


def _files(folder: Path) -> dict[str, int]:
    if not folder.is_dir():
        return {}
    return {str(p): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_deep_links_write_nothing_and_outputs_stay_under_the_cache_folder(app):
    """Item 3: a session's state then GET /gradio_api/deep_link wrote ~150 KB per round to the system temp's
    gradio/deep_links, kept across restarts. Deep links are refused; outputs go under the cache folder."""
    demo, url, cache, outputs = app
    shared = Path(tempfile.gettempdir()) / "gradio"
    before = _files(shared)
    client = Client(url, verbose=False, download_files=False)  # (the client's downloads go to the shared folder)
    client.predict(**GENERATE)  # a session with state, and an output
    mine = _files(outputs)
    assert any(name.endswith(".png") for name in mine), mine
    with visitor() as http:
        for _ in range(20):
            answer = http.get(f"{url}/gradio_api/deep_link", params={"session_hash": client.session_hash})
            assert answer.status_code == 404 and "no deep links" in answer.json()["detail"]
    # Nothing of this app's written to Gradio's shared folder (the other test worker's apps may upload there
    # meanwhile: only what this client's session or a deep link wrote counts)
    new = set(_files(shared)) - set(before)
    assert not any("deep_link" in name or client.session_hash in name for name in new), new
    assert not any("deep_links" in name for name in _files(cache))
    assert Path(demo.app.uploaded_file_dir) == outputs  # what /file= serves from


@pytest.mark.slow
def test_files_are_served_only_from_this_apps_outputs(app):
    """Item 3, lesser: /file= served any file under Gradio's shared temporary folder, another app's included."""
    demo, url, _, outputs = app
    Client(url, verbose=False, download_files=False).predict(**GENERATE)
    own = next(p for p in _files(outputs) if p.endswith(".png"))
    shared = Path(tempfile.gettempdir()) / "gradio" / f"other-app-{uuid.uuid4().hex[:8]}"
    shared.mkdir(parents=True)
    other = shared / "image.png"
    other.write_bytes(Path(own).read_bytes())
    try:
        with visitor() as http:
            assert http.get(f"{url}/gradio_api/file={own}").status_code == 200
            for path in (other, Path("/etc/passwd"), outputs / ".." / ".." / "x"):
                answer = http.get(f"{url}/gradio_api/file={path}")
                assert answer.status_code == 403 and "own outputs" in answer.json()["detail"], path
    finally:
        other.unlink()
        shared.rmdir()


def _visitor_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name in ("ui.visitors", "uvicorn.error") or r.exc_info]


@pytest.mark.slow
def test_forged_event_streams_get_404_and_a_bounded_number_of_lines(app, caplog, capfd):
    """Item 4: GET /gradio_api/call/generate/<32 hex> logged two tracebacks (5.76 KB) per request."""
    from ui.quietlog import PER_CLIENT

    _, url, _, _ = app
    with caplog.at_level(logging.INFO), visitor() as http:
        for _ in range(60):
            answer = http.get(f"{url}/gradio_api/call/generate/{uuid.uuid4().hex}")
            assert answer.status_code == 404, answer.text
        answer = http.get(f"{url}/gradio_api/queue/data", params={"session_hash": "never-joined"})
        assert answer.status_code == 404
    lines = _visitor_lines(caplog)
    assert len(lines) <= PER_CLIENT, [r.getMessage() for r in lines]
    assert not any(r.exc_info for r in lines)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.slow
def test_unknown_functions_get_a_4xx_and_no_traceback(app, caplog, capfd):
    """Item 4: an unknown fn_index got a 500 and a traceback; unknown APIs likewise."""
    _, url, _, _ = app
    with caplog.at_level(logging.INFO), visitor() as http:
        join = http.post(f"{url}/gradio_api/queue/join", json={"data": [], "fn_index": 9999, "session_hash": "s1",
                                                                "event_data": None, "trigger_id": None})
        assert join.status_code == 400 and "Unknown function" in join.json()["detail"], join.text
        direct = http.post(f"{url}/gradio_api/run/predict", json={"data": [], "fn_index": 9999, "session_hash": "s1"})
        assert direct.status_code == 404, direct.text
        for path in ("call/nothing", "call/v2/nothing"):
            answer = http.post(f"{url}/gradio_api/{path}", json={"data": []})
            assert answer.status_code == 404 and "no such API" in answer.json()["detail"], (path, answer.text)
    assert not any(r.exc_info for r in caplog.records)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.slow
def test_an_input_gradio_cannot_read_is_named_in_one_line(app, caplog, capfd):
    """Item 4 and the lesser `timing_s="nan"`: an invalid Compare logged a 2.8 KB traceback and answered a
    bare "Error"; now the answer names the input and the log has one line."""
    _, url, _, _ = app
    client = Client(url, verbose=False)
    with caplog.at_level(logging.INFO):
        with pytest.raises(Exception, match="timing_s") as refused:
            client.predict(timing_s="nan", api_name="/compare")
        assert "could not be read" in str(refused.value)
    lines = [r for r in caplog.records if r.name == "ui.visitors"]
    assert len(lines) == 1 and not lines[0].exc_info, [r.getMessage() for r in lines]
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.slow
def test_system_shows_visitors_no_server_paths_or_kernel(app):
    """Lesser: /system showed visitors server paths (cache folders, environment) and the kernel version."""
    _, url, cache, outputs = app
    report = Client(url, verbose=False).predict(api_name="/system")
    text = str(report)
    assert str(cache) not in text and str(outputs) not in text and "/tmp" not in text, text[:2000]
    assert platform.release() not in report["versions"]["platform"]
    assert report["caches"] and all(row["size"] is not None for row in report["caches"])


# -- fast: the bounds themselves ----------------------------------------------------------------------------
def test_log_lines_are_bounded_per_visitor_and_in_total(caplog):
    from ui.quietlog import LogBudget

    budget = LogBudget(per_client=3, total=5, window_s=3600)
    with caplog.at_level(logging.WARNING, logger="ui.visitors"):
        for i in range(100):
            budget.line("a", "line %d from a", i)
        for i in range(100):
            budget.line(f"visitor-{i}", "line from %s", i)
    lines = [r.getMessage() for r in caplog.records if r.name == "ui.visitors"]
    assert lines == ["line 0 from a", "line 1 from a", "line 2 from a", "line from 0", "line from 1"]
    budget.window_s = 0  # the next window: one line says what was held back
    with caplog.at_level(logging.WARNING, logger="ui.visitors"):
        caplog.clear()
        budget.line("b", "after")
    assert [r.getMessage() for r in caplog.records] == [
        "195 more lines visitors caused were not logged in the last 0 s (from 99 visitor(s))", "after"]


def test_a_client_error_is_one_line_and_a_new_failure_shows_its_traceback_once_at_debug(caplog):
    from fastapi import HTTPException

    from ui.quietlog import LogBudget

    budget = LogBudget(per_client=100, total=100)

    def fail(exc):
        try:
            raise exc
        except Exception as caught:
            return caught

    with caplog.at_level(logging.DEBUG, logger="ui.visitors"):
        assert budget.failure("a", "GET /x", fail(HTTPException(404))) == 404
        assert budget.failure("a", "GET /x", fail(RuntimeError("bug"))) is None
        assert budget.failure("a", "GET /x", fail(RuntimeError("bug"))) is None
    records = [r for r in caplog.records if r.name == "ui.visitors"]
    assert [(r.levelname, bool(r.exc_info)) for r in records] == [
        ("WARNING", False), ("ERROR", False), ("DEBUG", True), ("ERROR", False)]
    assert budget.unexpected == {"RuntimeError": 2}  # the server's failures, counted for /metrics


def test_outputs_are_bounded_by_age_and_bytes(tmp_path):
    from ui.webtemp import tidy

    now = os.path.getmtime(tmp_path)
    for i in range(10):
        path = tmp_path / f"sub{i % 2}" / f"out{i}.png"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x" * 1000)
        os.utime(path, (now - 100 * i, now - 100 * i))  # out9 the oldest
    kept = tidy(tmp_path, max_age_s=650, max_bytes=4000, force=True)
    assert kept == 4000
    assert sorted(p.name for p in tmp_path.rglob("*.png")) == ["out0.png", "out1.png", "out2.png", "out3.png"]


def test_a_handlers_repeated_unexpected_failure_is_counted_and_logs_no_traceback(caplog, monkeypatch):
    from ui import quietlog
    from ui.common import to_gradio_error

    monkeypatch.setattr(quietlog, "_installed", quietlog.LogBudget())

    def bug():
        try:
            {}["missing"]
        except KeyError as exc:
            return exc

    with caplog.at_level(logging.WARNING):
        for _ in range(20):
            to_gradio_error(bug())
    records = [r for r in caplog.records if r.name == "ui.visitors"]
    assert len(records) <= quietlog.PER_CLIENT and not any(r.exc_info for r in records)  # tracebacks: debug only
    assert quietlog._installed.unexpected == {"KeyError": 20}
