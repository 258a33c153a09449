"""Open WebUI's image generation against this app's /v1, as a real third-party client (not run by the suite).

Open WebUI's "openai" image engine, configured by nothing but its settings (engine, base URL, key, model, size),
draws an image through the app: this script installs Open WebUI into a virtual environment of its own (once,
about 5 minutes and 7 GB), starts it on loopback with a fresh data folder, signs in (its auth is off), asks
it for an image, downloads what it stored and reads it with the embedded model's pixel checker.

    python app.py &                                   # the app, on 127.0.0.1:7860
    .venv/bin/python scripts/openwebui_images.py      # PASS / FAIL and the image under artifacts/

Options: --app (the app's address), --model (what Open WebUI sends as `model`: dall-e-2, dall-e-3, gpt-image-1
or one of GET /v1/models), --size, --key (where the host asks for API keys), --venv, --port.
Exit status 0 when Open WebUI's image is a PNG of the size asked for and the checker reads the prompt in it.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "a red circle on a blue background"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app", default="http://127.0.0.1:7860", help="the app's address (default: %(default)s)")
    parser.add_argument("--model", default="dall-e-2", help="the model Open WebUI names (default: %(default)s)")
    parser.add_argument("--size", default="64x64", help="the image size Open WebUI asks for (default: %(default)s)")
    parser.add_argument("--key", default="unused", help="the app's API key, where the host requires one")
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "diffusion-showcase" / "openwebui",
                        help="Open WebUI's own virtual environment (made on first use; default: %(default)s)")
    parser.add_argument("--port", type=int, default=8089, help="Open WebUI's loopback port (default: %(default)s)")
    return parser.parse_args()


def open_webui(venv: Path) -> Path:
    """The `open-webui` command, installed into its own environment the first time."""
    command = venv / "bin" / "open-webui"
    if not command.exists():
        print(f"installing Open WebUI into {venv} (once; a few minutes) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "open-webui"], check=True)
    return command


def settings(args: argparse.Namespace, data: Path) -> dict:
    """Open WebUI's environment: image generation on the openai engine at the app's /v1; no auth, no chat
    backends, nothing fetched at start-up (a fresh data folder, so these are its first settings)."""
    return {**os.environ, "DATA_DIR": str(data), "WEBUI_AUTH": "False", "WEBUI_SECRET_KEY": "openwebui-images-check",
            "ENABLE_IMAGE_GENERATION": "True", "IMAGE_GENERATION_ENGINE": "openai",
            "IMAGES_OPENAI_API_BASE_URL": args.app.rstrip("/") + "/v1", "IMAGES_OPENAI_API_KEY": args.key,
            "IMAGE_GENERATION_MODEL": args.model, "IMAGE_SIZE": args.size,
            "ENABLE_OLLAMA_API": "False", "ENABLE_OPENAI_API": "False", "OFFLINE_MODE": "True",
            "HF_HUB_OFFLINE": "1", "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False", "ENABLE_VERSION_UPDATE_CHECK": "False"}


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"Open WebUI exited with {server.returncode} before it answered (its log is above)")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise SystemExit(f"Open WebUI did not answer {url}/health within {timeout:.0f} s")


def draw(url: str) -> tuple[Image.Image, dict]:
    """Sign in (auth off: the built-in admin), ask Open WebUI for an image, download the file it stored."""
    token = httpx.post(url + "/api/v1/auths/signin", json={"email": "admin@localhost", "password": "admin"},
                       timeout=60).raise_for_status().json()["token"]
    headers = {"authorization": f"Bearer {token}"}
    answer = httpx.post(url + "/api/v1/images/generations", json={"prompt": PROMPT}, headers=headers, timeout=600)
    if answer.status_code != 200:
        raise SystemExit(f"FAIL: Open WebUI answered {answer.status_code}: {answer.text[:500]}")
    (image,) = answer.json()
    stored = httpx.get(url + image["url"], headers=headers, timeout=60).raise_for_status()
    return Image.open(io.BytesIO(stored.content)), image


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(ROOT))
    from training.shapes.fidelity import check

    models = httpx.get(args.app.rstrip("/") + "/v1/models", headers={"authorization": f"Bearer {args.key}"},
                       timeout=30)
    if models.status_code != 200:
        raise SystemExit(f"the app does not answer {args.app}/v1/models ({models.status_code}): start it first")
    command = open_webui(args.venv)
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory(prefix="openwebui-") as data:
        server = subprocess.Popen([str(command), "serve", "--host", "127.0.0.1", "--port", str(args.port)],
                                  env=settings(args, Path(data)))
        try:
            wait_ready(url, server)
            image, item = draw(url)
        finally:
            server.terminate()
            server.wait(timeout=60)
    out = ROOT / "artifacts" / "openwebui_image.png"
    out.parent.mkdir(exist_ok=True)
    image.save(out)
    reading = check(image.convert("RGB"), PROMPT)
    size = "x".join(map(str, image.size))
    ok = image.format == "PNG" and size == args.size and reading.correct
    print(f"{'PASS' if ok else 'FAIL'}: Open WebUI ({args.model}, {args.size}) stored a {image.format} {size} image "
          f"at {item['url']}; the checker reads {reading}; saved to {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
