"""The process group of one sidecar rank: backend, mesh and local device binding from the device spec, a
CPU-side control group, and parent-death watching.

Two groups:
- WORLD, backend `spec.dist_backend` (gloo, nccl, xccl, neuron, tpu_dist) with a short-ish timeout: the
  sharded model's collectives. DeviceMesh(spec.mesh_device_type, all ranks) is built on it.
- control, always gloo (CPU tensors, works next to every device backend): rank 0's operation descriptors
  (`broadcast_object_list`), the per-step cancel flag and the after-operation status check. Followers
  wait on it between operations, so its timeout is long and rank 0 sends a heartbeat when idle.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from engine import devices, settings
from engine.processes import pid_alive
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


def init_group(spec: devices.DeviceSpec, timeout_s: float) -> RankGroup:
    """init_process_group(spec.dist_backend) from torchrun's environment, then the mesh and control group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    local_rank = settings.torchrun_local_rank()
    device = spec.bind_local_device(local_rank)  # before init_process_group, so collectives use this rank's device
    dist.init_process_group(backend=spec.dist_backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh(spec.mesh_device_type, list(range(world)))
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    log.info("rank %d/%d: backend %s, mesh %s, device %s", rank, world, spec.dist_backend, mesh, device)
    return RankGroup(spec, rank, world, local_rank, device, mesh, control)


def watch_parents(app_pid: int | None, interval_s: float = 1.0) -> None:
    """Exit this rank when torchrun (its parent) or the app that launched the sidecar is gone.

    torchrun starts each rank in its own session, so killing torchrun's process group never reaches the
    ranks; and a SIGKILLed torchrun cannot forward anything. A polling thread (not PR_SET_PDEATHSIG, which
    fires when the *thread* that forked exits) covers both.
    """
    parent = os.getppid()

    def app_alive() -> bool:
        return not app_pid or pid_alive(app_pid)

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent or not app_alive():
                log.error("sidecar parent (torchrun pid %d / app pid %s) is gone; rank exits", parent, app_pid)
                os._exit(RankExit.ORPHANED)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
