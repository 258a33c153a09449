"""The headless CLI, run as a user would (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

pytestmark = pytest.mark.slow  # runs the CLI in subprocesses that load and compile


def run_cli(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


GENERATE = ["generate", "--preset", "tiny-flux", "--device", "cpu", "--precision", "fp32", "--size", "64x64",
            "--steps", "4", "--seed", "0", "--prompt", "a red fox", "--json"]


def test_generate_compiled_prints_every_timing(tmp_path, cache_dir, tiny_models):
    """A compiled mode through the CLI (a worker, waiting for its compile). Regional: the CLI's path is the
    same for every compiled mode, at half a full compile's cost, and tiny-flux's regional 64x64 graph is one
    other tests compile into the session's cache (then a hit here)."""
    out = tmp_path / "out.png"
    proc = run_cli(*GENERATE, "--mode", "regional", "--out", str(out), "--cache-dir", str(cache_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["mode"] == "regional" and result["bucket"] == "64x64"
    assert result["warm"] is True and result["eager_fallback"] is False and result["recompiles"] == 0
    t = result["timings"]
    assert len(t["step_ms"]) == 4
    for field in ("encode_ms", "denoise_ms", "decode_ms", "total_ms", "first_step_ms", "median_step_ms"):
        assert t[field] > 0
    assert "peak_memory_bytes" in result


def test_same_seed_gives_a_bit_identical_image_across_processes(tmp_path, cache_dir, tiny_models):
    images = []
    for i in range(2):
        out = tmp_path / f"{i}.png"
        proc = run_cli(*GENERATE, "--mode", "eager", "--out", str(out), "--cache-dir", str(cache_dir))
        assert proc.returncode == 0, proc.stderr[-3000:]
        images.append(Image.open(out).tobytes())
    assert images[0] == images[1]  # the pixels; the PNG text differs (it carries the request id)


def test_devices_and_presets():
    proc = run_cli("devices", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    names = {d["name"] for d in report}
    assert names >= {"cpu", "cuda", "mps", "xpu", "neuron", "tpu"}
    for d in report:
        assert d["available"] or d["reason"]
    proc = run_cli("presets")
    assert proc.returncode == 0
    for name in ("tiny-flux", "tiny-sdxl", "flux2-klein-4b", "flux1-schnell", "sd35-medium", "sdxl", "flux2-dev"):
        assert name in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "nope"], "unknown preset"),
        (["--size", "65x64", "--no-snap"], "pick one of"),
        (["--steps", "0"], "steps must be between"),
        (["--device", "tpu"], "tpu"),
        (["--mode", "defer-and-fuse"], "defer-and-fuse"),
        (["--model", "/definitely/not/here"], "does not exist"),
    ],
)
def test_bad_input_is_a_clear_error(args, message):
    proc = run_cli("generate", "--device", "cpu", *args, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_the_default_draws_its_example_prompt(tmp_path, cache_dir):
    """No --preset, no --prompt: the trained embedded model (committed in models/) draws the preset's first
    example prompt, as the pixel checker reads it."""
    from training.shapes.fidelity import check

    out = tmp_path / "default.png"
    proc = run_cli("generate", "--device", "cpu", "--size", "64x64", "--out", str(out), "--json",
                   "--cache-dir", str(cache_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert result["preset"] == "tiny-shapes" and len(result["timings"]["step_ms"]) == 8
    reading = check(Image.open(out), "a red circle on a blue background")
    assert reading.correct, reading


def test_any_local_diffusers_folder_can_be_served(tiny_models, cache_dir):
    """--model takes a local diffusers folder; the pipeline class comes from its model_index.json."""
    proc = run_cli("generate", "--model", str(tiny_models["tiny-sdxl"]), "--buckets", "64x64,128x128",
                   "--device", "cpu", "--size", "64x64", "--steps", "2", "--mode", "eager", "--json",
                   "--cache-dir", str(cache_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert result["preset"].endswith("tiny-sdxl") and len(result["timings"]["step_ms"]) == 2
