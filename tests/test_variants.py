"""Pipeline variants share the loaded pipeline's weights: same tensors, same dtypes, no extra memory."""

from __future__ import annotations

import pytest
import torch
from helpers import make_runner

from engine.pipeline.variants import pipeline_over, vae_decoding_with


def _tensors(pipe) -> dict:
    """Every module component's (data_ptr, dtype) per parameter and buffer."""
    return {name: [(t.data_ptr(), t.dtype) for t in (*module.parameters(), *module.buffers())]
            for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}


@pytest.mark.parametrize("preset, precision", [("tiny-flux", "bf16"), ("tiny-shapes", "fp32"), ("tiny-sdxl", "fp32")])
def test_a_variant_runs_on_the_loaded_tensors_with_its_replacements(cache_dir, tiny_models, preset, precision):
    runner = make_runner(cache_dir, preset, precision)
    base = runner.pipe
    before = _tensors(base)
    denoiser = runner.preset.denoiser
    compiled = torch.compile(getattr(base, denoiser))  # lazy: nothing compiles until it is called
    vae = vae_decoding_with(base.vae, lambda *a, **k: None)

    variant = pipeline_over(base, **{denoiser: compiled, "vae": vae})

    assert type(variant) is type(base)
    assert getattr(variant, denoiser) is compiled and variant.vae is vae
    assert vae.decode is not base.vae.decode and dict(vae.named_parameters()) == dict(base.vae.named_parameters())
    assert all(getattr(variant, n) is c for n, c in base.components.items() if n not in (denoiser, "vae"))
    assert _tensors(base) == before  # nothing cast, nothing copied (from_pipe casts to one dtype)
    assert variant.progress_bar(total=1).disable  # the engine's pipelines draw no progress bar


def test_a_variant_names_the_component_it_does_not_have(cache_dir, tiny_models):
    runner = make_runner(cache_dir, "tiny-flux")
    with pytest.raises(ValueError, match="no component unet"):
        pipeline_over(runner.pipe, unet=None)
