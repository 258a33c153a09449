"""The device-generic engine path on a fake PrivateUse1 "neuron" device: no runner code knows the device.

The same PipelineRunner that serves CPU loads a tiny pipeline onto "neuron", runs it eagerly and
compiles a bucket with the "neuron" compile backend (static shapes). It runs in a subprocess
because the PrivateUse1 rename works once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs an engine on the fake device in a child process

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import io, json, sys
    sys.path[:0] = [{tests!r}, {root!r}]
    from fake_device import install_fake_device
    fake = install_fake_device("neuron")
    import numpy as np, torch
    from PIL import Image
    from engine import devices
    from engine.config.presets import get_preset
    from engine.protocol import BucketKey, BucketState, EngineKey, GenerateRequest, Size
    from engine.protocol import EngineOptions
    from engine.protocol import EngineConfig
    from engine.pipeline.runner import PipelineRunner

    def runner(device):
        key = EngineKey("tiny-flux", device, "fp32")
        r = PipelineRunner(EngineConfig(key, get_preset("tiny-flux"), EngineOptions(warm_sizes=()), {cache!r}))
        r.load()
        return r

    out = {{}}
    neuron, cpu = runner("neuron"), runner("cpu")
    out["auto"] = devices.resolve_device("auto").name
    out["transformer_device"] = str(next(neuron.pipe.transformer.parameters()).device)
    out["neff_cache"] = __import__("os").environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
    req = GenerateRequest.checked(prompt="a red fox", width=64, height=64, steps=2, guidance=3.5, seed=0)
    a = np.asarray(neuron.generate(req).image(), dtype=np.float32)
    b = np.asarray(cpu.generate(req).image(), dtype=np.float32)
    out["eager_max_diff"] = float(abs(a - b).max())
    bucket = BucketKey("regional", Size(64, 64))
    info = neuron.warm_bucket(bucket)
    out["regional_state"] = info.state.value
    out["regional_error"] = info.error
    hit = neuron.generate(req.replace(mode="regional"))
    out["regional_warm"] = hit.warm
    out["regional_recompiles"] = hit.recompiles
    c = np.asarray(hit.image(), dtype=np.float32)
    out["regional_max_diff"] = float(abs(c - b).max())
    out["peak_memory"] = hit.peak_memory_bytes
    out["sync_calls"] = getattr(fake, "sync_calls", None)
    print("RESULT " + json.dumps(out))
    """
)


def test_runner_serves_and_compiles_on_a_fake_neuron_device(cache_dir, tiny_models):
    script = SCRIPT.format(tests=str(ROOT / "tests"), root=str(ROOT), cache=str(cache_dir))
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stderr[-4000:]
    out = json.loads(line.removeprefix("RESULT "))
    assert out["auto"] == "neuron"  # the registry prefers an available accelerator over cpu
    assert out["transformer_device"].startswith("neuron")
    assert out["neff_cache"].endswith("neff")  # persistent NEFF cache folder by default
    assert out["eager_max_diff"] <= 2.0  # uint8 images: same pipeline, same seed
    assert out["regional_state"] == "warm", out["regional_error"]
    assert out["regional_warm"] and out["regional_recompiles"] == 0
    assert out["regional_max_diff"] <= 2.0
