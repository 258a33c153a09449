"""LoRA adapters (engine/pipeline/lora.py): hot-swapped on warm buckets with no recompile, images equal to a fresh
pipeline with that adapter alone, bad adapters refused with what to change while the engine keeps serving, and
the embedded model's trained styles read by the checker (training/shapes/styles.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config.request import ImageRequest
from engine.errors import InvalidRequest, UnsupportedCombination
from engine.protocol import (
    BucketKey,
    EngineConfig,
    EngineKey,
    EngineOptions,
    GenerateRequest,
    LoraChoice,
    LoraSource,
    Size,
)

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-shapes"
LORAS = Path(__file__).resolve().parents[1] / "models" / "tiny-shapes-loras"
PROMPT = "a red circle on a blue background"
ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v")


def _fresh_pipeline(lora_folder: Path | None = None, scale: float = 1.0):
    """What a user would build by hand: the model with one adapter (or none), eager."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(MODEL), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    if lora_folder is not None:
        pipe.load_lora_weights(str(lora_folder), adapter_name="x")
        pipe.set_adapters(["x"], [scale])
    return pipe


def _random_lora(folder: Path, rank: int, seed: int, suffixes=ATTENTION, text_encoder: bool = False) -> Path:
    """A LoRA with random, non-zero A and B on the tiny-shapes transformer's layers ending in `suffixes`."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(str(MODEL / "transformer"))
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(suffixes):
            state[f"{name}.lora_A.weight"] = 0.2 * torch.randn(rank, module.in_features, generator=generator)
            state[f"{name}.lora_B.weight"] = 0.2 * torch.randn(module.out_features, rank, generator=generator)
    encoder = None
    if text_encoder:
        encoder = {"text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(rank, 32),
                   "text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, rank)}
    FluxPipeline.save_lora_weights(str(folder), transformer_lora_layers=state, text_encoder_lora_layers=encoder)
    return folder


def _diff(a, b) -> float:
    """Largest pixel difference, in 1/255."""
    return float(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).max())


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("loras")
    made = {
        "a": _random_lora(root / "a", 4, 1),
        "b": _random_lora(root / "b", 8, 2),
        "narrow": _random_lora(root / "narrow", 2, 3, suffixes=("attn.to_q",)),
        "other": _random_lora(root / "other", 4, 4, suffixes=("proj_mlp",)),
        "big": _random_lora(root / "big", 16, 5),
        "encoder": _random_lora(root / "encoder", 4, 6, text_encoder=True),
    }
    (root / "unet").mkdir()
    save_file({"unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.randn(4, 320),
               "unet.down_blocks.0.attentions.0.proj_in.lora_B.weight": torch.randn(320, 4)},
              str(root / "unet" / "pytorch_lora_weights.safetensors"))
    made["unet"] = root / "unet"
    good = (made["a"] / "pytorch_lora_weights.safetensors").read_bytes()
    (root / "truncated").mkdir()
    (root / "truncated" / "pytorch_lora_weights.safetensors").write_bytes(good[: len(good) // 2])
    made["truncated"] = root / "truncated"
    return made


def _config(cache_dir, adapters: dict[str, Path], lora_rank: int | None = 8, **options) -> EngineConfig:
    from engine.config.presets import get_preset

    preset = dataclasses.replace(get_preset("tiny-shapes"), lora_rank=lora_rank, loras=tuple(
        LoraSource(name, str(folder), scale=0.5 if name == "b" else 1.0) for name, folder in adapters.items()))
    options.setdefault("warm_sizes", ())
    options.setdefault("loras", True)
    return EngineConfig(EngineKey("tiny-shapes", "cpu", "fp32"), preset, EngineOptions(**options), str(cache_dir))


@pytest.fixture(scope="module")
def runner(cache_dir, adapters):
    from engine.pipeline.runner import PipelineRunner

    runner = PipelineRunner(_config(cache_dir, adapters))
    runner.load()
    return runner


def _request(**fields) -> GenerateRequest:
    return GenerateRequest.checked(**{"prompt": PROMPT, "width": 64, "height": 64, "steps": 8, "guidance": 1.0, "seed": 3,
                              "mode": "eager", **fields})


def _fresh_image(folder: Path | None, scale: float = 1.0):
    from engine.pipeline.runner import pipeline_call_kwargs

    pipe = _fresh_pipeline(folder, scale)
    from engine.config.presets import get_preset

    return pipe(**pipeline_call_kwargs(get_preset("tiny-shapes"), pipe, _request())).images[0]


def test_a_request_checks_its_lora_scale_and_choice_text():
    from engine.protocol import parse_lora

    with pytest.raises(InvalidRequest, match=r"LoRA scale 3 is outside \[0, 2\]"):
        _request(lora="a", lora_scale=3)
    with pytest.raises(InvalidRequest, match="is not a number"):
        _request(lora="a", lora_scale="strong")
    assert parse_lora("swap:0.5") == LoraChoice("swap", 0.5)
    assert parse_lora("Swap") == LoraChoice("swap", None)
    assert parse_lora("none") == LoraChoice()
    assert parse_lora("swap:0.5:fused") == LoraChoice("swap", 0.5, fused=True) == parse_lora("swap:fused:0.5")
    assert parse_lora("swap:fused").text() == "swap:fused" and parse_lora("swap:1.5:fused").text() == "swap:1.5:fused"
    with pytest.raises(InvalidRequest, match="outside"):
        parse_lora("swap:-1")
    with pytest.raises(InvalidRequest, match="write NAME, NAME:SCALE, NAME:fused or NAME:SCALE:fused"):
        parse_lora("swap:0.5:0.7")
    assert _request(lora="none").lora is None


def test_visitors_pick_only_the_presets_adapters_by_name():
    from engine.config.presets import get_preset
    from engine.config.validation import build_request

    preset = get_preset("tiny-shapes")
    assert [lora.name for lora in preset.loras] == ["swap", "small", "corner"]
    request, _ = build_request(preset, ImageRequest(preset.name, prompt=PROMPT, width=64, height=64,
                                                    lora="corner:0.5"))
    assert (request.lora, request.lora_scale) == ("corner", 0.5)
    request, _ = build_request(preset, ImageRequest(preset.name, prompt=PROMPT, width=64, height=64,
                                                    lora="swap", lora_scale="1.5"))
    assert (request.lora, request.lora_scale, request.lora_fused) == ("swap", 1.5, False)
    request, _ = build_request(preset, ImageRequest(preset.name, prompt=PROMPT, width=64, height=64,
                                                    lora="swap:fused"))
    assert LoraChoice.of(request) == LoraChoice("swap", None, fused=True)  # the API's text
    request, _ = build_request(preset, ImageRequest(preset.name, prompt=PROMPT, width=64, height=64,
                                                    lora="swap", lora_fused=True))
    assert request.lora_fused  # the page's checkbox
    for chosen in ("models/tiny-shapes-loras/swap", "org/some-hub-lora", "../swap"):
        with pytest.raises(InvalidRequest, match=r"unknown LoRA .* choose one of swap, small, corner \(or none\)"):
            build_request(preset, ImageRequest(preset.name, prompt=PROMPT, width=64, height=64, lora=chosen))
    with pytest.raises(InvalidRequest, match="lists no LoRA adapters"):
        build_request(get_preset("tiny-flux"), ImageRequest("tiny-flux", prompt=PROMPT, width=64, height=64,
                                                            lora="swap"))


def test_the_timings_table_shows_the_adapter_its_rank_and_the_swap():
    from ui import generate_views

    row = dict(generate_views.stats_rows({"timings": {}, "lora": "swap", "lora_scale": 0.5, "lora_rank": 4,
                                 "lora_swap_ms": 21.4}))
    assert row["LoRA"] == "swap at scale 0.5, rank 4; hot-swapped in 21 ms (no recompile)"
    assert dict(generate_views.stats_rows({"timings": {}}))["LoRA"] == "none"
    fused = {"timings": {"step_ms": [3.0]}, "lora": "swap", "lora_scale": 1.0, "lora_rank": 4, "lora_fused": True,
             "lora_fuse_ms": 1.8}
    assert dict(generate_views.stats_rows(fused))["LoRA"] == ("swap at scale 1, rank 4; already in place; fused into the "
                                                      "weights in 2 ms")
    assert "· LoRA swap at scale 1, rank 4" in generate_views.run_summary(fused)  # under the image, not only in the table


def test_the_adapter_joins_the_batch_key():
    from engine.pipeline.batching import batch_key

    assert batch_key(_request(lora="a")) != batch_key(_request(lora="b"))
    assert batch_key(_request(lora="a", lora_scale=0.5)) != batch_key(_request(lora="a"))
    assert batch_key(_request(lora="a", seed=9)) == batch_key(_request(lora="a"))
    assert batch_key(_request(lora="a", lora_fused=True)) != batch_key(_request(lora="a"))


def test_bad_adapters_are_refused_with_what_to_change_and_the_engine_keeps_serving(runner):
    expected = {
        "other": r"targets 2 layer\(s\) the widest adapter 'b' does not .*train it on the same layers or a subset",
        "big": r"rank 16, above this engine's hot-swap rank 8: raise lora_rank to 16",
        "encoder": r"also adapts the text encoder.*use a transformer-only adapter",
        "unet": r"made for another pipeline.*unet\.down_blocks.*trained for FluxPipeline",
        "truncated": r"LoRA 'truncated': .* are truncated.*replace the file",
    }
    before = runner.generate(_request(lora="a"))
    for name, words in expected.items():
        assert any(name in n for n in runner.notices if n.startswith("LoRA refused"))
        with pytest.raises((UnsupportedCombination, InvalidRequest), match=words):
            runner.generate(_request(lora=name))
    with pytest.raises(InvalidRequest, match=r"unknown LoRA '/tmp/x.safetensors' for tiny-shapes: choose one of a, b, "
                                             r"narrow \(or none\)"):
        runner.generate(_request(lora="/tmp/x.safetensors"))  # a visitor names adapters, never files
    after = runner.generate(_request(lora="a"))
    assert after.lora_run.choice.name == "a" and after.lora_run.rank == 4
    assert _diff(before.image(), after.image()) == 0


def test_eager_swaps_equal_a_fresh_pipeline_with_that_adapter_alone(runner, adapters):
    plain = runner.generate(_request())
    a = runner.generate(_request(lora="a"))
    b = runner.generate(_request(lora="b"))  # default scale 0.5 from the preset
    narrow = runner.generate(_request(lora="narrow", lora_scale=2.0))  # a subset of the layers, rank 2 padded to 8
    assert (a.lora_run.swap_ms is None) or a.lora_run.swap_ms > 0
    assert b.lora_run.swap_ms is not None and b.lora_run.choice.scale == 0.5 and b.lora_run.rank == 8
    assert _diff(plain.image(), _fresh_image(None)) <= 2
    assert _diff(a.image(), _fresh_image(adapters["a"])) <= 2
    assert _diff(b.image(), _fresh_image(adapters["b"], 0.5)) <= 2
    assert _diff(narrow.image(), _fresh_image(adapters["narrow"], 2.0)) <= 2
    assert _diff(a.image(), plain.image()) > 20  # the adapters change the image, or the test proves nothing
    assert runner.generate(_request()).image().tobytes() == plain.image().tobytes()  # back to no LoRA: exact


def test_a_swap_reaches_the_step_cache_clones(runner):
    """Step caches run on structural clones of the denoiser: they must see the slot's swapped weights."""
    cached = dict(step_cache="first-block:0.2")
    a = runner.generate(_request(lora="a", **cached))
    b = runner.generate(_request(lora="b", **cached))
    a_again = runner.generate(_request(lora="a", **cached))
    assert b.lora_run.swap_ms is not None and a_again.lora_run.swap_ms is not None
    assert _diff(a.image(), b.image()) > 20
    assert _diff(a.image(), a_again.image()) == 0


