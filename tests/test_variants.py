"""Pipeline variants share the loaded pipeline's weights (same tensors, same dtypes); a run's timings split
where its encoders, denoiser and decoder ran."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import make_request, make_runner

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


@pytest.mark.parametrize("preset", ["tiny-flux", "tiny-sdxl"])
def test_a_runs_timings_split_where_its_text_encoders_denoiser_and_decoder_ran(cache_dir, tiny_models, preset):
    """The denoise loop starts between the last text encoder call and the first denoiser call: encode_ms
    holds the encoders, step_ms[0] the first denoiser call, decode_ms the vae decode."""
    runner = make_runner(cache_dir, preset)
    pipe, spans = runner.pipe, {}

    def timed(name, module):
        def pre(*_):
            spans.setdefault(name, []).append([time.perf_counter(), None])

        def post(*_):
            spans[name][-1][1] = time.perf_counter()

        return module.register_forward_pre_hook(pre), module.register_forward_hook(post)

    handles = [*timed("encoders", pipe.text_encoder), *timed("encoders", pipe.text_encoder_2),
               *timed("denoiser", getattr(pipe, runner.preset.denoiser))]
    decode = pipe.vae.decode

    def timed_decode(*args, **kwargs):
        start = time.perf_counter()
        try:
            return decode(*args, **kwargs)
        finally:
            spans["decode"] = [[start, time.perf_counter()]]

    pipe.vae.decode = timed_decode
    try:
        result = runner.generate(make_request(steps=3))
    finally:
        del pipe.vae.decode
        for handle in handles:
            handle.remove()
    t = result.timings
    ms = {name: sum(b - a for a, b in calls) * 1000 for name, calls in spans.items()}
    first_call_ms = (spans["denoiser"][0][1] - spans["denoiser"][0][0]) * 1000
    assert len(t.step_ms) == 3 and abs(sum(t.step_ms) - t.denoise_ms) < 0.01
    assert abs(t.encode_ms + t.denoise_ms + t.decode_ms - t.total_ms) < 0.01
    assert t.encode_ms >= ms["encoders"] and t.step_ms[0] >= first_call_ms and t.decode_ms >= ms["decode"]
    assert t.denoise_ms >= ms["denoiser"]
