"""engine.devices: the registry, probes (every device mocked), auto order, precision, modes, env, the
spec hooks every device answers, and a scan proving no module outside engine/devices/ tests a device name."""

from __future__ import annotations

import ast
import enum
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from engine import devices as D
from engine.devices import Availability, accelerator
from engine.devices import cpu as cpu_device
from engine.devices import mps as mps_device
from engine.devices import tpu as tpu_device
from engine.errors import DeviceUnavailable, InvalidRequest, UnsupportedCombination
from engine.protocol import Mode, Precision

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["cuda", "tpu", "neuron", "xpu", "mps", "cpu"]
# The device modules whose `probe` the tests replace (cpu is always available).
PROBES = {name: getattr(D, name) for name in ("cuda", "tpu", "neuron", "xpu", "mps")}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _only_available(monkeypatch, *names):
    """Every accelerator probe mocked: `names` available, the rest absent (cpu always is)."""
    for dev, module in PROBES.items():
        avail = Availability(True) if dev in names else Availability(False, f"{dev} mocked absent")
        monkeypatch.setattr(module, "probe", lambda avail=avail: avail)


@pytest.fixture
def no_accelerator(monkeypatch):
    """torch knows no accelerator (whatever this machine has)."""
    monkeypatch.setattr(accelerator, "registered_accelerator", lambda: None)


@pytest.fixture
def intercept_import(monkeypatch):
    """Replace importlib.import_module / find_spec for chosen module names only."""
    real_import, real_find = importlib.import_module, importlib.util.find_spec
    imports, specs = {}, {}

    def fake_import(name, package=None):
        if name in imports:
            behaviour = imports[name]
            if isinstance(behaviour, BaseException):
                raise behaviour
            return behaviour
        return real_import(name, package)

    def fake_find(name, package=None):
        if name in specs:
            return specs[name]
        return real_find(name, package)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    monkeypatch.setattr(importlib.util, "find_spec", fake_find)
    return imports, specs


@pytest.fixture
def restore_matmul_precision():
    before = torch.get_float32_matmul_precision()
    cudnn = torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(before)
    torch.backends.cudnn.allow_tf32 = cudnn


# ---------------------------------------------------------------------------------------------
# registry shape
# ---------------------------------------------------------------------------------------------


def test_registry_order_and_fields():
    reg = D.registry()
    assert list(reg) == ORDER
    expect = {
        "cuda": ("inductor", False, "nccl", "cuda"),
        "tpu": ("tpu", True, "tpu_dist", "tpu"),
        "neuron": ("neuron", True, "neuron", "neuron"),
        "xpu": ("inductor", False, "xccl", "xpu"),
        "cpu": ("inductor", False, "gloo", "cpu"),
    }
    for name, (backend, static, dist, mesh) in expect.items():
        spec = reg[name]
        assert (spec.compile_backend, spec.static_shapes, spec.dist_backend, spec.mesh_device_type) == (
            backend,
            static,
            dist,
            mesh,
        )
        assert spec.torch_device == name and spec.label
    assert reg["mps"].tensor_parallel is False
    assert "defer-and-fuse" in reg["tpu"].modes
    assert all("defer-and-fuse" not in s.modes for n, s in reg.items() if n != "tpu")


def test_get_device_unknown_lists_valid_names():
    with pytest.raises(InvalidRequest) as err:
        D.get_device("gpu")
    for name in ["auto", *ORDER]:
        assert name in str(err.value)
    assert D.get_device(" CPU ").name == "cpu"