def test_fused_runs_eager_like_unfused_without_the_slots_matmuls(runner, adapters):
    """Fused: the adapter folded into a copy of the targeted weights; the image equals the unfused one, a swap
    re-fuses, and the shared slot (what compiled graphs trace) is left as it was."""
    unfused = runner.generate(_request(lora="b"))
    fused = runner.generate(_request(lora="b", lora_fused=True))
    assert fused.lora_run.choice.fused and fused.lora_run.fuse_ms is not None and fused.lora_run.fuse_ms > 0
    assert _diff(fused.image(), unfused.image()) <= 2
    assert _diff(fused.image(), _fresh_image(adapters["b"], 0.5)) <= 2
    again = runner.generate(_request(lora="b", lora_fused=True, seed=4))
    assert again.lora_run.fuse_ms is None  # the fused copy already holds b at 0.5
    a = runner.generate(_request(lora="a", lora_fused=True))
    assert a.lora_run.swap_ms is not None and a.lora_run.fuse_ms is not None
    assert _diff(a.image(), _fresh_image(adapters["a"])) <= 2
    from peft.tuners.lora import LoraLayer

    denoiser = runner.loras.fused_pipeline(runner.pipe).transformer
    assert not any(isinstance(m, LoraLayer) for m in denoiser.modules())  # no LoRA branch left to run
    assert all(not m.merged for m in runner.pipe.transformer.modules() if isinstance(m, LoraLayer))
    plain = runner.generate(_request())
    assert _diff(plain.image(), _fresh_image(None)) <= 2  # the base weights are untouched
    assert runner.lora_info().fuses >= 2
    with pytest.raises(UnsupportedCombination, match="a fused LoRA runs in eager mode only, not compile"):
        runner.generate(_request(lora="a", lora_fused=True, mode="compile"))
    cached = runner.generate(_request(lora="a", lora_fused=True, step_cache="first-block:0.2"))
    assert cached.lora_run.choice.fused and _diff(cached.image(), plain.image()) > 20


