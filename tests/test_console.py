"""What `make run` (python app.py) prints: the app's own lines, no third-party noise, and a web process that
imports no compiler and no torchao."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import free_port

REPO = Path(__file__).resolve().parent.parent
URL_LINE = "Running on local URL:"
READY = re.compile(r"INFO app: engine \S+ ready in")
# A line of ours: the app's and the engine's loggers (a worker's start with its engine), Gradio's own launch lines.
OURS = re.compile(r"^(\[worker [^\]]+\] )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) (app|engine|ui)[\w.]*( \[[\w,]+\])?: "
                  r"|^\* Running on local URL|^$")
# The web process prints these modules' names when it exits (after SIGTERM): none may be loaded.
HEAVY = ("torchao", "torch._inductor.codecache", "torch._inductor.compile_fx")
WRAPPER = f"""
import atexit, runpy, sys
atexit.register(lambda: print("WEB-MODULES", sorted(m for m in sys.modules if m.startswith({HEAVY!r})),
                              file=sys.stderr, flush=True))
sys.argv = ["app.py", *sys.argv[1:]]
runpy.run_path("app.py", run_name="__main__")
"""


def run_app_until_ready(args: list[str], timeout: float = 420, **env_vars: str) -> tuple[list[str], list[str]]:
    """Start the app (the embedded default), wait for its URL and its default engine's ready line, stop it
    with SIGTERM; returns (lines printed until ready, lines printed after)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False", **env_vars}
    child = subprocess.Popen([sys.executable, "-c", WRAPPER, "--port", str(free_port()), *args], cwd=REPO,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    done = threading.Event()

    def read():
        for line in child.stdout:
            lines.append(line.rstrip("\n"))
            if READY.search(line) and any(URL_LINE in seen for seen in lines):
                done.set()
        done.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert done.wait(timeout), "the app printed neither its URL nor its engine's ready line:\n" + "\n".join(lines)
        upto = len(lines)
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    time.sleep(0.2)  # the reader takes the last lines
    return lines[:upto], lines[upto:]


@pytest.mark.slow  # starts the app and its default engine
def test_make_run_prints_what_the_app_does_and_no_third_party_noise(cache_dir, tmp_path):
    system_temp = tmp_path / "system-temp"
    system_temp.mkdir()
    before, after = run_app_until_ready(["--cache-dir", str(cache_dir)], TMPDIR=str(system_temp))
    # issue 50: torch's default inductor folder and Gradio's vibe_edit_history were left empty in the system temp
    assert not [p.name for p in system_temp.rglob("*") if p.is_dir() and not any(p.iterdir())]
    assert any(URL_LINE in line for line in before)
    url_at = next(i for i, line in enumerate(before) if URL_LINE in line)
    noise = [line for line in before if not OURS.search(line)]
    assert noise == [], "third-party lines before the engine was ready:\n" + "\n".join(noise)
    says = "\n".join(before[:url_at])
    assert "INFO app: loading tiny-shapes@" in says  # what it is doing, before the URL
    assert url_at <= 5, says  # at most 5 lines before the URL
    # Gradio told an app whose flag is --share to "set `share=True` in `launch()`"; torch's LeafSpec warnings
    printed = "\n".join(before + after)
    assert "share=True" not in printed and "LeafSpec" not in printed and "Warning" not in says, printed
    assert any(READY.search(line) for line in before)
    (modules,) = [line for line in after if line.startswith("WEB-MODULES")]
    assert modules == "WEB-MODULES []", modules
    # its start-up compiles are not on the board yet when it is ready: it must not say there are none
    assert not any("no bucket compiling" in line for line in before)
    # a worker's progress-bar lock outlived it: the resource tracker warned at every shutdown
    assert not [line for line in after if "leaked semaphore" in line or "resource_tracker" in line], after


def test_log_format_and_mcp_follow_their_environment_variables(monkeypatch):
    import app

    assert app.build_parser().parse_args([]).log_format == "text"
    monkeypatch.setenv("SHOWCASE_LOG_FORMAT", "json")
    monkeypatch.setenv("SHOWCASE_MCP", "1")
    args = app.build_parser().parse_args([])
    assert args.log_format == "json" and args.mcp is True
    assert app.build_parser().parse_args(["--no-mcp"]).mcp is False
    with pytest.raises(SystemExit):
        app.build_parser().parse_args(["--log-format", "yaml"])


def test_mcp_without_its_extra_says_what_to_install(monkeypatch):
    from importlib import metadata

    from ui import mcp

    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", absent)
    assert 'pip install ".[mcp]"' in mcp.missing()
    monkeypatch.setattr(metadata, "version", lambda name: "2.1.0")
    assert "mcp 2.1.0 is installed" in mcp.missing() and "mcp>=1.21,<2" in mcp.missing()
    monkeypatch.setattr(metadata, "version", lambda name: "1.30.0")
    assert mcp.missing() is None
