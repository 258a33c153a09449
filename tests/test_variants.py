"""Pipeline variants share the loaded pipeline's weights (same tensors, same dtypes); a run's timings split
where its encoders, denoiser and decoder ran."""

from __future__ import annotations

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


class StepClock:
    """A perf_counter that moves only when a component's forward (or the decode) ends, by that component's
    own figure: the run's timings are then exact sums of what ran in each phase."""

    def __init__(self):
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t


@pytest.mark.parametrize("preset", ["tiny-flux", "tiny-sdxl"])
def test_a_runs_timings_split_where_its_text_encoders_denoiser_and_decoder_ran(cache_dir, tiny_models, preset,
                                                                              monkeypatch):
    """The denoise loop starts between the last text encoder call and the first denoiser call: encode_ms
    holds the encoders, step_ms[i] step i's denoiser calls, decode_ms the vae decode. On a clock that only
    the components move (10 ms per encoder call, 100 ms per denoiser call, 1 s per decode) each figure is exact."""
    import engine.pipeline.calls
    import engine.pipeline.clock

    runner = make_runner(cache_dir, preset)
    pipe, calls, clock = runner.pipe, {"encoders": 0, "denoiser": 0, "decode": 0}, StepClock()
    for module in (engine.pipeline.calls, engine.pipeline.clock):
        monkeypatch.setattr(module, "time", clock)
    cost_s = {"encoders": 0.010, "denoiser": 0.100, "decode": 1.0}

    def ran(name):
        calls[name] += 1
        clock.t += cost_s[name]

    handles = [module.register_forward_hook(lambda *_, name=name: ran(name)) for name, module in
               (("encoders", pipe.text_encoder), ("encoders", pipe.text_encoder_2),
                ("denoiser", getattr(pipe, runner.preset.denoiser)))]
    decode = pipe.vae.decode

    def timed_decode(*args, **kwargs):
        try:
            return decode(*args, **kwargs)
        finally:
            ran("decode")

    pipe.vae.decode = timed_decode
    try:
        result = runner.generate(make_request(steps=3))
    finally:
        del pipe.vae.decode
        for handle in handles:
            handle.remove()
    t = result.timings
    per_step = calls["denoiser"] // 3
    assert calls["encoders"] >= 1 and per_step >= 1 and calls["denoiser"] == 3 * per_step and calls["decode"] == 1
    assert t.encode_ms == pytest.approx(10 * calls["encoders"])
    assert t.step_ms == pytest.approx((100 * per_step,) * 3)
    assert t.denoise_ms == pytest.approx(300 * per_step)
    assert t.decode_ms == pytest.approx(1000)
    assert t.total_ms == pytest.approx(t.encode_ms + t.denoise_ms + t.decode_ms)