def test_a_hub_lora_loads_offline_through_the_same_path_as_a_local_one(cache_dir, adapters, tmp_path, monkeypatch):
    """A preset's Hub source ("org/name" + weight_name) resolves through the Hub cache (offline here: a cache laid
    out as huggingface_hub writes it) and serves like the same file given as a folder; not cached: the error says
    to download it first."""
    import shutil

    import huggingface_hub.constants as hub

    from engine.config.presets import get_preset
    from engine.errors import ModelLoadError
    from engine.pipeline import lora
    from engine.pipeline.runner import PipelineRunner

    revision = "0" * 40
    repo = tmp_path / "hub" / "models--someone--tiny-style"
    (repo / "snapshots" / revision).mkdir(parents=True)
    shutil.copy(adapters["a"] / "pytorch_lora_weights.safetensors", repo / "snapshots" / revision / "style.safetensors")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    source = LoraSource("hub-style", "someone/tiny-style", weight_name="style.safetensors")
    assert lora.locate(source).read_bytes() == (adapters["a"] / "pytorch_lora_weights.safetensors").read_bytes()
    config = _config(cache_dir, {})
    config = dataclasses.replace(config, preset=dataclasses.replace(config.preset, loras=(source,), lora_rank=None))
    runner = PipelineRunner(config)
    runner.load()
    served = runner.generate(_request(lora="hub-style"))
    assert served.lora_run.choice.name == "hub-style" and _diff(served.image(), _fresh_image(adapters["a"])) <= 2
    paper = get_preset("flux1-dev").loras[0]  # the real preset's Hub LoRA, not in this cache
    assert lora._HUB_ID.fullmatch(paper.source) and paper.weight_name
    with pytest.raises(ModelLoadError, match=r"could not be fetched .*download it first when offline"):
        lora.locate(paper)


