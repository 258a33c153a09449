"""tests/fake_device.py: a CPU-backed fake "neuron"/"tpu" device, exercised in subprocesses.

PrivateUse1 can be renamed once per process, so each fake device gets its own `python -c`
process (with TORCH_DEVICE_BACKEND_AUTOLOAD=0 so an installed torch_tpu cannot claim it). Each
script runs every check, records the outcome per check and prints one JSON line, so one broken
check does not hide the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

PRELUDE = textwrap.dedent(
    """
    import json, sys, tempfile, traceback
    sys.path[:0] = [{tests!r}, {root!r}]
    results = {{}}

    def check(name):
        def run(fn):
            try:
                value = fn()
                results[name] = {{"ok": True, "value": value}}
            except Exception as exc:
                results[name] = {{"ok": False, "error": f"{{type(exc).__name__}}: {{exc}}",
                                  "trace": traceback.format_exc()[-2000:]}}
        return run
    """
)

NEURON_SCRIPT = textwrap.dedent(
    """
    from fake_device import install_fake_device
    import torch, torch.nn as nn, torch.nn.functional as F
    mod = install_fake_device("neuron")
    from engine import devices as D

    @check("idempotent")
    def _():
        assert install_fake_device("neuron") is mod

    @check("second_name_refused")
    def _():
        try:
            install_fake_device("tpu")
        except RuntimeError as exc:
            return str(exc)
        raise AssertionError("a second fake device in one process was accepted")

    @check("accelerator")
    def _():
        return [torch.accelerator.current_accelerator().type, torch.accelerator.device_count(),
                torch.get_device_module("neuron").device_count()]

    @check("probe")
    def _():
        avail = D.get_device("neuron").probe()
        return [avail.available, avail.reason, D.resolve_device("neuron").name, D.resolve_device("auto").name]

    class Block(nn.Module):
        # The ops a diffusion model leans on: conv, GroupNorm, Linear, SDPA, a factory on x.device.
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, padding=1)
            self.norm = nn.GroupNorm(2, 8)
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            h = self.norm(self.conv(x))
            b, c = h.shape[:2]
            t = self.proj(h.flatten(2).transpose(1, 2))
            q = t.view(b, -1, 2, 4).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(b, -1, c)
            pos = torch.arange(a.shape[1], device=a.device, dtype=a.dtype)[None, :, None]
            return F.silu(a + 0.01 * pos)

    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        ref = model(x)
    spec = D.get_device("neuron")

    @check("bind_local_device")
    def _():
        # The runtime's current core, whatever the local rank: the fake has one core, so a
        # set_device(3) would raise "invalid neuron device index 3".
        return [str(spec.bind_local_device(3)), str(spec.bind_local_device(0)), mod.current_device()]

    @check("eager_matches_cpu")
    def _():
        spec.reset_peak_memory()
        model.to("neuron")
        assert model.conv.weight.device.type == "neuron" and isinstance(model.conv.weight, nn.Parameter)
        with torch.no_grad():
            out = model(x.to("neuron"))
        spec.synchronize()
        assert out.device == torch.device("neuron", 0), out.device
        return [(out.cpu() - ref).abs().max().item(), spec.peak_memory_bytes(), mod.sync_count()]

    @check("factories_views_inplace")
    def _():
        z = torch.zeros(2, 3, device="neuron")
        v = z[0]
        v.add_(1)                      # a view aliases its base, in place
        r = torch.randn(4, device="neuron")
        t = torch.tensor([1.0, 2.0], device="neuron")  # C++ path that skips __torch_dispatch__
        return [z.cpu().tolist(), str(r.device), repr(torch.ones(1, device="neuron")), t.cpu().tolist()]

    @check("strict_device_mixing")
    def _():
        try:
            model(x)                   # CPU input, neuron weights: a real device refuses too
        except RuntimeError as exc:
            return str(exc)[:120]
        raise AssertionError("mixing cpu and neuron tensors was accepted")

    @check("compile_backend")
    def _():
        before = mod.compile_count
        compiled = torch.compile(model, backend=spec.compile_backend, fullgraph=True, dynamic=False)
        with torch.no_grad():
            out = compiled(x.to("neuron"))
            compiled(x.to("neuron"))                      # same shape: no recompile
            n_same = mod.compile_count - before
            compiled(torch.randn(1, 4, 8, 8).to("neuron"))  # new shape: one more graph
        return [out.device.type, (out.cpu() - ref).abs().max().item(), n_same, mod.compile_count - before]

    @check("compile_refuses_dynamic")
    def _():
        compiled = torch.compile(Block().to("neuron"), backend="neuron", dynamic=True)
        try:
            with torch.no_grad():
                compiled(x.to("neuron"))
        except Exception as exc:
            return str(exc)[:200]
        raise AssertionError("dynamic shapes were accepted")

    @check("diffusers_flux_regional")
    def _():
        from diffusers import FluxTransformer2DModel
        torch.manual_seed(0)
        tr = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                    pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]).eval()
        kw = dict(hidden_states=torch.randn(1, 16, 16), encoder_hidden_states=torch.randn(1, 8, 32),
                  pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3), return_dict=False)
        with torch.no_grad():
            want = tr(**kw)[0]
            tr.to("neuron")
            kwd = {k: v.to("neuron") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            eager = tr(**kwd)[0]
            tr.compile_repeated_blocks(backend="neuron", fullgraph=True, dynamic=False)
            regional = tr(**kwd)[0]
        return [eager.device.type, (eager.cpu() - want).abs().max().item(),
                (regional.cpu() - want).abs().max().item()]

    @check("transformers_text_encoder")
    def _():
        # Qwen3 (Flux2Klein's text encoder) builds its KV cache with torch.tensor(device=...).
        from transformers import Qwen3Config, Qwen3Model
        torch.manual_seed(0)
        te = Qwen3Model(Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()
        ids = torch.randint(0, 100, (1, 12))
        with torch.no_grad():
            want = te(input_ids=ids).last_hidden_state
            got = te.to("neuron")(input_ids=ids.to("neuron")).last_hidden_state
        return [got.device.type, (got.cpu() - want).abs().max().item()]

    @check("process_group_and_mesh")
    def _():
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        path = tempfile.NamedTemporaryFile(delete=False).name
        dist.init_process_group(spec.dist_backend, store=dist.FileStore(path, 1), rank=0, world_size=1)
        try:
            t = torch.ones(4, device="neuron")
            dist.all_reduce(t)
            mesh = DeviceMesh(spec.mesh_device_type, [0])
            return [dist.get_backend(), t.device.type, t.cpu().tolist(), mesh.device_type,
                    list(mod.dist_backends)]
        finally:
            dist.destroy_process_group()

    print("RESULTS " + json.dumps(results))
    """
)

TPU_SCRIPT = textwrap.dedent(
    """
    from fake_device import install_fake_device
    import torch
    mod = install_fake_device("tpu")
    from engine import devices as D
    spec = D.get_device("tpu")

    @check("probe")
    def _():
        return [spec.probe().available, D.resolve_device("auto").name]

    @check("is_available_raises_like_torch_tpu")
    def _():
        try:
            torch.tpu.is_available()
        except RuntimeError as exc:
            return str(exc)
        raise AssertionError("torch.tpu.is_available() did not raise")

    @check("bind_local_device")
    def _():
        return [str(spec.bind_local_device(2)), spec.tp_load_context().__class__.__name__]

    @check("eager_mode")
    def _():
        return [D.enter_eager_mode(spec, "defer-and-fuse"), torch.tpu.eager_mode.name,
                D.enter_eager_mode(spec, "eager"), torch.tpu.eager_mode.name]

    @check("compile_and_mesh")
    def _():
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        lin = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4)
        want = lin(x)
        out = torch.compile(lin.to("tpu"), backend="tpu", dynamic=False)(x.to("tpu"))
        path = tempfile.NamedTemporaryFile(delete=False).name
        dist.init_process_group(spec.dist_backend, store=dist.FileStore(path, 1), rank=0, world_size=1)
        try:
            mesh = DeviceMesh(spec.mesh_device_type, [0])
            return [(out.cpu() - want).abs().max().item(), mod.compile_count, dist.get_backend(), mesh.device_type]
        finally:
            dist.destroy_process_group()

    print("RESULTS " + json.dumps(results))
    """
)

# Two ranks, gloo underneath: proves collectives on fake tensors really travel.
TWO_RANK_SCRIPT = textwrap.dedent(
    """
    from fake_device import install_fake_device
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    install_fake_device("neuron")
    rank, path = int(sys.argv[1]), sys.argv[2]

    @check("two_ranks")
    def _():
        dist.init_process_group("neuron", store=dist.FileStore(path, 2), rank=rank, world_size=2)
        try:
            t = torch.full((2,), float(rank + 1), device="neuron")
            dist.all_reduce(t)
            mesh = DeviceMesh("neuron", [0, 1])
            dt = distribute_tensor(torch.arange(4.0).to("neuron"), mesh, [Shard(0)])
            return [t.cpu().tolist(), dt.to_local().cpu().tolist(), dt.to_local().device.type]
        finally:
            dist.destroy_process_group()

    print("RESULTS " + json.dumps(results))
    """
)


def _env() -> dict:
    env = dict(os.environ)
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def _script(body: str) -> str:
    return PRELUDE.format(tests=str(TESTS), root=str(ROOT)) + body


def _parse(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return json.loads(lines[-1][len("RESULTS ") :])


def _run(body: str, *args: str, timeout: int = 240) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _script(body), *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return _parse(proc)


@pytest.fixture(scope="module")
def neuron():
    return _run(NEURON_SCRIPT)


@pytest.fixture(scope="module")
def tpu():
    return _run(TPU_SCRIPT)


def _ok(results: dict, name: str):
    entry = results[name]
    assert entry["ok"], f"{name}: {entry['error']}\n{entry.get('trace', '')}"
    return entry["value"]


def test_install_is_idempotent_and_once_per_process(neuron):
    _ok(neuron, "idempotent")
    assert "own process" in _ok(neuron, "second_name_refused")


def test_torch_accelerator_sees_fake(neuron):
    assert _ok(neuron, "accelerator") == ["neuron", 1, 1]


def test_registry_probe_and_resolve(neuron):
    available, reason, resolved, auto = _ok(neuron, "probe")
    assert available and reason == "" and resolved == "neuron" and auto == "neuron"


def test_rank_binds_the_runtime_core_not_the_local_rank(neuron):
    assert _ok(neuron, "bind_local_device") == ["neuron:0", "neuron:0", 0]


def test_module_to_device_matches_cpu(neuron):
    err, peak, syncs = _ok(neuron, "eager_matches_cpu")
    assert err < 1e-5
    assert peak > 0 and syncs >= 1  # registry memory/sync go through the fake's device module


def test_factories_views_inplace(neuron):
    values, device, text, from_data = _ok(neuron, "factories_views_inplace")
    assert values == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]] and from_data == [1.0, 2.0]
    assert device == "neuron:0" and "device='neuron:0'" in text


def test_device_mixing_is_refused(neuron):
    assert "same device" in _ok(neuron, "strict_device_mixing")


def test_compile_backend_neuron(neuron):
    device, err, same_shape_graphs, total_graphs = _ok(neuron, "compile_backend")
    assert device == "neuron" and err < 1e-5
    assert same_shape_graphs == 1 and total_graphs == 2  # static shapes: a new size compiles again


def test_compile_backend_refuses_dynamic_shapes(neuron):
    assert "static shapes" in _ok(neuron, "compile_refuses_dynamic")


def test_diffusers_model_on_fake_device(neuron):
    device, eager_err, regional_err = _ok(neuron, "diffusers_flux_regional")
    assert device == "neuron" and eager_err < 1e-5 and regional_err < 1e-5


def test_transformers_text_encoder_on_fake_device(neuron):
    device, err = _ok(neuron, "transformers_text_encoder")
    assert device == "neuron" and err < 1e-5


def test_process_group_and_device_mesh(neuron):
    backend, device, values, mesh_type, backends = _ok(neuron, "process_group_and_mesh")
    assert backend == "neuron" and device == "neuron" and values == [1.0] * 4
    assert mesh_type == "neuron" and "neuron_dist" in backends


def test_two_ranks_over_gloo(tmp_path):
    store = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _script(TWO_RANK_SCRIPT), str(rank), store],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        outputs.append(_parse(subprocess.CompletedProcess(p.args, p.returncode, out, err)))
    (sum0, shard0, dev0), (sum1, shard1, dev1) = (_ok(o, "two_ranks") for o in outputs)
    assert sum0 == sum1 == [3.0, 3.0]
    assert shard0 == [0.0, 1.0] and shard1 == [2.0, 3.0] and dev0 == dev1 == "neuron"


def test_fake_tpu(tpu):
    assert _ok(tpu, "probe") == [True, "tpu"]
    assert "torch.accelerator" in _ok(tpu, "is_available_raises_like_torch_tpu")
    assert _ok(tpu, "bind_local_device") == ["tpu:0", "nullcontext"]
    assert _ok(tpu, "eager_mode") == ["DEFER_AND_FUSE", "DEFER_AND_FUSE", "DEFER_NEVER", "DEFER_NEVER"]
    err, compiles, backend, mesh_type = _ok(tpu, "compile_and_mesh")
    assert err < 1e-5 and compiles == 1 and backend == "tpu_dist" and mesh_type == "tpu"
