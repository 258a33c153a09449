"""A fake PrivateUse1 accelerator ("neuron" or "tpu") backed by CPU memory, for tests without hardware.

    from fake_device import install_fake_device
    mod = install_fake_device("neuron")      # once per process, before any other PrivateUse1 use
    model.to("neuron"); torch.compile(model, backend="neuron", dynamic=False)
    dist.init_process_group("neuron", ...); DeviceMesh("neuron", [0])

What it is:

* torch's Python PrivateUse1 registration (`_setup_privateuseone_for_python_backend`: rename,
  device module, hooks, device guard), so `torch.device("neuron")`, `torch.neuron`,
  `torch.accelerator.current_accelerator()` and `torch.get_device_module("neuron")` all work.
* `FakeDeviceTensor`: a wrapper tensor subclass whose `.device` is `neuron:0` and which holds a
  CPU tensor. `__torch_dispatch__` runs every aten op on the CPU tensors and wraps the results, so
  views alias, in-place ops mutate, and `nn.Parameter`/`module.to()` work. It is a *traceable*
  subclass (`__tensor_flatten__`), so torch.compile (Dynamo + AOTAutograd) handles it.
* Python kernels for the factory ops (`empty.memory_format`, `empty_strided`) registered for the
  PrivateUse1 dispatch key, so `torch.zeros(..., device="neuron")` and `cpu_tensor.to("neuron")`
  create fake-device tensors, and for `_copy_from` (`torch.tensor(data, device="neuron")` copies
  through the backend with the Python key excluded).
* A torch.compile backend under the device name (aot_eager underneath) that, like the real
  Neuron/TPU backends, refuses dynamic shapes, and counts compiles (`mod.compile_count`).
* A process-group backend ("neuron" and "neuron_dist" for neuron, "tpu_dist" for tpu) that is
  gloo: collectives on fake tensors reach gloo with their CPU tensors through `__torch_dispatch__`.
* Device-module memory stats (bytes of live fake-device storages, with a resettable peak) and a
  synchronize counter, so code reading `torch.<device>.max_memory_allocated()` gets real numbers.
* Strict devices: an op mixing a fake-device tensor with a non-scalar CPU tensor raises
  "Expected all tensors to be on the same device", as a real accelerator would.

For "tpu" it also mimics torch_tpu: `torch.tpu.is_available()` called from user code raises (as
on torch >= 2.11; torch's own callers such as torch.accelerator.is_available() and Dynamo still get
an answer, or nothing could compile), and `torch.tpu.EagerMode` / `eager_mode` / `set_eager_mode`
exist (TORCH_TPU_DEFER_AND_FUSE=1 at install time starts it in DEFER_AND_FUSE).

Limits: the rename of PrivateUse1 works once per process (a second name raises), so every fake
device needs its own process; no `torch.Generator("neuron")` (needs C++ hooks: use CPU
generators); no autocast for the device; `.numpy()`/`data_ptr()` on fake tensors fail (as they
would on a real accelerator); `torch.accelerator.synchronize()` and the torch.accelerator memory
functions raise (they need a C++ allocator/stream guard) -- use the device module
(`torch.neuron.synchronize()`), which is what engine.devices does.
"""

from __future__ import annotations

import contextlib
import enum
import os
import sys
import threading
import types
import weakref

# torch_tpu (if installed) autoloads with `import torch` and would claim PrivateUse1 itself.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

_INSTALLED: dict[str, types.ModuleType] = {}
_LOCK = threading.Lock()

# Ops that may legitimately mix a device tensor with a CPU tensor (copies, CPU indices).
_MIXING_OK = {
    "aten::copy_",
    "aten::_copy_from",
    "aten::_copy_from_and_resize",
    "aten::_to_copy",
    "aten::index.Tensor",
    "aten::index_put_",
    "aten::index_put",
    "aten::_index_put_impl_",
    "aten::set_",
    "aten::lift_fresh",
}

DIST_BACKENDS = {"neuron": ("neuron", "neuron_dist"), "tpu": ("tpu_dist",)}