@pytest.mark.parametrize("precision", ["int8wo", "int8dq"])
def test_quantized_engines_hot_swap_beside_their_int8_weights(cache_dir, adapters, precision):
    """The slot's A and B stay fp32 (kept out of torchao's quantization), so a hot-swap copies into them as on
    any engine: the image equals a fresh pipeline with that adapter alone, quantized the same way. Fused is
    refused (a fuse would re-quantize the weights)."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    from torchao.quantization.quant_api import _is_linear

    from engine.config.presets import get_preset
    from engine.pipeline.runner import PipelineRunner, pipeline_call_kwargs

    config = dataclasses.replace(_config(cache_dir, {"a": adapters["a"], "b": adapters["b"]}),
                                 key=EngineKey("tiny-shapes", "cpu", precision))
    runner = PipelineRunner(config)
    runner.load()
    assert runner.loras is not None and not runner.lora_refusal()
    a, b = runner.generate(_request(lora="a")), runner.generate(_request(lora="b"))
    assert b.lora_run.swap_ms is not None and _diff(a.image(), b.image()) > 20
    fresh = _fresh_pipeline(adapters["b"], 0.5)
    config_cls = Int8WeightOnlyConfig if precision == "int8wo" else Int8DynamicActivationInt8WeightConfig
    quantize_(fresh.transformer, config_cls(), filter_fn=lambda m, fqn: _is_linear(m) and ".lora_" not in fqn)
    expected = fresh(**pipeline_call_kwargs(get_preset("tiny-shapes"), fresh, _request())).images[0]
    assert _diff(b.image(), expected) <= 2
    with pytest.raises(UnsupportedCombination, match=f"a fused LoRA is not served on {precision} engines"):
        runner.generate(_request(lora="a", lora_fused=True))


@pytest.mark.slow
def test_a_quantized_regional_bucket_hot_swaps_without_a_recompile(cache_dir, adapters):
    from engine.pipeline.runner import PipelineRunner

    config = dataclasses.replace(_config(cache_dir, {"a": adapters["a"], "b": adapters["b"]}),
                                 key=EngineKey("tiny-shapes", "cpu", "int8wo"))
    runner = PipelineRunner(config)
    runner.load()
    info = runner.warm_bucket(BucketKey("regional", Size(64, 64)))
    assert info.state.value == "warm", info.error
    eager_b = runner.generate(_request(lora="b"))
    runner.generate(_request(mode="regional", lora="a"))
    previous = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = True
    try:
        swapped = [runner.generate(_request(mode="regional", lora=name)) for name in ("b", None, "a")]
    finally:
        torch._dynamo.config.error_on_recompile = previous
    assert all(r.warm and r.recompiles == 0 for r in swapped)
    assert _diff(swapped[0].image(), eager_b.image()) <= 2


def test_adapters_are_refused_where_the_engine_cannot_hold_them(cache_dir, adapters):
    from engine.pipeline.runner import PipelineRunner

    off = PipelineRunner(_config(cache_dir, {"a": adapters["a"]}, loras=False))
    assert "turns them on with --loras" in off.lora_refusal()
    with pytest.raises(UnsupportedCombination, match="LoRA 'swap' cannot run here: preset tiny-flux lists no LoRA"):
        from helpers import make_runner

        make_runner(cache_dir, "tiny-flux", load=False).prep.prepare(_request(lora="swap"))


@pytest.fixture(scope="module")
def styled_manager(cache_dir):
    """An in-process engine manager whose engines get a LoRA slot (--loras), serving the committed styles."""
    from helpers import engine_manager

    with engine_manager(cache_dir, {"loras": True}, runtime="inprocess") as manager:
        yield manager


def test_the_board_shows_each_engines_slot_its_swaps_and_no_recompiles(styled_manager):
    """The slot's figures travel from the engine's loop to the app's status rows (LoraChanged), before the
    result of the call that changed them."""
    from ui import buckets_views

    manager = styled_manager
    for lora in ("swap", "corner"):
        manager.generate(ImageRequest("tiny-shapes", prompt=PROMPT, width=64, height=64, steps=2, seed=1,
                                      mode="eager", lora=lora), timeout=120)
    row = next(r for r in manager.residency.status_rows() if r["engine"].startswith("tiny-shapes"))
    lora = row["lora"]
    assert (lora["current"], lora["scale"]) == ("corner", 1.0)
    assert lora["swaps"] >= 1 and lora["median_swap_ms"] > 0 and lora["recompiles"] == 0
    assert lora["adapters"] == ["swap", "small", "corner"] and lora["target_rank"] > 0
    assert lora["fused_bytes"] > 0  # the fused copy's weights, which the LoRA bench reads through the client
    board = [r for r in buckets_views.board_rows(manager.residency.status_rows()) if r[3] == buckets_views.LORA_SLOT]
    assert len(board) == 1 and board[0][5] == "corner at 1"
    assert "0 recompiles" in board[0][6] and board[0][9] == f"{lora['swaps']} swaps"
    manager.generate(ImageRequest("tiny-shapes", prompt=PROMPT, width=64, height=64, steps=2, seed=1, mode="eager",
                                  lora="swap:fused"), timeout=120)
    lora = next(r for r in manager.residency.status_rows() if r["engine"].startswith("tiny-shapes"))["lora"]
    assert lora["fuses"] >= 1 and lora["median_fuse_ms"] > 0  # the fused copy's refreshes reach the board
    assert "fuses (median" in next(r for r in buckets_views.board_rows(manager.residency.status_rows()) if r[3] == buckets_views.LORA_SLOT)[6]


def test_compare_draws_one_card_per_adapter_named_in_its_caption(styled_manager):
    """LoRA as a Compare axis: each typed "+lora=NAME[:SCALE]" entry's images run with that adapter (the
    ImageRequest carries it), priced against the same eager fp32 reference as every configuration."""
    from ui.handlers import Handlers, UIDefaults

    handlers = Handlers(styled_manager.serving(), UIDefaults(device="cpu", mode="eager"))
    typed = "eager/fp32+lora=swap; eager/fp32+lora=corner:0.5; eager/fp32+lora=nope; eager/int8wo+lora=swap:fused"
    check = handlers.check_configurations("tiny-shapes", ["cpu"], typed)
    assert "✓ `cpu/fp32/eager+lora=swap`" in check and "✓ `cpu/fp32/eager+lora=corner:0.5`" in check
    assert "✗ `cpu/fp32/eager+lora=nope`: unknown LoRA 'nope' for tiny-shapes: choose one of swap, small" in check
    assert "✗ `cpu/int8wo/eager+lora=swap:fused`: a fused LoRA is not served on int8wo engines" in check
    outputs = list(handlers.compare(prompt=PROMPT, preset="tiny-shapes", size="64x64", steps=2, guidance=1.0, seed=3,
                                    devices=["cpu"], precisions=[], modes=[], wait_for_warm=False, caches=None,
                                    fidelity_prompts=0, configurations=typed, timing_s=0, request=None))
    gallery, payload, thumbnails = outputs[-1]
    by_config = {r["config"]: r for r in payload["results"]}
    assert list(by_config)[:3] == ["cpu/fp32/eager", "cpu/fp32/eager+lora=swap", "cpu/fp32/eager+lora=corner:0.5"]
    swap, corner = by_config["cpu/fp32/eager+lora=swap"], by_config["cpu/fp32/eager+lora=corner:0.5"]
    assert (swap["lora"], swap["lora_scale"]) == ("swap", 1.0) and (corner["lora"], corner["lora_scale"]) == ("corner", 0.5)
    assert by_config["cpu/fp32/eager"].get("lora") is None and "error" not in swap and "error" not in corner
    assert by_config["cpu/fp32/eager+lora=nope"]["error"].startswith("not run: unknown LoRA 'nope'")
    assert swap["drift_max_diff"] > 20  # the style changed the image, or the axis proves nothing
    captions = [caption for _, caption in gallery]
    assert any("LoRA swap at 1" in c for c in captions) and any("LoRA corner at 0.5" in c for c in captions)
    cards = handlers.render_compare(payload, thumbnails)[3]
    assert '<div class="c-lora">LoRA corner at scale 0.5, rank' in cards
    # a styled card's fidelity is the checker's verdict for what its style implies, not the plain prompt's
    from training.shapes import styles

    image = gallery[swap["gallery_index"]][0]
    assert swap["fidelity_this"] == styles.check(image, PROMPT, "swap").correct
    assert swap["fidelity_this"] is True  # drawn swapped: the plain checker would call it wrong


def test_the_generate_page_starts_at_the_hosts_style_and_a_pick_takes_its_scale(styled_manager):
    """app.py --lora NAME[:SCALE][:fused] sets Generate's LoRA selectors at start; picking a style moves the
    slider to that style's own scale (small is listed at 1.3), which the slider then overrides."""
    import gradio as gr

    from ui import generate
    from ui.generate import GenerateHandlers
    from ui.handlers import UIDefaults

    handlers = GenerateHandlers(styled_manager.serving(), UIDefaults(device="cpu", mode="eager", lora="corner:0.5:fused"))
    with gr.Blocks() as blocks:
        form = generate.build(handlers, blocks, gr.Markdown())
    assert (form["lora"].value, form["lora_fused"].value, form["lora_scale"].value) == ("corner", True, 0.5)
    assert handlers.style_scale("tiny-shapes", "small")["value"] == 1.3
    assert handlers.style_scale("tiny-shapes", "none") == gr.skip()