def test_import_is_lazy():
    """Importing the module probes nothing: no vendor package imported, no CUDA init."""
    code = (
        "import sys, torch, engine.devices as d; d.registry();"
        "bad = [m for m in ('torch_neuronx', 'torch_tpu', 'diffusers') if m in sys.modules];"
        "assert not bad, bad; assert not torch.cuda.is_initialized(); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_probe_never_raises():
    def boom():
        raise RuntimeError("driver exploded")

    spec = D.DeviceSpec(
        name="x",
        label="X",
        torch_device="x",
        compile_backend="inductor",
        static_shapes=False,
        dist_backend="gloo",
        mesh_device_type="cpu",
        modes=("eager",),
        probe_fn=boom,
    )
    avail = spec.probe()
    assert not avail.available and "driver exploded" in avail.reason


# ---------------------------------------------------------------------------------------------
# availability, mocked per device
# ---------------------------------------------------------------------------------------------


def test_cpu_always_available():
    assert D.get_device("cpu").probe() == Availability(True)


def test_cuda_cpu_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    avail = D.get_device("cuda").probe()
    assert not avail.available
    assert "no CUDA or ROCm support" in avail.reason and "pytorch.org" in avail.reason
    assert D.get_device("cuda").label == "NVIDIA / AMD GPU (CUDA / ROCm)"


def test_cuda_built_but_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    avail = D.get_device("cuda").probe()
    assert not avail.available and "CUDA 12.8" in avail.reason and "nvidia-smi" in avail.reason
    assert D.get_device("cuda").label == "NVIDIA GPU (CUDA)"


def test_cuda_available(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert D.get_device("cuda").probe() == Availability(True)


def test_rocm_shows_as_cuda(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.1")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = D.get_device("cuda")
    assert spec.label == "AMD GPU (ROCm)" and spec.torch_device == "cuda"
    avail = spec.probe()
    assert "ROCm 6.4.1" in avail.reason and "rocm-smi" in avail.reason


def test_mps_not_built_and_available(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: False)
    assert "Apple silicon" in D.get_device("mps").probe().reason
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert "macOS 12.3" in D.get_device("mps").probe().reason
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert D.get_device("mps").probe().available


def test_xpu(monkeypatch):
    monkeypatch.setattr(torch.xpu, "_is_compiled", lambda: False)
    assert "whl/xpu" in D.get_device("xpu").probe().reason
    monkeypatch.setattr(torch.xpu, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert "no Intel GPU is visible" in D.get_device("xpu").probe().reason
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    assert D.get_device("xpu").probe().available


def test_neuron_not_installed(no_accelerator, intercept_import):
    imports, _ = intercept_import
    imports["torch_neuronx"] = ModuleNotFoundError("No module named 'torch_neuronx'", name="torch_neuronx")
    avail = D.get_device("neuron").probe()
    assert not avail.available
    assert "not installed" in avail.reason and "pip.repos.neuron.amazonaws.com" in avail.reason


def test_neuron_pypi_placeholder(no_accelerator, tmp_path, monkeypatch):
    """A real importable package that raises on import, like PyPI's torch-neuronx 1.0."""
    pkg = tmp_path / "torch_neuronx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'raise Exception("WRONG PACKAGE: install torch-neuronx from the Neuron repo")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.delitem(sys.modules, "torch_neuronx", raising=False)
    assert importlib.util.find_spec("torch_neuronx") is not None  # find_spec is not availability
    avail = D.get_device("neuron").probe()
    assert not avail.available
    assert "placeholder" in avail.reason and "uninstall torch-neuronx" in avail.reason
    assert "pip.repos.neuron.amazonaws.com" in avail.reason


def test_neuron_import_fails_otherwise(no_accelerator, intercept_import):
    imports, _ = intercept_import
    imports["torch_neuronx"] = OSError("libnrt.so.1: cannot open shared object file")
    avail = D.get_device("neuron").probe()
    assert not avail.available and "libnrt.so.1" in avail.reason and "OSError" in avail.reason


def test_neuron_installed_without_device(no_accelerator, intercept_import):
    imports, _ = intercept_import
    imports["torch_neuronx"] = types.ModuleType("torch_neuronx")
    avail = D.get_device("neuron").probe()
    assert not avail.available and "no NeuronCore" in avail.reason and "neuron-ls" in avail.reason


def _register_accelerator(monkeypatch, name: str, count=1):
    monkeypatch.setattr(
        torch.accelerator,
        "current_accelerator",
        lambda check_available=False: types.SimpleNamespace(type=name),
    )
    mod = types.ModuleType(f"torch.{name}")
    mod.device_count = lambda: count
    monkeypatch.setattr(torch, name, mod, raising=False)
    return mod


def test_neuron_registered_by_autoload(monkeypatch, intercept_import):
    imports, _ = intercept_import
    imports["torch_neuronx"] = AssertionError("must not import when torch already has the device")
    _register_accelerator(monkeypatch, "neuron", count=2)
    assert D.get_device("neuron").probe() == Availability(True)


def test_tpu_not_installed(no_accelerator, intercept_import):
    _, specs = intercept_import
    specs["torch_tpu"] = None
    avail = D.get_device("tpu").probe()
    assert (
        not avail.available
        and "torch_tpu is not installed" in avail.reason
        and "torch-tpu>=0.2.0" in avail.reason
    )


@pytest.mark.parametrize("autoload", ["1", "0"])
def test_tpu_installed_without_chip(no_accelerator, intercept_import, monkeypatch, autoload):
    """torch_tpu loads fine without a chip but registers nothing."""
    imports, specs = intercept_import
    specs["torch_tpu"] = importlib.machinery.ModuleSpec("torch_tpu", None)
    imports["torch_tpu"] = types.ModuleType("torch_tpu")
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", autoload)
    avail = D.get_device("tpu").probe()
    assert (
        not avail.available and "registered no tpu device" in avail.reason and "Cloud TPU VM" in avail.reason
    )


def test_tpu_available_without_calling_is_available(monkeypatch):
    """torch.tpu.is_available() raises on torch >= 2.11: the probe must use torch.accelerator."""
    mod = _register_accelerator(monkeypatch, "tpu", count=4)

    def raising():
        raise RuntimeError("use torch.accelerator.is_available")

    mod.is_available = raising
    assert D.get_device("tpu").probe() == Availability(True)


def test_registered_but_zero_devices(monkeypatch):
    _register_accelerator(monkeypatch, "tpu", count=0)
    avail = D.get_device("tpu").probe()
    assert not avail.available and "no devices" in avail.reason


# ---------------------------------------------------------------------------------------------
# auto / resolve
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("i", range(len(ORDER)))
def test_auto_picks_best_available(monkeypatch, i):
    # ORDER[i:] are available, so ORDER[i] is the best of them.
    _only_available(monkeypatch, *ORDER[i:])
    assert D.resolve_device("auto").name == ORDER[i]
    report = D.devices_report()
    assert [r["name"] for r in report if r["auto"]] == [ORDER[i]]


def test_auto_skips_absent_better_devices(monkeypatch):
    _only_available(monkeypatch, "neuron", "mps")
    assert D.resolve_device("AUTO").name == "neuron"
    assert D.get_device("auto").name == "neuron"


def test_resolve_absent_device_raises_with_reason(monkeypatch):
    _only_available(monkeypatch)
    with pytest.raises(DeviceUnavailable, match="cuda mocked absent"):
        D.resolve_device("cuda")
    with pytest.raises(InvalidRequest):
        D.resolve_device("quantum")
    assert D.resolve_device("cpu").name == "cpu"


# ---------------------------------------------------------------------------------------------
# precision
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def cuda_gpu(monkeypatch):
    """A mocked NVIDIA GPU; returns a setter for capability / bf16 support."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Tesla T4")
    state = {"cap": (8, 0), "bf16": True}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: state["cap"])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: state["bf16"])
    return state


def test_precision_dtypes():
    cpu = D.get_device("cpu")
    assert D.plan_precision(cpu, "fp32").dtype == torch.float32
    assert D.plan_precision(cpu, "bf16").dtype == torch.bfloat16
    assert D.plan_precision(cpu, "fp16").dtype == torch.float16
    with pytest.raises(InvalidRequest, match="fp32, tf32, bf16, fp16"):
        D.plan_precision(cpu, "int4")


def test_cpu_tf32_downgrades_with_notice():
    plan = D.plan_precision(D.get_device("cpu"), "tf32")
    assert plan.precision == "fp32" and plan.requested == "tf32" and plan.downgraded
    assert plan.dtype == torch.float32 and not plan.allow_tf32
    assert plan.notices and "TF32" in plan.notices[0]
    fp16 = D.plan_precision(D.get_device("cpu"), "fp16")
    assert fp16.precision == "fp16" and "slower" in fp16.notices[0]
    assert not D.plan_precision(D.get_device("cpu"), "bf16").notices


def test_cuda_tf32_needs_ampere(cuda_gpu):
    cuda = D.get_device("cuda")
    cuda_gpu["cap"] = (8, 6)
    plan = D.plan_precision(cuda, "tf32")
    assert plan.precision == "tf32" and plan.allow_tf32 and plan.dtype == torch.float32 and not plan.notices
    cuda_gpu["cap"] = (7, 5)
    plan = D.plan_precision(cuda, "tf32")
    assert plan.precision == "fp32" and not plan.allow_tf32 and "sm_75" in plan.notices[0]


def test_cuda_bf16_refused_without_native_support(cuda_gpu):
    cuda_gpu["bf16"] = False
    with pytest.raises(UnsupportedCombination) as err:
        D.plan_precision(D.get_device("cuda"), "bf16")
    assert "Tesla T4" in str(err.value) and "fp16 or fp32" in str(err.value)
    assert D.plan_precision(D.get_device("cuda"), "fp16").precision == "fp16"


@pytest.mark.parametrize("arch,allowed", [("gfx942:sramecc+:xnack-", True), ("gfx90a", False)])
def test_rocm_tf32(monkeypatch, arch, allowed):
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "AMD Instinct")
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i=None: types.SimpleNamespace(gcnArchName=arch)
    )
    plan = D.plan_precision(D.get_device("cuda"), "tf32")
    assert plan.allow_tf32 is allowed
    assert bool(plan.notices) is not allowed


def test_mps_precision(monkeypatch):
    mps = D.get_device("mps")
    assert D.plan_precision(mps, "tf32").precision == "fp32"
    monkeypatch.setattr(mps_device, "bf16_ok", lambda: False)
    with pytest.raises(UnsupportedCombination, match="macOS 14"):
        D.plan_precision(mps, "bf16")
    monkeypatch.setattr(mps_device, "bf16_ok", lambda: True)
    assert D.plan_precision(mps, "bf16").dtype == torch.bfloat16
    assert D.plan_precision(mps, "fp16").precision == "fp16"


def test_xpu_precision(monkeypatch):
    xpu = D.get_device("xpu")
    monkeypatch.setattr(torch.xpu, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(UnsupportedCombination, match="fp16 or fp32"):
        D.plan_precision(xpu, "bf16")
    assert D.plan_precision(xpu, "tf32").allow_tf32


def test_neuron_precision():
    neuron = D.get_device("neuron")
    assert D.plan_precision(neuron, "tf32").precision == "fp32"
    for p in ("fp32", "bf16", "fp16"):
        assert D.plan_precision(neuron, p).precision == p


def test_tpu_precision():
    tpu = D.get_device("tpu")
    with pytest.raises(UnsupportedCombination) as err:
        D.plan_precision(tpu, "fp16")
    assert "bf16 or fp32" in str(err.value) and "tpu" in str(err.value)
    plan = D.plan_precision(tpu, "tf32")
    assert plan.precision == "fp32" and plan.notices
    assert D.plan_precision(tpu, "bf16").dtype == torch.bfloat16


def test_apply_precision(restore_matmul_precision):
    cpu = D.get_device("cpu")
    D.apply_precision(D.make_plan("tf32"))
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    D.apply_precision(D.plan_precision(cpu, "tf32"))  # downgraded: fp32 everywhere
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    D.apply_precision(D.plan_precision(cpu, "bf16"))
    # Reading every flag back must not raise torch's "mix of the legacy and new APIs" error.
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"


def test_precision_support_table():
    table = D.precision_support(D.get_device("tpu"))
    assert table["fp16"]["status"] == "refused"
    assert table["tf32"] == {
        "status": "downgraded",
        "runs_as": "fp32",
        "notices": ["TPUs have no TF32: running fp32."],
    }
    assert table["bf16"]["status"] == "ok"
    assert set(table) == set(Precision)


# ---------------------------------------------------------------------------------------------
# modes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cpu", "cuda", "mps", "xpu", "neuron"])
def test_defer_and_fuse_only_on_tpu(name):
    with pytest.raises(UnsupportedCombination, match="only on tpu"):
        D.check_mode(D.get_device(name), "defer-and-fuse")


def test_modes():
    tpu, neuron = D.get_device("tpu"), D.get_device("neuron")
    assert "whole worker process" in D.check_mode(tpu, "defer-and-fuse")[0]
    assert "static shapes" in D.check_mode(neuron, "compile")[0]
    assert "static shapes" in D.check_mode(tpu, "regional")[0]
    assert D.check_mode(neuron, "eager") == ()
    assert "prototype" in D.check_mode(D.get_device("mps"), "compile")[0]
    with pytest.raises(InvalidRequest, match="eager, compile, regional, defer-and-fuse"):
        D.check_mode(tpu, "turbo")
    for spec in D.registry().values():
        for mode in spec.modes:
            assert isinstance(mode, Mode)
            assert isinstance(D.check_mode(spec, mode), tuple)


def test_cpu_compile_without_compiler_warns(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(cpu_device.shutil, "which", lambda name: None)
    notes = D.check_mode(D.get_device("cpu"), "compile")
    assert notes and "C++ compiler" in notes[0]
    assert D.check_mode(D.get_device("cpu"), "eager") == ()


# ---------------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------------


def test_environment_defaults(tmp_path):
    assert D.get_device("cpu").environment(tmp_path) == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")
    }
    assert D.get_device("cuda").environment(tmp_path) == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")
    }
    assert D.get_device("neuron").environment(tmp_path) == {
        "TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "neff")
    }
    tpu = D.get_device("tpu")
    assert tpu.environment(tmp_path) == {}
    assert tpu.environment(tmp_path, mode="defer-and-fuse") == {"TORCH_TPU_DEFER_AND_FUSE": "1"}
    assert (
        tpu.mode_environment("eager") == {}
        and D.get_device("cpu").mode_environment("defer-and-fuse") == {}
    )


def test_apply_environment_keeps_user_values(tmp_path, monkeypatch):
    import tempfile

    # apply_environment points TMPDIR into the cache folder: restored after (a later Ray cluster in this
    # process put its sockets under this test's folder, past AF_UNIX's 107-byte limit)
    monkeypatch.setenv("TMPDIR", os.environ.get("TMPDIR", tempfile.gettempdir()))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", "x")  # so teardown removes what the test sets
    monkeypatch.delenv("TORCH_NEURONX_NEFF_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert D.apply_environment(D.get_device("cpu"), tmp_path) == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")
    }
    in_force = D.apply_environment(D.get_device("neuron"), tmp_path)
    assert in_force == {"TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "neff")}
    assert os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(tmp_path / "neff")
    assert (tmp_path / "neff").is_dir() and (tmp_path / "mine").is_dir()


def test_worker_environment(tmp_path):
    tpu, cpu = D.get_device("tpu"), D.get_device("cpu")
    base = {"PATH": "/bin", "TORCH_TPU_DEFER_AND_FUSE": "0"}
    env = D.worker_environment(tpu, tmp_path, "defer-and-fuse", base=base)
    assert env["TORCH_TPU_DEFER_AND_FUSE"] == "1" and env["PATH"] == "/bin"
    base = {"TORCH_TPU_DEFER_AND_FUSE": "1"}
    assert "TORCH_TPU_DEFER_AND_FUSE" not in D.worker_environment(tpu, tmp_path, "eager", base=base)
    env = D.worker_environment(cpu, tmp_path, "compile", base={"TORCHINDUCTOR_CACHE_DIR": "/x"})
    assert env == {"TORCHINDUCTOR_CACHE_DIR": "/x", "TMPDIR": str(tmp_path / "tmp")}  # temp files in the cache


def test_enter_eager_mode(monkeypatch):
    class EagerMode(enum.Enum):
        DEFER_NEVER = 0
        DEFER_AND_FUSE = 1

    tpu_mod = types.ModuleType("torch.tpu")
    tpu_mod.EagerMode, tpu_mod.eager_mode = EagerMode, EagerMode.DEFER_NEVER
    monkeypatch.setattr(torch, "tpu", tpu_mod, raising=False)
    tpu = D.get_device("tpu")
    assert D.enter_eager_mode(D.get_device("cpu"), "defer-and-fuse") is None
    assert D.enter_eager_mode(tpu, "compile") is None
    assert D.enter_eager_mode(tpu, "defer-and-fuse") == "DEFER_AND_FUSE"
    assert tpu_mod.eager_mode is EagerMode.DEFER_AND_FUSE
    assert D.enter_eager_mode(tpu, "eager") == "DEFER_NEVER"
    assert tpu_mod.eager_mode is EagerMode.DEFER_NEVER


def test_enter_eager_mode_context_manager_only(monkeypatch):
    """When only `with torch.tpu.set_eager_mode(mode)` exists, the entered manager is kept alive."""
    import contextlib

    class EagerMode(enum.Enum):
        DEFER_NEVER = 0
        DEFER_AND_FUSE = 1

    current = {"mode": EagerMode.DEFER_NEVER}

    @contextlib.contextmanager
    def set_eager_mode(mode):
        old, current["mode"] = current["mode"], mode
        try:
            yield
        finally:
            current["mode"] = old

    tpu_mod = types.ModuleType("torch.tpu")
    tpu_mod.EagerMode, tpu_mod.set_eager_mode = EagerMode, set_eager_mode
    monkeypatch.setattr(torch, "tpu", tpu_mod, raising=False)
    monkeypatch.setattr(tpu_device, "_ACTIVE_EAGER_MODE", [])
    D.enter_eager_mode(D.get_device("tpu"), "defer-and-fuse")
    import gc

    gc.collect()
    assert current["mode"] is EagerMode.DEFER_AND_FUSE
    D.enter_eager_mode(D.get_device("tpu"), "eager")
    assert current["mode"] is EagerMode.DEFER_NEVER


def test_enter_eager_mode_without_api(monkeypatch):
    monkeypatch.setattr(torch, "tpu", types.ModuleType("torch.tpu"), raising=False)
    with pytest.raises(UnsupportedCombination, match="TORCH_TPU_DEFER_AND_FUSE=1"):
        D.enter_eager_mode(D.get_device("tpu"), "defer-and-fuse")


# ---------------------------------------------------------------------------------------------
# memory, sync, report
# ---------------------------------------------------------------------------------------------


def test_cpu_memory_and_sync():
    cpu = D.get_device("cpu")
    assert cpu.synchronize() is None  # nothing queued on cpu: returns at once, touches no accelerator
    cpu.reset_peak_memory()
    peak = cpu.peak_memory_bytes()
    assert isinstance(peak, int) and peak > 0
    assert "RSS" in D.describe_device(cpu)["memory"]


def test_memory_where_device_reports_nothing(monkeypatch):
    monkeypatch.setattr(accelerator, "registered_accelerator", lambda: None)
    monkeypatch.delattr(torch, "neuron", raising=False)
    neuron = D.get_device("neuron")
    neuron.reset_peak_memory()
    assert neuron.peak_memory_bytes() is None


def test_memory_through_device_module(monkeypatch):
    mod = _register_accelerator(monkeypatch, "neuron")
    calls = []
    mod.synchronize = lambda: calls.append("sync")
    mod.reset_peak_memory_stats = lambda: calls.append("reset")
    mod.max_memory_allocated = lambda: 1234
    spec = D.get_device("neuron")
    spec.synchronize()
    spec.reset_peak_memory()
    assert spec.peak_memory_bytes() == 1234 and calls == ["sync", "reset"]
    mod.max_memory_allocated = lambda: (_ for _ in ()).throw(RuntimeError("no stats"))
    assert spec.peak_memory_bytes() is None  # best effort, never raises


def test_devices_report_is_json(monkeypatch):
    _only_available(monkeypatch)
    report = D.devices_report()
    text = json.dumps(report)
    assert [r["name"] for r in json.loads(text)] == ORDER
    for row in report:
        assert set(row) >= {
            "name",
            "label",
            "torch_device",
            "compile_backend",
            "static_shapes",
            "dist_backend",
            "mesh_device_type",
            "modes",
            "available",
            "reason",
            "memory",
            "environment",
            "precisions",
            "auto",
        }
        assert row["available"] or row["reason"]
    cpu = report[-1]
    assert cpu["available"] and cpu["auto"] and cpu["precisions"]["tf32"]["status"] == "downgraded"


def test_devices_report_real_machine():
    """Unmocked: whatever this machine has, the report is JSON and cpu is there."""
    report = json.loads(json.dumps(D.devices_report()))
    assert report[-1]["name"] == "cpu" and report[-1]["available"]
    assert sum(r["auto"] for r in report) == 1


# ---------------------------------------------------------------------------------------------
# spec hooks: what other modules used to ask by device name
# ---------------------------------------------------------------------------------------------


def test_every_device_module_builds_its_own_spec():
    for name in ORDER:
        module = getattr(D, name)
        assert module.NAME == name and module.spec().name == name
    assert not (ROOT / "engine" / "devices.py").exists()  # the package replaced the module


def test_cpu_binds_every_rank_to_the_one_cpu(monkeypatch):
    def boom(*a):
        raise AssertionError("cpu must not select an accelerator index")

    monkeypatch.setattr(torch.accelerator, "set_device_index", boom)
    cpu = D.get_device("cpu")
    assert cpu.bind_local_device(0) == cpu.bind_local_device(5) == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "xpu"])
def test_gpus_bind_the_device_of_their_local_rank(monkeypatch, name):
    calls = []
    monkeypatch.setattr(getattr(torch, name), "set_device", calls.append)
    assert D.get_device(name).bind_local_device(3) == torch.device(name, 3)
    assert calls == [3]


def test_bind_without_a_device_module_set_device_uses_torch_accelerator(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.accelerator, "set_device_index", calls.append)
    assert not hasattr(torch.mps, "set_device")
    assert D.get_device("mps").bind_local_device(1) == torch.device("mps", 1)
    assert calls == [1]


@pytest.mark.parametrize("name", ["neuron", "tpu"])
def test_runtime_assigned_devices_ignore_the_local_rank(monkeypatch, name):
    """The Neuron / TPU runtime gives each process its core: the local rank must not select one."""
    mod = _register_accelerator(monkeypatch, name)
    assigned = torch.device("privateuseone", 2)  # what the runtime made current for this process
    calls = []
    mod.current_device = lambda: assigned
    mod.set_device = calls.append
    assert D.get_device(name).bind_local_device(5) == assigned
    assert calls == []


def test_runtime_assigned_device_falls_back_to_torch_accelerator(monkeypatch):
    mod = _register_accelerator(monkeypatch, "neuron")  # no current_device on the module
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: torch.device("privateuseone", 1))
    assert not hasattr(mod, "current_device")
    assert D.get_device("neuron").bind_local_device(0) == torch.device("privateuseone", 1)


def test_cpu_tp_load_context_fills_diffusers_gaps_and_restores_them():
    import diffusers.hooks.tensor_parallel as tp_hooks

    allowed, device_count = tp_hooks._SUPPORTED_TP_DEVICES, torch.accelerator.device_count
    assert "cpu" not in allowed  # else diffusers fixed it and the adjustment can go
    cpu = D.get_device("cpu")
    with cpu.tp_load_context():
        assert "cpu" in tp_hooks._SUPPORTED_TP_DEVICES and set(allowed) < set(tp_hooks._SUPPORTED_TP_DEVICES)
        assert torch.accelerator.device_count() >= 1  # diffusers computes rank % device_count()
    assert tp_hooks._SUPPORTED_TP_DEVICES is allowed and torch.accelerator.device_count is device_count
    with pytest.raises(RuntimeError, match="load failed"), cpu.tp_load_context():
        raise RuntimeError("load failed")
    assert tp_hooks._SUPPORTED_TP_DEVICES is allowed and torch.accelerator.device_count is device_count


@pytest.mark.parametrize("name", [n for n in ORDER if n != "cpu"])
def test_tp_load_context_changes_nothing_on_other_devices(name):
    import diffusers.hooks.tensor_parallel as tp_hooks

    allowed, device_count = tp_hooks._SUPPORTED_TP_DEVICES, torch.accelerator.device_count
    with D.get_device(name).tp_load_context():
        assert tp_hooks._SUPPORTED_TP_DEVICES is allowed and torch.accelerator.device_count is device_count


def test_environment_is_data_on_the_spec(tmp_path):
    reg = D.registry()
    assert reg["neuron"].cache_env == ((D.NEFF_CACHE_VAR, "neff"),)
    assert all(spec.cache_env == ((D.INDUCTOR_CACHE_VAR, "inductor"),) for spec in reg.values()
               if spec.compile_backend == "inductor")
    assert reg["tpu"].mode_env == ((Mode.DEFER_AND_FUSE, D.TPU_DEFER_AND_FUSE_VAR, "1"),)
    assert [n for n, spec in reg.items() if spec.mode_env] == ["tpu"]
    # A spec built by hand gets exactly what its data says, whatever its name.
    fake = D.DeviceSpec(name="x", label="X", torch_device="x", compile_backend="x", static_shapes=True,
                        dist_backend="", mesh_device_type="", modes=(Mode.EAGER,),
                        cache_env=(("X_CACHE_DIR", "x"),), mode_env=((Mode.EAGER, "X_STRICT", "1"),))
    assert fake.environment(tmp_path) == {"X_CACHE_DIR": str(tmp_path / "x")}
    assert D.worker_environment(fake, tmp_path, Mode.EAGER, base={}) == {
        "X_CACHE_DIR": str(tmp_path / "x"), "X_STRICT": "1", "TMPDIR": str(tmp_path / "tmp")}
    assert "X_STRICT" not in D.worker_environment(fake, tmp_path, Mode.COMPILE, base={"X_STRICT": "1"})


@pytest.mark.parametrize("name", [n for n in ORDER if n != "tpu"])
def test_only_tpu_has_an_eager_mode_switch(monkeypatch, name):
    tpu_mod = types.ModuleType("torch.tpu")  # even with a torch.tpu around, other devices switch nothing
    monkeypatch.setattr(torch, "tpu", tpu_mod, raising=False)
    assert D.get_device(name).eager_mode_fn is None
    assert D.enter_eager_mode(D.get_device(name), Mode.DEFER_AND_FUSE) is None
    assert D.get_device("tpu").eager_mode_fn is not None


def test_mode_refusal_hint_is_data(monkeypatch):
    assert set(D.MODE_HINTS) <= set(Mode)
    monkeypatch.setitem(D.MODE_HINTS, Mode.REGIONAL, ("a test mode", "eager"))
    bare = D.DeviceSpec(name="x", label="X", torch_device="x", compile_backend="x", static_shapes=True,
                        dist_backend="", mesh_device_type="", modes=(Mode.EAGER,))
    with pytest.raises(UnsupportedCombination, match=r"regional is a test mode and exists only on "
                       r"cuda, tpu, neuron, xpu, mps, cpu; on x use eager"):
        D.check_mode(bare, Mode.REGIONAL)
    with pytest.raises(UnsupportedCombination, match="x runs only eager"):
        D.check_mode(bare, Mode.COMPILE)


# ---------------------------------------------------------------------------------------------
# no device name tested outside engine/devices/
# ---------------------------------------------------------------------------------------------

# Sources that may not branch on a device: everything but the devices package itself.
SCANNED = [ROOT / "app.py", *sorted((ROOT / "engine").rglob("*.py")), *sorted((ROOT / "ui").rglob("*.py"))]
DEVICE_PACKAGE = ROOT / "engine" / "devices"
# Files whose device branches another change removes. An entry must still have findings: once its file
# is clean, the test below says to drop it, so the exemption cannot outlive its reason.
PENDING: set[str] = set()  # files still allowed to test device names while they are being moved
DEVICE_NAMES = frozenset(D.registry())


def _device_literal(node: ast.AST) -> bool:
    """A string naming a device ("cuda", "cuda:0") or a tuple/list/set holding one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0].strip().lower() in DEVICE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_device_literal(e) for e in node.elts)
    return False


def _is_torch(node: ast.AST) -> bool:
    """`torch` or `torch.backends` (where device modules and backends hang)."""
    if isinstance(node, ast.Name):
        return node.id == "torch"
    return isinstance(node, ast.Attribute) and node.attr == "backends" and _is_torch(node.value)


def device_name_tests(source: str) -> list[str]:
    """Where `source` tests a device name or reaches a device's module by name.

    Comparisons and match cases against a device-name literal (`spec.name == "cuda"`, `spec.torch_device
    != "cpu"`, `spec.name in ("neuron", "tpu")`), str.startswith/endswith with one, getattr/hasattr on
    torch with a computed or device name (`getattr(torch, spec.name)`), torch.get_device_module, and
    `torch.<device>` / `torch.backends.<device>` attributes.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        hit = False
        if isinstance(node, ast.Compare):
            hit = any(_device_literal(o) for o in (node.left, *node.comparators))
        elif isinstance(node, ast.MatchValue):
            hit = _device_literal(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("startswith", "endswith"):
                hit = any(_device_literal(a) for a in node.args)
            elif node.func.attr == "get_device_module":
                hit = _is_torch(node.func.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            if len(node.args) >= 2 and _is_torch(node.args[0]):
                attr = node.args[1]
                hit = not (isinstance(attr, ast.Constant) and isinstance(attr.value, str)) or _device_literal(attr)
        elif isinstance(node, ast.Attribute):
            hit = node.attr in DEVICE_NAMES and _is_torch(node.value)
        if hit:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize(
    "code",
    [
        'spec.name == "cuda"',
        '"tpu" != spec.name',
        'spec.name in ("neuron", "tpu")',
        'spec.name not in {"mps"}',
        'if spec.torch_device == "cpu": pass',
        'device.type == "cuda:0"',
        'spec.torch_device.startswith("cuda")',
        "getattr(torch, spec.name, None)",
        'getattr(torch, "tpu", None)',
        'hasattr(torch.backends, "mps")',
        "torch.get_device_module(spec.torch_device)",
        "torch.cuda.synchronize()",
        "torch.backends.mps.is_available()",
        'match spec.name:\n    case "tpu":\n        pass',
    ],
)
def test_scan_finds_device_name_tests(code):
    assert device_name_tests(code), code


@pytest.mark.parametrize(
    "code",
    [
        'torch.Generator("cpu").manual_seed(0)',
        "x.cpu()",
        'f"{spec.name} ran out of memory"',
        'getattr(torch, "float16")',
        'mode == "compile"',
        'spec.compile_backend == "inductor"',
        "preset.options.get(spec.name, {})",
        "spec.bind_local_device(local_rank)",
    ],
)
def test_scan_leaves_device_generic_code_alone(code):
    assert device_name_tests(code) == [], code


def test_no_device_name_is_tested_outside_engine_devices():
    offenders, pending_clean = {}, []
    scanned = [p for p in SCANNED if DEVICE_PACKAGE not in p.parents]
    assert len(scanned) >= 20 and ROOT / "engine" / "tp" / "group.py" in scanned  # the scan covers the engine
    for path in scanned:
        rel = path.relative_to(ROOT).as_posix()
        found = device_name_tests(path.read_text())
        if rel in PENDING:
            if not found:
                pending_clean.append(rel)
        elif found:
            offenders[rel] = found
    assert not offenders, (
        "device names tested outside engine/devices/ (make the difference a field or hook of DeviceSpec): "
        + json.dumps(offenders, indent=1)
    )
    assert not pending_clean, f"{pending_clean} no longer test device names: remove them from PENDING"
