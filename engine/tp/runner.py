"""TensorParallelRunner: a PipelineRunner whose every operation runs on all ranks in the same order.

The ranks split the denoiser as the engine key's `parallel` says: `tensor` loads it sharded
(TensorParallelConfig: each rank reads its slice of the weights); `ulysses` and `ring` (context parallel)
load it whole on every rank and then `enable_parallelism(ContextParallelConfig(...))`, so each rank runs
1/N of the tokens. Everything below (broadcast operations, cancel, status checks) is the same for both.

Why operations are broadcast: the sharded denoiser runs collectives, and collectives issued from two
threads of one rank deadlock (or pair up with the wrong peer call). WorkerLoop (engine/worker/loop.py) serves
requests on one thread and warms buckets on another, so on rank 0 both `generate()` and `warm_bucket()`
take one operation lock, broadcast an operation descriptor on the control group, then run; followers
loop on receiving descriptors (`follow()`) and run exactly the same calls.

Consequences, by design:
- Eager fallback while compiling is *serialized* under tensor parallel: a request that arrives while a
  bucket compiles waits for that compile to finish (it then usually finds the bucket warm), instead of
  running eagerly alongside it as a single-device engine does.
- Every decision that depends on rank-local state is taken on rank 0 before broadcasting: size routing,
  and "wait for a cold bucket" becomes an explicit warm operation followed by the request.
- Cancel is synchronised at step ends: rank 0 broadcasts its cancel flag after every step and every rank
  (rank 0 included) acts only on the broadcast value, so all ranks stop after the same step.
- After each operation the ranks compare outcomes on the control group. A warm-up that failed on some rank
  marks the bucket failed on all of them (eager keeps serving). A request that ended differently on
  different ranks, or a status check that fails because a rank is gone, leaves the group in an unknown
  state: the runner is `broken`, the request fails with EngineCrashed, and the sidecar exits so that torchrun
  tears it down and the app restarts it (a sidecar started by hand is restarted by its host). The message
  names the rank that is gone, with its node, host and pid (engine/tp/liveness.py tells which).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from engine.config.presets import route_size
from engine.errors import EngineCrashed
from engine.pipeline.runner import PipelineRunner
from engine.protocol import (
    BucketInfo,
    BucketKey,
    BucketState,
    GenerateRequest,
    GenerateResult,
    Mode,
    Parallel,
    RankExit,
    TPOp,
    TPOpKind,
)
from engine.tp import plan
from engine.tp.group import HEARTBEAT_S, RankGroup

log = logging.getLogger(__name__)

SHUTDOWN = TPOp(TPOpKind.SHUTDOWN)
PING = TPOp(TPOpKind.PING)


class GroupHealth:
    """Rank 0's view of its group, shared by the runner that runs operations on it and the sidecar's guard
    that takes the rank down when another goes silent: why it broke (None: it works), the request the ranks
    run now, and the operation lock, held while they run one. From the sidecar: `who_is_gone()` names the
    ranks that stopped (liveness); `restart_hint` ends the message of a broken group (the app restarts a
    sidecar it launched; a host restarts its own)."""

    def __init__(self, key, who_is_gone: Callable[[], str | None] | None = None, restart_hint: str | None = None):
        self.key = key
        self.who_is_gone = who_is_gone
        self.restart_hint = restart_hint or "the sidecar is going down and will be restarted, please retry"
        self.broken: str | None = None
        self.current_request: str | None = None
        self.op_lock = threading.Lock()

    def error(self, reason: str) -> EngineCrashed:
        return EngineCrashed(f"tensor-parallel engine {self.key} failed: {reason}; {self.restart_hint}")

    def mark_broken(self, reason: str) -> str:
        """The group is broken; the first reason given stays. Returns it."""
        self.broken = self.broken or reason
        return self.broken



class TensorParallelRunner(PipelineRunner):
    def __init__(self, config, group: RankGroup, listener=None, dump_dir: str | Path | None = None,
                 health: GroupHealth | None = None):
        notices = []
        self.parallel = Parallel.parse(config.key.parallel, "parallel")
        if config.options.cpu_offload:
            # Tensor: each rank holds only its shard, and diffusers refuses offload hooks on a sharded model.
            # Context: offload hooks would move the weights under the attention's collectives on every step.
            config = replace(config, options=replace(config.options, cpu_offload=False))
            notices.append(f"CPU offload is off under {self.parallel} parallel: every rank keeps its denoiser on "
                           "its device")
        super().__init__(config, listener, refused=lambda mode: _context_parallel_refusal(self.parallel, mode))
        self.notices += notices
        self.group = group
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.health = health or GroupHealth(config.key)
        self._op_lock = self.health.op_lock
        self._last_op = time.monotonic()
        self._stopped = False
        self._dump_path: Path | None = None

    # -- loading ---------------------------------------------------------------------------------
    def load_device(self) -> str:
        return str(self.group.device)

    def make_stepper(self, pipe):
        """None: the ranks run each request as one whole call in lockstep (said on the board)."""
        self.notices.append("a multi-rank engine runs each request as one whole call on every rank (no stepping)")
        return None

    def component_overrides(self, source: str) -> dict:
        """The sharded components: each rank reads only its slice of the safetensors (tensor parallel only;
        context parallel loads the whole pipeline and splits the tokens after the load)."""
        if self.parallel.context:
            self.notices += plan.check_layout(self.preset, source, self.group.world_size, self.parallel,
                                              self.options.attention_backend, self.spec)
            return {}
        import diffusers
        from diffusers import TensorParallelConfig

        n = self.group.world_size
        plan.check_split(self.preset, source, n)
        index = plan._index(source)
        name = self.preset.denoiser
        cls = getattr(diffusers, index[name][1])
        dtype = self.precision.dtype
        with self.spec.tp_load_context():  # diffusers 0.42.1 needs two adjustments to shard on cpu
            denoiser = cls.from_pretrained(
                source, subfolder=name, dtype=dtype, parallel_config=TensorParallelConfig(mesh=self.group.mesh)
            )
        overrides = {name: denoiser}
        sharded = [f"{name} ({cls.__name__})"]
        if self.preset.tp_text_encoder:
            import transformers
            from transformers import DistributedConfig

            te_cls = getattr(transformers, index["text_encoder"][1])
            # transformers' own TP; `device_mesh` is what the seed passes (transformers 5.24 builds an
            # equivalent mesh over the same ranks and device type from the process group).
            overrides["text_encoder"] = te_cls.from_pretrained(
                source, subfolder="text_encoder", dtype=dtype,
                distributed_config=DistributedConfig(tp_plan="auto"), device_mesh=self.group.mesh,
            )
            sharded.append(f"text_encoder ({te_cls.__name__})")
        self.notices.append(
            f"tensor parallel over {n} ranks ({self.spec.dist_backend}, DeviceMesh({self.spec.mesh_device_type!r})): "
            f"{', '.join(sharded)} sharded; other components whole on each rank"
        )
        self.notices.append(
            "tensor parallel runs one operation at a time on all ranks: a request that arrives while a bucket "
            "compiles waits for the compile instead of running eagerly alongside it"
        )
        return overrides

    def load(self) -> float:
        load_s = super().load()
        if self.parallel.context:
            start = time.perf_counter()
            self._enable_context_parallel()
            load_s = self.load_s = load_s + time.perf_counter() - start
        if self.dump_dir is not None and self.group.leader:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
        return load_s

    def _enable_context_parallel(self) -> None:
        n = self.group.world_size
        shape = enable_context_parallel(getattr(self.pipe, self.preset.denoiser), self.spec, self.parallel, n)
        self.notices.append(
            f"context parallel ({self.parallel}) over {n} ranks ({self.spec.dist_backend}, "
            f"DeviceMesh({self.spec.mesh_device_type!r}, ring x ulysses = {shape[0]} x {shape[1]}))")
        self.notices.append(
            f"{self.parallel} parallel runs one operation at a time on all ranks: a request that arrives while a "
            "bucket compiles waits for the compile instead of running eagerly alongside it")

    def _variant_built(self, mode: Mode, pipe) -> None:
        """Regional compile clones the denoiser's module tree; diffusers' context-parallel hooks replace
        `forward` with a function bound to the original module, so the clone would run the original's eager
        blocks. The clone gets its own hooks. With a dump folder, each variant's image processor dumps."""
        if mode is Mode.REGIONAL and self.parallel.context:
            _rehook_context_parallel(getattr(pipe, self.preset.denoiser), getattr(self.pipe, self.preset.denoiser))
        if self.dump_dir is not None and self.group.leader:
            self._install_dump_hook(pipe.image_processor)

    def _install_dump_hook(self, processor) -> None:
        """Test/debug hook: rank 0 also saves each request's decoded float image (HxWx3 in [0, 1]) as
        <request_id>.npy, so TP output can be compared with one process numerically, not as PNG bytes."""
        import numpy as np

        if getattr(processor, "_dumps", False):
            return
        processor._dumps = True
        postprocess = processor.postprocess

        def dumping_postprocess(image, output_type="pil", **kwargs):
            if self._dump_path is None or output_type not in ("pil", "np") or not isinstance(image, torch.Tensor):
                return postprocess(image, output_type=output_type, **kwargs)
            array = postprocess(image, output_type="np", **kwargs)
            np.save(self._dump_path, array[0])
            return processor.numpy_to_pil(array) if output_type == "pil" else array

        processor.postprocess = dumping_postprocess

    # -- rank 0: operations ----------------------------------------------------------------------
    def generate(self, request: GenerateRequest, on_step=None, cancel: threading.Event | None = None) -> GenerateResult:
        if not self.group.leader:
            raise RuntimeError("only rank 0 takes requests; followers run broadcast operations")
        with self._op_lock:
            self._raise_if_broken()
            self.check_mode(request.mode)  # refused on rank 0, never broadcast
            size, _ = route_size(self.preset, request.width, request.height, snap=True)
            request = request.replace(width=size.width, height=size.height)
            # A request that waits for its compile waited in the worker loop, before it got here.
            op = TPOp(TPOpKind.GENERATE, request=request)
            self.health.current_request = request.request_id
            try:
                return self._run_op(op, on_step=on_step, cancel=cancel)
            finally:
                self.health.current_request = None

    def warm_bucket(self, bucket: BucketKey) -> BucketInfo:
        if not self.group.leader:
            return PipelineRunner.warm_bucket(self, bucket)
        with self._op_lock:
            self._raise_if_broken()
            info = self.board.get(bucket)
            if info is not None and info.state == BucketState.WARM:
                return info
            return self._run_op(TPOp(TPOpKind.WARM, bucket=bucket))

    def _run_op(self, op, on_step=None, cancel=None):
        self._broadcast(op)
        return self._execute(op, on_step, cancel)

    def _broadcast(self, op) -> None:
        import torch.distributed as dist

        try:
            dist.broadcast_object_list([op], src=0, group=self.group.control)
        except Exception as exc:
            self._break(f"could not hand '{op.kind}' to the other ranks ({_first_line(exc)})")
        self._last_op = time.monotonic()

    def stop_followers(self) -> None:
        """Clean shutdown: tell the followers to exit (best effort; a broken group is torn down anyway)."""
        with self._op_lock:
            self._stopped = True
            if self.health.broken:
                return
            try:
                self._broadcast(SHUTDOWN)
            except EngineCrashed:
                pass

    def start_heartbeat(self, interval_s: float = HEARTBEAT_S) -> None:
        """Followers wait for the next operation on the control group, whose timeout is long but finite."""

        def beat() -> None:
            while not self._stopped and not self.health.broken:
                time.sleep(min(interval_s, 5.0))
                if time.monotonic() - self._last_op < interval_s:
                    continue
                with self._op_lock:
                    if self._stopped or self.health.broken:
                        return
                    try:
                        self._broadcast(PING)
                    except EngineCrashed:
                        return

        threading.Thread(target=beat, name="tp-heartbeat", daemon=True).start()

    # -- followers -------------------------------------------------------------------------------
    def follow(self) -> RankExit:
        """Run rank 0's operations until it says shutdown. Returns the process exit code."""
        import torch.distributed as dist

        while True:
            box = [None]
            try:
                dist.broadcast_object_list(box, src=0, group=self.group.control)
            except Exception as exc:
                log.error("lost rank 0 while waiting for an operation: %s", _first_line(exc))
                return RankExit.GROUP_BROKEN
            op = box[0]
            if op == SHUTDOWN:
                return RankExit.OK
            if op == PING:
                continue
            try:
                self._execute(op)
            except EngineCrashed:
                return RankExit.GROUP_BROKEN
            except Exception:
                pass  # the same outcome was reported to the client by rank 0

    # -- every rank ------------------------------------------------------------------------------
    def _execute(self, op: TPOp, on_step=None, cancel=None):
        kind = op.kind
        result, error = None, None
        try:
            if kind is TPOpKind.GENERATE:
                result = self._generate_synced(op.request, on_step, cancel)
            elif kind is TPOpKind.WARM:
                result = PipelineRunner.warm_bucket(self, op.bucket)
            else:
                raise RuntimeError(f"unknown tensor-parallel operation {kind!r}")
        except Exception as exc:
            error = exc
        if kind is TPOpKind.WARM and result is not None:
            status = (result.state.value, result.error)
        else:
            status = ("error", type(error).__name__) if error is not None else ("ok", None)
        statuses = self._gather(status, kind)
        if kind is TPOpKind.WARM and error is None:
            result = self._reconcile_warm(op.bucket, statuses) or result
        elif len(set(statuses)) > 1:
            detail = "; ".join(f"rank {r}: {s[0]}{' ' + str(s[1]) if s[1] else ''}" for r, s in enumerate(statuses))
            self._break(f"the ranks ended '{kind}' differently ({detail})")
        if error is not None:
            raise error
        return result

    def _generate_synced(self, request: GenerateRequest, on_step, cancel):
        import torch.distributed as dist

        # The runner stops on `synced`, never on the live `cancel` (set by rank 0's receive thread at any
        # moment): rank 0 broadcasts the live flag at each step end and every rank, rank 0 included, acts on
        # the broadcast value, so all of them stop after the same step.
        live = cancel if cancel is not None else threading.Event()
        synced = threading.Event()
        control = self.group.control

        def step(progress):
            if on_step is not None:
                on_step(progress)
            flag = torch.tensor([1 if live.is_set() else 0], dtype=torch.uint8)
            dist.broadcast(flag, src=0, group=control)
            if flag.item():
                synced.set()

        if self.dump_dir is not None and self.group.leader:
            self._dump_path = self.dump_dir / f"{request.request_id}.npy"
        try:
            return PipelineRunner.generate(self, request, on_step=step, cancel=synced)
        finally:
            self._dump_path = None

    def _gather(self, status, kind: str) -> list:
        import torch.distributed as dist

        statuses = [None] * self.group.world_size
        try:
            dist.all_gather_object(statuses, status, group=self.group.control)
        except Exception as exc:
            self._break(f"a rank stopped answering during '{kind}' ({_first_line(exc)})")
        return statuses

    def _reconcile_warm(self, bucket: BucketKey, statuses) -> BucketInfo | None:
        failed = [(r, s) for r, s in enumerate(statuses) if s[0] != BucketState.WARM.value]
        if not failed or len(failed) == len(statuses) and len(set(statuses)) == 1:
            return None
        rank, (state, error) = failed[0]
        return self.board.update(bucket, state=BucketState.FAILED, error=f"rank {rank}: {state}: {error}"[:500])

    def _raise_if_broken(self) -> None:
        if self.health.broken:
            raise EngineCrashed(f"tensor-parallel engine {self.config.key} is down: {self.health.broken}")

    def _break(self, reason: str):
        gone = None
        if self.health.who_is_gone is not None and self.health.broken is None:
            try:
                gone = self.health.who_is_gone()
            except Exception as exc:  # noqa: BLE001 - naming the rank is a courtesy; the failure stands
                log.warning("could not tell which rank is gone: %s", exc)
        if gone:
            reason = f"{gone} is gone ({reason})"
        self.health.mark_broken(reason)
        log.error("tensor-parallel group broken: %s", reason)
        raise self.health.error(reason)