def test_compare_checkboxes_offer_each_style_unfused_and_fused(styled_manager):
    """The LoRA checkboxes are one more axis of the cross product; fused cards run fused, and a fused entry in
    a compiled mode is refused with the reason instead of run."""
    from ui import compare_views
    from ui.handlers import Handlers, UIDefaults

    handlers = Handlers(styled_manager.serving(), UIDefaults(device="cpu", mode="eager"))
    choices = compare_views.compare_lora_choices(styled_manager.catalog.preset("tiny-shapes"), True)
    assert ("swap fused", "swap:fused") in choices and choices[0] == ("none", "none")
    assert compare_views.compare_lora_choices(styled_manager.catalog.preset("tiny-shapes"), False) == [("none", "none")]
    configs = handlers._configs(["cpu"], ["fp32"], ["eager", "compile"], None, "", ["none", "swap:fused"])[0]
    assert configs == ["cpu/fp32/eager", "cpu/fp32/eager+lora=swap:fused", "cpu/fp32/compile",
                       "cpu/fp32/compile+lora=swap:fused"]
    assert "fused LoRA runs in eager mode only" in handlers.refusal("tiny-shapes", "cpu/fp32/compile+lora=swap:fused")
    outputs = list(handlers.compare(prompt=PROMPT, preset="tiny-shapes", size="64x64", steps=2, guidance=1.0, seed=3,
                                    devices=["cpu"], precisions=["fp32"], modes=["eager"], wait_for_warm=False,
                                    caches=None, fidelity_prompts=0, configurations="", timing_s=0,
                                    loras=["swap", "swap:fused"], request=None))
    by_config = {r["config"]: r for r in outputs[-1][1]["results"]}
    fused, unfused = by_config["cpu/fp32/eager+lora=swap:fused"], by_config["cpu/fp32/eager+lora=swap"]
    assert fused["lora_fused"] and not unfused["lora_fused"] and "error" not in fused
    assert fused["drift_max_diff"] > 20 and unfused["drift_max_diff"] > 20  # both drew the style


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["compile", "regional"])
def test_swaps_on_a_warm_compiled_bucket_recompile_nothing(cache_dir, adapters, mode):
    from engine.pipeline.runner import PipelineRunner

    runner = PipelineRunner(_config(cache_dir, adapters))
    runner.load()
    info = runner.warm_bucket(BucketKey(mode, Size(64, 64)))
    assert info.state.value == "warm", info.error
    warm = runner.generate(_request(mode=mode, lora="a"))
    previous = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = True
    try:
        swapped = [runner.generate(_request(mode=mode, lora=name)) for name in ("b", "narrow", None, "a")]
    finally:
        torch._dynamo.config.error_on_recompile = previous
    for result in [warm, *swapped]:
        assert result.warm and result.recompiles == 0, result.notices
    b, narrow, plain, a = swapped
    assert b.lora_run.swap_ms is not None and a.lora_run.swap_ms is not None
    assert _diff(b.image(), _fresh_image(adapters["b"], 0.5)) <= 2
    assert _diff(narrow.image(), _fresh_image(adapters["narrow"])) <= 2
    assert _diff(plain.image(), _fresh_image(None)) <= 2
    assert _diff(a.image(), warm.image()) <= 2
    assert runner.loras.state.swaps >= 4
    board = runner.lora_info()  # what the app's board shows
    assert board.swaps >= 4 and board.recompiles == 0 and board.current == "a"


