"""An engine's configuration (plain data, sent once to a worker or the sidecar)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from engine import settings
from engine.protocol.presets import ModelPreset
from engine.protocol.vocabulary import EngineKey, Mode


@dataclass(frozen=True)
class TestingOptions:
    """Test-only hooks of an engine, read by engine/pipeline/faults.py. The UI, the CLI and the app never set
    them, and nothing in a request does: an app's engines run with them off."""

    __test__: ClassVar[bool] = False  # not a pytest test class
    inject_faults: bool = False  # accept InjectFault messages (one-shot faults armed through the client)
    fail_compiles: bool = False  # every compile and aot build fails


@dataclass(frozen=True)
class EngineOptions:
    """Per-engine options; every field is one named recipe step (engine/pipeline/recipes.py) or a setting."""

    cpu_offload: bool = False  # enable_model_cpu_offload(); then only regional compile is possible
    channels_last: bool = False  # UNet / VAE convolutions in channels_last memory format
    fuse_qkv: bool = False  # fuse_qkv_projections() on the denoiser
    inductor_flags: bool | None = None  # flux-fast inductor flags; None = the device's default
    max_autotune: bool = False  # torch.compile mode="max-autotune" (inductor devices only)
    dynamic: bool = False  # dynamic=True + use_duck_shape=False (not on static-shape devices)
    compile_vae: bool = True  # compile vae.decode too in "compile" mode
    warm_modes: tuple[Mode, ...] = (Mode.COMPILE,)  # modes whose buckets warm at start-up
    warm_sizes: tuple[str, ...] | None = None  # None: every bucket of the preset; () none
    warm_steps: int = 2
    # diffusers attention backend set on the denoiser (engine/pipeline/attention.py lists each one, usable or why not)
    attention_backend: str = "native"
    # torch.compile mode="reduce-overhead" (CUDA graphs) for compile; triton.cudagraphs for aot. CUDA only.
    cuda_graphs: bool = False
    max_queue: int = 16  # pending requests per engine before "busy, retry"
    # Batching (engine/pipeline/batching.py): at most `max_batch` queued requests that can share one denoiser call
    # run as one pipeline call (None: the device's default, DeviceSpec.max_batch; 1: off), gathered for up
    # to `batch_wait_ms` after the first one arrives (and while the previous call runs).
    max_batch: int | None = None
    batch_wait_ms: float = 15.0
    # The preset's LoRA adapters get a slot in the denoiser (engine/pipeline/lora.py). Off by default: the slot's
    # matmuls run on every step, styled or not (docs/benchmarks.md).
    loras: bool = False
    testing: TestingOptions = TestingOptions()  # tests only: off in the app and the CLI

    def __post_init__(self):
        object.__setattr__(self, "warm_modes", tuple(Mode.parse(m, "mode") for m in self.warm_modes))


@dataclass(frozen=True)
class EngineConfig:
    """Everything a worker needs to build its runner; picklable, sent once at start."""

    key: EngineKey
    preset: ModelPreset
    options: EngineOptions = field(default_factory=EngineOptions)
    cache_dir: str = ""
    allowed_roots: tuple[str, ...] = ()

    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else settings.cache_dir()

