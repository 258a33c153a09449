"""The reference front (scripts/nginx/showcase.conf): Debian's nginx on loopback before the app, its own prefix
and temp folders under tmp_path. An unfinished body never reaches the app and is timed out by nginx, a slow
client's head too, and an upload passes whole (`make front` installs nginx)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from helpers import free_port, wait_until
from test_socket_bounds import connect, read_all, status

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
CONF = Path(__file__).resolve().parents[1] / "scripts" / "nginx" / "showcase.conf"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path(NGINX).exists(), reason="nginx missing: make front")]


@pytest.fixture(scope="module")
def front(manager, tmp_path_factory):
    """(the app, nginx's port): the shipped configuration with its ports, and timeouts short enough to test."""
    from helpers import launch_demo

    from ui.handlers import UIDefaults

    demo, url = launch_demo(manager, UIDefaults(device="cpu", mode="eager"))
    app_port, port = int(url.rstrip("/").rsplit(":", 1)[1]), free_port()
    prefix = tmp_path_factory.mktemp("nginx")
    text = CONF.read_text()
    text = text.replace("server 127.0.0.1:7861;", f"server 127.0.0.1:{app_port};")
    text = text.replace("listen 0.0.0.0:7860;", f"listen 127.0.0.1:{port};")
    text = re.sub(r"client_(body|header)_timeout \d+s;", r"client_\1_timeout 2s;", text)
    (prefix / "nginx.conf").write_text(text)
    process = subprocess.Popen([NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"],
                               stderr=subprocess.PIPE)
    try:
        wait_until(lambda: _up(port) or process.poll() is not None, timeout=20, message="nginx to listen")
        assert process.poll() is None, process.stderr.read().decode()
        yield demo, port
    finally:
        process.terminate()
        process.wait(timeout=10)
        demo.close()


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/config", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_unfinished_body_is_timed_out_by_nginx_and_never_reaches_the_app(front):
    demo, port = front
    joins = demo.edge.snapshot()["refused"].get("body timeout", 0)
    sock = connect(port)
    sock.sendall(b"POST /gradio_api/queue/join HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n{")
    answer = read_all(sock, timeout=8)  # fails unless nginx closes it within 8 s
    assert answer == b"" or status(answer) == 408  # nginx closes a body past client_body_timeout
    assert demo.edge.snapshot()["refused"].get("body timeout", 0) == joins  # the app never waited on it


def test_a_slow_clients_head_is_timed_out_by_nginx(front):
    _, port = front
    sock = connect(port)
    sock.sendall(b"GET / HTTP/1.1\r\n")
    answer = read_all(sock, timeout=8)  # fails unless nginx closes it within 8 s
    assert answer == b"" or status(answer) == 408


def test_a_page_and_an_upload_pass_through_the_front(front):
    _, port = front
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=30) as http:
        assert http.get(f"{url}/").status_code == 200
        answer = http.post(f"{url}/gradio_api/upload", files={"files": ("a.png", b"\x89PNG" + b"0" * 200_000)})
        assert answer.status_code == 200, answer.text
        (stored,) = answer.json()
        assert http.get(f"{url}/gradio_api/file/{stored}").status_code == 403