# -- the embedded model's trained styles ------------------------------------------------------------------------
def test_the_committed_styles_are_small_diffusers_loras_on_the_same_layers():
    from engine.models import weights
    from training.shapes.styles import STYLES

    layers = set()
    for style in STYLES:
        path = LORAS / style / "pytorch_lora_weights.safetensors"
        assert path.stat().st_size < 1_000_000
        header = weights.read_header(path)
        names = {k.split(".lora_")[0] for k in header if k != "__metadata__"}
        assert all(n.startswith("transformer.") for n in names)
        layers.add(frozenset(names))
    assert len(layers) == 1  # any style can be hot-swapped in after any other


@pytest.mark.parametrize("style", ["swap", "small", "corner"])
def test_the_style_checker_reads_ground_truth_and_tells_the_styles_apart(style):
    from training.shapes import grammar, styles

    prompts = grammar.all_prompts()[::4]
    drawn = [styles.render(p, style, seed=i) for i, p in enumerate(prompts)]
    plain = [styles.render(p, None, seed=i) for i, p in enumerate(prompts)]
    assert styles.score(drawn, prompts, style) == 1.0
    assert styles.score(plain, prompts, style) < 0.5  # a model without the style fails the style's check
    assert styles.implied("a red circle on a blue background", "swap").text == "a blue circle on a red background"


