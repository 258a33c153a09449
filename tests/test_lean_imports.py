"""A one-shot eager `python -m engine generate` imports what it runs: no compiler beyond what diffusers itself
imports, no torchao (in the command's process, which runs the engine in-process, and in any worker), and
nothing of the measuring (bench/) or training (training/) packages: serving needs neither."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # fresh processes that import torch and diffusers and load a pipeline

REPO = Path(__file__).resolve().parent.parent
PROMPT = "a red circle on a blue background"
# Imported at exit, printed by the command's own process; `-X importtime` (which the spawned worker inherits)
# lists every module either process imports.
WRAPPER = """
import atexit, sys
atexit.register(lambda: print("PARENT-MODULES", sorted(m for m in sys.modules if m.startswith(("torchao",
                              "torch._inductor"))), file=sys.stderr, flush=True))
atexit.register(lambda: print("PARENT-PACKAGES", sorted(m for m in sys.modules if m.split(".")[0] in ("bench",
                              "training")), file=sys.stderr, flush=True))
from engine.cli import main
sys.exit(main(sys.argv[1:]))
"""
BARE = """
import sys, torch
from diffusers import DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
pipe(prompt="a red circle", width=64, height=64, num_inference_steps=1, max_sequence_length=24)
"""


def imported(stderr: str) -> set[str]:
    """The modules `-X importtime` reported (every process that wrote to this stderr)."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2 and "[us]" not in line}


def compiler_and_torchao(modules: set[str]) -> set[str]:
    return {m for m in modules if m.startswith(("torchao", "torch._inductor"))}


def test_an_eager_one_shot_run_imports_no_compiler_and_no_torchao(cache_dir, tmp_path):
    out = tmp_path / "out.png"
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", WRAPPER, "generate", "--preset", "tiny-shapes",
                          "--device", "cpu", "--precision", "fp32", "--mode", "eager", "--size", "64x64", "--steps",
                          "2", "--prompt", PROMPT, "--out", str(out), "--cache-dir", str(cache_dir), "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1])["mode"] == "eager" and out.stat().st_size > 0
    (parent,) = [line for line in run.stderr.splitlines() if line.startswith("PARENT-MODULES")]
    # The command's own process (its engine runs there, engine/cli.py oneshot_runtime): no torchao at exit.
    parent = set(ast.literal_eval(parent.removeprefix("PARENT-MODULES ")))
    assert not {m for m in parent if m.startswith("torchao")}, sorted(parent)
    (packages,) = [line for line in run.stderr.splitlines() if line.startswith("PARENT-PACKAGES")]
    assert ast.literal_eval(packages.removeprefix("PARENT-PACKAGES ")) == []
    assert not {m for m in imported(run.stderr) if m.split(".")[0] in ("bench", "training")}  # nor in a worker
    engine = compiler_and_torchao(imported(run.stderr))
    assert not {m for m in engine if m.startswith("torchao")}, sorted(engine)
    # diffusers itself imports torch._dynamo, which imports a few inductor modules (its config): a bare
    # diffusers script loading the same folder is the floor. Nothing beyond it, i.e. no codecache, no compile_fx.
    from engine import settings

    bare = subprocess.run([sys.executable, "-X", "importtime", "-c", BARE, str(settings.data_path("models/tiny-shapes"))],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert bare.returncode == 0, bare.stderr[-3000:]
    floor = compiler_and_torchao(imported(bare.stderr))
    extra = engine - floor
    assert not extra, f"imported by the engine's eager run beyond a bare diffusers script: {sorted(extra)}"
    assert "torch._inductor.codecache" not in engine and "torch._inductor.compile_fx" not in engine


def test_the_oneshot_bench_prints_the_ratio_against_a_bare_script(cache_dir):
    run = subprocess.run([sys.executable, "-m", "bench", "oneshot", "--runs", "1", "--steps", "2", "--json",
                          "--cache-dir", str(cache_dir)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert len(result["engine_s"]) == len(result["bare_s"]) == 1
    assert result["ratio"] == pytest.approx(result["engine_median_s"] / result["bare_median_s"], rel=0.01)
    assert result["target"] == 0.9 and len(result["load_avg"]) == 3
