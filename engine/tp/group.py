"""The process group of one sidecar rank: backend and mesh from the device registry, local device binding,
a CPU-side control group, the CPU adjustments diffusers 0.42.1 needs, and parent-death watching.

Two groups:
- WORLD, backend `spec.dist_backend` (gloo, nccl, xccl, neuron, tpu_dist) with a short-ish timeout: the
  sharded model's collectives. DeviceMesh(spec.mesh_device_type, all ranks) is built on it.
- control, always gloo (CPU tensors, works next to every device backend): rank 0's operation descriptors
  (`broadcast_object_list`), the per-step cancel flag and the after-operation status check. Followers
  wait on it between operations, so its timeout is long and rank 0 sends a heartbeat when idle.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from engine import devices
from engine.protocol import RankExit

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 24 * 3600
HEARTBEAT_S = 600  # rank 0 pings the followers this often when idle (well inside CONTROL_TIMEOUT_S)


@dataclass
class RankGroup:
    spec: devices.DeviceSpec
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    control: object  # a gloo ProcessGroup

    @property
    def leader(self) -> bool:
        return self.rank == 0


def _bind_local_device(spec: devices.DeviceSpec, local_rank: int) -> torch.device:
    """This rank's device. One process per chip: cuda/xpu by LOCAL_RANK; Neuron and TPU runtimes give each
    process its core/chip (seed: `device = torch.neuron.current_device()`)."""
    if spec.torch_device == "cpu":
        return torch.device("cpu")
    module = getattr(torch, spec.name, None)
    if spec.name in ("neuron", "tpu"):
        current = module.current_device() if module is not None and hasattr(module, "current_device") else None
        if current is None:
            current = torch.accelerator.current_device_index()
        return current if isinstance(current, torch.device) else torch.device(spec.torch_device, int(current))
    if module is not None and hasattr(module, "set_device"):
        module.set_device(local_rank)
    else:
        torch.accelerator.set_device_index(local_rank)
    return torch.device(spec.torch_device, local_rank)


def init_group(spec: devices.DeviceSpec, timeout_s: float) -> RankGroup:
    """init_process_group(spec.dist_backend) from torchrun's environment, then the mesh and control group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _bind_local_device(spec, local_rank)
    dist.init_process_group(backend=spec.dist_backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh(spec.mesh_device_type, list(range(world)))
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    log.info("rank %d/%d: backend %s, mesh %s, device %s", rank, world, spec.dist_backend, mesh, device)
    return RankGroup(spec, rank, world, local_rank, device, mesh, control)


@contextlib.contextmanager
def cpu_adjustments(spec: devices.DeviceSpec):
    """The two adjustments diffusers 0.42.1 needs to shard on CPU (gloo); a no-op on every other device.

    1. `diffusers.hooks.tensor_parallel._SUPPORTED_TP_DEVICES` is ("cuda", "neuron", "tpu", "xpu"):
       `apply_tensor_parallel` refuses a "cpu" mesh although torch's DTensor/gloo path works there
       (rank 0 matched one process to ~2e-6). "cpu" is added for the duration of the load.
    2. `ModelMixin._resolve_parallel_config` computes `torch.device(type, rank % torch.accelerator.
       device_count())`; with no accelerator the count is 0 and that is a ZeroDivisionError. During the
       load `torch.accelerator.device_count` reports at least 1, so the device becomes cpu:0 (all ranks
       share the one CPU).
    Both are undone when the load returns; both are only needed at load time (the mesh and the forward
    hooks are in place by then).
    """
    if spec.name != "cpu":
        yield
        return
    import diffusers.hooks.tensor_parallel as tp_hooks

    supported = tp_hooks._SUPPORTED_TP_DEVICES
    device_count = torch.accelerator.device_count
    tp_hooks._SUPPORTED_TP_DEVICES = (*supported, "cpu")
    torch.accelerator.device_count = lambda: max(1, device_count())
    try:
        yield
    finally:
        tp_hooks._SUPPORTED_TP_DEVICES = supported
        torch.accelerator.device_count = device_count


def watch_parents(app_pid: int | None, interval_s: float = 1.0) -> None:
    """Exit this rank when torchrun (its parent) or the app that launched the sidecar is gone.

    torchrun starts each rank in its own session, so killing torchrun's process group never reaches the
    ranks; and a SIGKILLed torchrun cannot forward anything. A polling thread (not PR_SET_PDEATHSIG, which
    fires when the *thread* that forked exits) covers both.
    """
    parent = os.getppid()

    def app_alive() -> bool:
        if not app_pid:
            return True
        try:
            os.kill(app_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent or not app_alive():
                log.error("sidecar parent (torchrun pid %d / app pid %s) is gone; rank exits", parent, app_pid)
                os._exit(RankExit.ORPHANED)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