def _context_parallel_refusal(parallel: Parallel, mode: Mode) -> str:
    if mode is Mode.AOT and parallel.context:
        return ("a context-parallel denoiser runs collectives inside attention (diffusers' hooks), which aot "
                "packages are not built or checked for")
    return ""


def enable_context_parallel(denoiser, spec, parallel: Parallel, n: int) -> tuple[int, int]:
    """`enable_parallelism` over all `n` ranks of the initialised process group, after the attention backend
    is set (diffusers checks it). Returns the (ring, ulysses) mesh shape."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import DeviceMesh

    layout = plan.CONTEXT_LAYOUTS[Parallel.parse(parallel, "parallel")]
    shape = (n, 1) if parallel == Parallel.RING else (1, n)
    mesh = DeviceMesh(spec.mesh_device_type, torch.arange(n).view(*shape), mesh_dim_names=("ring", "ulysses"))
    with spec.tp_load_context():  # the same CPU adjustment as the sharded load (rank % device_count())
        denoiser.enable_parallelism(config=ContextParallelConfig(**{layout.degree_field: n}, mesh=mesh))
    return shape


def _rehook_context_parallel(clone, original) -> None:
    """Give a structural clone of a context-parallel denoiser its own diffusers hooks (the copied `forward`
    and hook registry still point at the original's modules)."""
    from diffusers.hooks.context_parallel import apply_context_parallel

    for module in clone.modules():
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_diffusers_hook", None)
    apply_context_parallel(clone, original._parallel_config.context_parallel_config, original._cp_plan)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    text = text.splitlines()[0] if text else ""
    text = text.split(" This is typically caused by")[0]  # gloo's boilerplate after the actual error
    text = re.sub(r"^\[[^\]]*/gloo/[^\]]*\]\s*", "", text)  # and its source location
    return f"{type(exc).__name__}: {text}"[:300]
