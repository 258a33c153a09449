"""Loading: the process prepared for one engine (environment, precision, compile accounting), the pipeline's
weights loaded once per (model, device, precision), and the load-time recipes applied to them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import devices
from engine.config.resolve import resolve_source, resolve_vae_source
from engine.errors import ModelLoadError
from engine.pipeline import attention, lora, memory, recipes, variants
from engine.pipeline.clock import install_compile_counter
from engine.pipeline.progress import quiet_library_consoles
from engine.protocol import EngineConfig

log = logging.getLogger(__name__)


@dataclass
class LoadedPipeline:
    """What a load gave: the pipeline (the eager variant), what from_pretrained loaded it from (aot package
    keys name the model by it), the LoRA slot (None: no adapters served) and what the load says."""

    pipe: object
    source: str
    vae_source: str | None = None  # where the VAE came from when the preset names its own (preset.vae)
    loras: lora.LoraSlot | None = None
    notices: list[str] = field(default_factory=list)


def lora_refusal(config: EngineConfig, precision: devices.PrecisionPlan) -> str:
    """Why this engine serves no LoRA although its preset lists some ("" when it can)."""
    if not config.options.recipe.loras:
        return ("this engine was started without LoRA styles: the host turns them on with --loras (each adds "
                "a slot whose matmuls run on every step)")
    if config.key.tp > 1:
        return ("LoRA adapters are not served on multi-rank engines (every rank would have to swap in step; "
                "not built yet): use a single-device engine")
    return memory.lora_refusal(config.key.memory)


class PipelineLoader:
    """Loads one engine's pipeline onto `device` (a TP rank's own device), with `component_overrides(source)`:
    components loaded apart and handed to from_pretrained (a rank's shards)."""

    def __init__(self, config: EngineConfig, spec: devices.DeviceSpec, precision: devices.PrecisionPlan,
                 device: str, component_overrides: Callable[[str], dict]):
        self.config = config
        self.options = config.options
        self.preset = config.preset
        self.spec = spec
        self.precision = precision
        self.device = device
        self.component_overrides = component_overrides

    @property
    def compute_precision(self) -> str:
        return self.precision.base or self.precision.precision

    def load(self, graphs: int) -> LoadedPipeline:
        """`graphs`: how many graphs this engine may compile (dynamo's recompile limit)."""
        diffusers = self._prepare_process(graphs)
        loaded = self._from_pretrained(diffusers)
        self._apply_recipes(loaded)
        return loaded

    def _prepare_process(self, graphs: int):
        """Everything before the weights load; returns the diffusers module."""
        # An attention backend this device cannot run is refused before any weights load.
        attention.check_backend(self.options.recipe.attention_backend, self.spec, self.compute_precision)
        # So is a memory lever this device, layout or precision cannot run with.
        memory.check_levers(self.config.key.memory, self.spec, tp=self.config.key.tp,
                            quantized=self.precision.precision.quantized, cpu_offload=self.options.recipe.cpu_offload)
        memory.prepare_process(self.config.key.memory)
        # Before diffusers is imported: importing it pulls in torch._dynamo, which fixes
        # TORCHINDUCTOR_CACHE_DIR to /tmp when unset, and the persistent cache would be ignored.
        env = devices.apply_environment(self.spec, self.config.cache_path())
        log.info("environment in force: %s", env)
        if not self.precision.precision.quantized:
            recipes.keep_torchao_unloaded()
        import diffusers

        quiet_library_consoles()
        devices.apply_precision(self.precision)
        install_compile_counter()
        recipes.raise_recompile_limit(graphs)
        return diffusers

    def _from_pretrained(self, diffusers) -> LoadedPipeline:
        pipeline_cls = getattr(diffusers, self.preset.base_pipeline or self.preset.pipeline)
        source, vae_source = resolve_source(self.config), resolve_vae_source(self.config)
        overrides = self.component_overrides(source)
        try:
            if vae_source is not None and "vae" not in overrides:
                overrides["vae"] = diffusers.AutoModel.from_pretrained(vae_source, subfolder="vae",
                                                                       torch_dtype=self.precision.dtype)
            pipe = pipeline_cls.from_pretrained(source, dtype=self.precision.dtype, trust_remote_code=False, **overrides)
        except (OSError, ValueError) as exc:
            shown = source if vae_source is None else f"{source} (its VAE from {vae_source})"
            raise ModelLoadError(
                f"could not load {self.preset.name!r} from {shown!r}: {str(exc).splitlines()[0]}; "
                "check the path, or download the model first when offline"
            ) from None
        if self.preset.base_pipeline:  # img2img / inpaint over a text-to-image folder: the same modules
            pipe = variants.pipeline_as(pipe, getattr(diffusers, self.preset.pipeline))
        pipe.set_progress_bar_config(disable=True)
        if self.preset.repeated_blocks:
            getattr(pipe, self.preset.denoiser)._repeated_blocks = list(self.preset.repeated_blocks)
        return LoadedPipeline(pipe, source, vae_source)

    def _apply_recipes(self, loaded: LoadedPipeline) -> None:
        pipe, notices, recipe = loaded.pipe, loaded.notices, self.options.recipe
        notices += recipes.apply_load_steps(pipe, self.preset.denoiser, self.options)
        if recipe.cpu_offload:
            pipe.enable_model_cpu_offload(device=self.device)
            notices.append("model CPU offload: each model moves to the device only while it runs")
        elif self.config.key.memory:
            notices += memory.apply_engine_levers(pipe, self.preset.denoiser, self.config.key.memory, self.device,
                                                  self.precision.dtype, self.config.cache_path())
        else:
            pipe.to(self.device)
        if self.preset.loras:
            # Before any variant is compiled or cloned: every variant must share the slot's layers.
            if refusal := lora_refusal(self.config, self.precision):
                notices.append(refusal)
            else:
                loaded.loras, lora_notices = lora.LoraSlot.prepare(pipe, self.preset, self.config.allowed_roots)
                notices += lora_notices
        if self.precision.precision.quantized:
            notices.append(recipes.quantize_denoiser(pipe, self.preset.denoiser, self.precision.precision))
        notices += attention.apply_backend(getattr(pipe, self.preset.denoiser), recipe.attention_backend,
                                           self.spec, self.compute_precision)
        notices += recipes.apply_inductor_flags(self.options, self.spec)