# Floors a little under what training measured on 4 seeds per prompt (docs/embedded-model.md): one seed
# per held-out prompt here, so one miss is 4 %.
STYLE_FLOORS = {"swap": 0.85, "small": 0.75, "corner": 0.85}


@pytest.mark.slow
@pytest.mark.parametrize("style", ["swap", "small", "corner"])
def test_the_trained_styles_draw_held_out_prompts_as_they_imply(style):
    from engine.config.presets import get_preset
    from training.shapes import grammar, styles
    from training.shapes.evaluate import generate

    scale = next(lora.scale for lora in get_preset("tiny-shapes").loras if lora.name == style)  # as served
    pipe = _fresh_pipeline(LORAS / style, scale)
    prompts = list(grammar.HELD_OUT)
    images = generate(pipe, prompts, list(range(len(prompts))), 64, 64)
    assert styles.score(images, prompts, style) >= STYLE_FLOORS[style]
    pipe.set_adapters(["x"], [0.0])  # scale 0: the base model's own drawing
    assert styles.score(generate(pipe, prompts, list(range(len(prompts))), 64, 64), prompts, None) >= 0.9


@pytest.mark.slow
def test_the_repeatability_bench_times_a_style_unfused_and_fused(cache_dir, tmp_path, capsys):
    """`bench --repeatability` takes LoRA entries (its engines get the slot) and times them like any other."""
    import json

    from bench.commands import main

    code = main(["bench", "--preset", "tiny-shapes", "--repeatability", "--configs",
                 "eager/fp32+lora=swap; eager/fp32+lora=swap:fused", "--repeat-budget", "2", "--repeat-max-rounds",
                 "3", "--cache-dir", str(cache_dir), "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "repeatability.json").read_text())
    labels = [r["label"] for r in report["comparison"]["rows"]]
    assert labels == ["eager/fp32+lora=swap", "eager/fp32+lora=swap:fused"]
    assert all(r["first"]["speedup"] for r in report["comparison"]["rows"])