class _Memory:
    """Bytes held by live fake-device storages (shared by views), with a resettable peak."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, wrappers alive]
        self.allocated = 0
        self.peak = 0

    def track(self, wrapper: torch.Tensor, elem: torch.Tensor) -> None:
        try:
            storage = elem.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except Exception:  # fake/functional tensors inside torch.compile have no real storage
            return
        if not key or not nbytes:
            return
        with self.lock:
            entry = self.live.get(key)
            if entry is None:
                self.live[key] = [nbytes, 1]
                self.allocated += nbytes
                self.peak = max(self.peak, self.allocated)
            else:
                entry[1] += 1
        # On the CPU tensor, not the wrapper: a weakref on the wrapper would make
        # torch.utils.swap_tensors (used by module.to() for subclasses) refuse to swap it.
        weakref.finalize(elem, self.release, key)

    def release(self, key: int) -> None:
        with self.lock:
            entry = self.live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                del self.live[key]
                self.allocated -= entry[0]

    def reset_peak(self) -> None:
        with self.lock:
            self.peak = self.allocated


def _make_tensor_class(name: str, memory: _Memory, strict: bool):
    device = torch.device(name, 0)

    class FakeDeviceTensor(torch.Tensor):
        """A `name:0` tensor holding a CPU tensor `_elem`."""

        _elem: torch.Tensor

        @staticmethod
        def __new__(cls, elem: torch.Tensor):
            if isinstance(elem, FakeDeviceTensor):
                return elem
            out = torch.Tensor._make_wrapper_subclass(
                cls,
                elem.size(),
                strides=elem.stride(),
                storage_offset=elem.storage_offset(),
                dtype=elem.dtype,
                layout=elem.layout,
                device=device,
                requires_grad=elem.requires_grad,
            )
            out._elem = elem
            memory.track(out, elem)
            return out

        def __repr__(self, *, tensor_contents=None):
            text = repr(self._elem)
            return text[:-1] + f", device='{device}')" if text.endswith(")") else text

        # Traceable wrapper subclass: lets Dynamo/AOTAutograd see through to the CPU tensor.
        def __tensor_flatten__(self):
            return ["_elem"], None

        @staticmethod
        def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
            return FakeDeviceTensor(inner["_elem"])

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return run_on_cpu(func, args, kwargs or {})

    aten = torch.ops.aten
    copy_ops = {aten._copy_from.default, aten._copy_from_and_resize.default}

    def run_on_cpu(func, args, kwargs):
        """Run `func` on the CPU tensors behind every fake-device tensor; wrap what comes back."""
        originals: dict[int, object] = {}  # id(what the CPU op sees) -> what the caller passed
        seen_fake = False
        cpu_operands: list[torch.Tensor] = []

        def unwrap(x):
            nonlocal seen_fake
            if isinstance(x, FakeDeviceTensor):
                seen_fake = True
                originals[id(x._elem)] = x
                return x._elem
            if isinstance(x, torch.Tensor):
                if x.device.type == name:
                    # A plain tensor on this device only exists inside torch.compile tracing
                    # (fake tensors from factory calls); move it explicitly so the graph stays
                    # correct when it runs for real.
                    return x.to("cpu")
                originals[id(x)] = x
                if x.dim() > 0:
                    cpu_operands.append(x)
                return x
            if isinstance(x, torch.device) and x.type == name:
                return torch.device("cpu")
            return x

        cpu_args = tree_map(unwrap, args)
        cpu_kwargs = tree_map(unwrap, kwargs)
        op_name = func._schema.name
        if (
            strict
            and seen_fake
            and cpu_operands
            and op_name not in _MIXING_OK
            and not op_name.startswith("c10d::")
        ):
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"{device} and cpu! (fake device, op {func})"
            )
        if func in copy_ops:  # device-copy primitives have no CPU kernel: they are a copy_
            src, dst = cpu_args[0], cpu_args[1]
            if func is aten._copy_from_and_resize.default:
                dst.resize_(src.shape)
            dst.copy_(src)
            return args[1]
        out = func(*cpu_args, **cpu_kwargs)

        target = kwargs.get("device")
        to_device = target is None or torch.device(target).type == name

        def wrap(x):
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) in originals:  # in-place / out= result: hand back the caller's object
                return originals[id(x)]
            if to_device and x.device.type == "cpu" and not isinstance(x, FakeDeviceTensor):
                return FakeDeviceTensor(x)
            return x

        return tree_map(wrap, out)

    FakeDeviceTensor.run_on_cpu = staticmethod(run_on_cpu)

    FakeDeviceTensor.__name__ = FakeDeviceTensor.__qualname__ = f"Fake{name.capitalize()}Tensor"
    return FakeDeviceTensor


def _make_device_module(name: str, memory: _Memory, device_count: int) -> types.ModuleType:
    mod = types.ModuleType(f"torch.{name}")
    mod.__doc__ = f"Fake torch.{name} device module (tests/fake_device.py)."
    state = {"device": 0, "syncs": 0}

    def is_available() -> bool:
        return device_count > 0

    if name == "tpu":
        # torch_tpu on torch >= 2.11: user code calling torch.tpu.is_available() gets an error
        # pointing to torch.accelerator. torch itself (torch.accelerator.is_available(), Dynamo)
        # still gets an answer, or torch.compile could not run at all.
        def is_available() -> bool:  # noqa: F811
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller == "torch" or caller.startswith("torch."):
                return device_count > 0
            raise RuntimeError("torch.tpu.is_available() is deprecated: use torch.accelerator.is_available()")

    def synchronize(device=None) -> None:
        state["syncs"] += 1

    def set_device(index) -> None:
        index = index.index if isinstance(index, torch.device) else int(index)
        if not 0 <= index < device_count:
            raise RuntimeError(f"invalid {name} device index {index}")
        state["device"] = index

    funcs = {
        "is_available": is_available,
        "is_initialized": lambda: True,
        "_is_in_bad_fork": lambda: False,
        "_lazy_init": lambda: None,
        "init": lambda: None,
        "device_count": lambda: device_count,
        "current_device": lambda: state["device"],
        "set_device": set_device,
        "get_device_name": lambda device=None: f"Fake {name} device",
        "synchronize": synchronize,
        "sync_count": lambda: state["syncs"],
        "memory_allocated": lambda device=None: memory.allocated,
        "max_memory_allocated": lambda device=None: memory.peak,
        "memory_reserved": lambda device=None: memory.allocated,
        "max_memory_reserved": lambda device=None: memory.peak,
        "reset_peak_memory_stats": lambda device=None: memory.reset_peak(),
        "reset_max_memory_allocated": lambda device=None: memory.reset_peak(),
        "empty_cache": lambda: None,
        "manual_seed": lambda seed: None,  # fake tensors draw from the CPU generator
        "manual_seed_all": lambda seed: None,
        "seed": lambda: None,
        "seed_all": lambda: None,
        "initial_seed": lambda: torch.initial_seed(),
        "is_bf16_supported": lambda *a, **k: True,
        "get_amp_supported_dtype": lambda: [torch.float16, torch.bfloat16],
    }
    for key, fn in funcs.items():
        setattr(mod, key, fn)
    mod.memory = memory
    mod.compile_count = 0
    mod.compiled_graphs = []  # number of FX nodes of each graph the backend compiled

    if name == "tpu":

        class EagerMode(enum.Enum):
            DEFER_NEVER = "DEFER_NEVER"
            DEFER_AND_FUSE = "DEFER_AND_FUSE"

        mod.EagerMode = EagerMode
        start = os.environ.get("TORCH_TPU_DEFER_AND_FUSE", "0") not in ("", "0")
        mod.eager_mode = EagerMode.DEFER_AND_FUSE if start else EagerMode.DEFER_NEVER

        @contextlib.contextmanager
        def set_eager_mode(mode):
            old, mod.eager_mode = mod.eager_mode, mode
            try:
                yield
            finally:
                mod.eager_mode = old

        mod.set_eager_mode = set_eager_mode
    return mod


def _register_factories(name: str, tensor_cls, lib) -> None:
    def empty_memory_format(
        size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None
    ):
        return tensor_cls(torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format))

    def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
        return tensor_cls(torch.empty_strided(size, stride, dtype=dtype, layout=layout))

    lib.impl("empty.memory_format", empty_memory_format, "PrivateUse1")
    lib.impl("empty_strided", empty_strided, "PrivateUse1")

    # Normally the Python key (the subclass's __torch_dispatch__) sees every op first, but some
    # C++ paths exclude it: torch.tensor(data, device=...) copies into the new tensor through
    # aten::_copy_from on the backend itself. (A Python *fallback* for PrivateUse1 would cover
    # everything, but torch 2.13 asserts "func != nullptr" on it.)
    for op in ("_copy_from", "_copy_from_and_resize"):
        overload = getattr(torch.ops.aten, op).default
        lib.impl(op, lambda *args, _op=overload, **kw: tensor_cls.run_on_cpu(_op, args, kw), "PrivateUse1")


def _register_compile_backend(name: str, mod: types.ModuleType) -> None:
    import torch._dynamo
    from torch._dynamo.backends import registry

    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs, **kwargs):
        # Dynamic dims reach a backend as SymInt inputs (or symbolic tensor sizes).
        dynamic = [
            i
            for i, x in enumerate(example_inputs)
            if isinstance(x, torch.SymInt)
            or (isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape))
        ]
        if dynamic:
            raise RuntimeError(
                f"the {name} compile backend needs static shapes (inputs {dynamic} are symbolic): "
                "compile with dynamic=False"
            )
        mod.compile_count += 1
        mod.compiled_graphs.append(len(gm.graph.nodes))
        return aot_eager(gm, example_inputs, **kwargs)

    # Replace, not just register: an installed torch_tpu provides a real "tpu" backend (entry
    # point), which cannot compile fake-device tensors. _COMPILER_FNS wins over entry points.
    backend._tags = ()
    registry._COMPILER_FNS[name] = backend
    registry._BACKENDS[name] = None


def _register_process_group(name: str) -> tuple[str, ...]:
    import torch.distributed as dist

    if not dist.is_available():
        return ()

    def create(store, rank, world_size, timeout):
        # Gloo does the work: fake tensors reach it as their CPU tensors via __torch_dispatch__.
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)

    names = DIST_BACKENDS.get(name, (f"{name}_dist",))
    for backend in names:
        if backend.lower() not in dist.Backend.backend_list:
            dist.Backend.register_backend(backend, create, devices=[name, "cpu"])
    return names


def install_fake_device(
    name: str = "neuron", *, device_count: int = 1, strict: bool = True
) -> types.ModuleType:
    """Make `name` a working CPU-backed accelerator in this process; return its device module.

    Idempotent for the same name; a different name in the same process raises (PrivateUse1 can be
    renamed once per process), so give each fake device its own process.
    """
    with _LOCK:
        if name in _INSTALLED:
            return _INSTALLED[name]
        current = torch._C._get_privateuse1_backend_name()
        if current != "privateuseone" or _INSTALLED:
            raise RuntimeError(
                f"PrivateUse1 is already {current!r} in this process; a fake {name!r} device needs its own process"
            )
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        memory = _Memory()
        mod = _make_device_module(name, memory, device_count)
        _setup_privateuseone_for_python_backend(name, backend_module=mod)  # renames PrivateUse1 first
        tensor_cls = _make_tensor_class(name, memory, strict)
        mod.Tensor = mod.FakeDeviceTensor = tensor_cls
        sys.modules[f"torch.{name}"] = mod
        lib = torch.library.Library("aten", "IMPL")  # kept alive on the module: dropping it unregisters
        _register_factories(name, tensor_cls, lib)
        mod._aten_lib = lib
        _register_compile_backend(name, mod)
        mod.dist_backends = _register_process_group(name)
        _INSTALLED[name] = mod
        return mod
