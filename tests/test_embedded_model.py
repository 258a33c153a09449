"""The embedded shapes model: grammar, fidelity checker, and the committed trained pipeline.

The checker tests pin it to the ground truth (it must read renders right and refuse noise or wrong
attributes); the model tests load models/tiny-shapes exactly as the app does and require a floor of correct
drawings on a fixed sample, so a broken export, a wrong scheduler setting or a damaged weight file fails.
The floors sit well below the measured rates (docs/embedded-model.md) so the tests are not flaky across
torch builds, yet far above what random weights draw (0).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from training.shapes import grammar
from training.shapes.fidelity import check, read
from training.shapes.grammar import COLOURS, HELD_OUT, SHAPES, Prompt, all_prompts, parse_prompt, render
from training.shapes.train import BUCKETS, DEFAULT_STEPS, MAX_SEQUENCE_LENGTH, SHIFT

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-shapes"
SAMPLE = 12  # prompts per model test
FLOOR_64 = 10  # of 12 at 64x64 (measured: see docs/embedded-model.md)
FLOOR_RECT = 9  # of 12 at 128x64
FLOOR_HELD_OUT = 9  # of 12 held-out prompts at 64x64


# --------------------------------------------------------------------------------------------------
# Grammar.
# --------------------------------------------------------------------------------------------------
def test_grammar_has_168_prompts_and_a_covering_held_out_list():
    prompts = all_prompts()
    assert len(prompts) == len(set(prompts)) == 8 * 7 * 3
    assert len(HELD_OUT) >= 16 and len(set(HELD_OUT)) == len(HELD_OUT)
    assert set(HELD_OUT) <= set(prompts)
    training = grammar.training_prompts()
    assert len(training) == len(prompts) - len(HELD_OUT)
    assert {p.colour for p in training} == set(COLOURS)
    assert {p.background for p in training} == set(COLOURS)
    assert {p.shape for p in training} == set(SHAPES)
    # Generalisation is compositional: every (colour, shape) pair is still trained with other backgrounds.
    assert {(p.colour, p.shape) for p in training} == {(c, s) for c in COLOURS for s in SHAPES}


def test_parse_prompt_round_trips_and_rejects_other_text():
    for prompt in all_prompts():
        assert parse_prompt(prompt.text) == prompt
    assert parse_prompt("  A Red circle on an orange background. ") == Prompt("red", "circle", "orange")
    for text in ("a red circle on a red background", "a pink circle on a blue background", "a red circle", ""):
        assert parse_prompt(text) is None


def test_every_grammar_word_has_its_own_tokens_and_prompts_fit_the_text_length():
    from engine.models.tiny_tokenizers import build_clip_tokenizer, build_t5_tokenizer

    words = [*COLOURS, *SHAPES, "a", "on", "background"]
    for tokenizer in (build_t5_tokenizer(), build_clip_tokenizer()):
        pieces = {w: tuple(tokenizer.tokenize(w)) for w in words}
        assert len(set(pieces.values())) == len(words)
        unk = tokenizer.unk_token
        assert all(unk not in p for p in pieces.values())
    t5 = build_t5_tokenizer()
    assert max(len(t5(p.text).input_ids) for p in all_prompts()) <= MAX_SEQUENCE_LENGTH


# --------------------------------------------------------------------------------------------------
# Fidelity checker.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("width,height", BUCKETS)
def test_checker_reads_ground_truth_renders(width, height):
    rng = np.random.default_rng(width * 1000 + height)
    prompts = all_prompts()
    picks = [prompts[i] for i in rng.integers(0, len(prompts), 150)]
    correct = sum(check(render(p, width, height, rng), p).correct for p in picks)
    assert correct / len(picks) >= 0.99


@pytest.mark.parametrize("width,height", [(64, 64), (128, 64)])
def test_checker_is_not_fooled_by_noise(width, height):
    rng = np.random.default_rng(1)
    prompts = all_prompts()
    hits = 0
    for i in range(100):
        noise = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        hits += check(noise, prompts[i]).correct
        # Noise blurred into blobs is still no flat object on a flat background.
        blobs = np.repeat(np.repeat(rng.integers(0, 256, (height // 8, width // 8, 3)), 8, 0), 8, 1)
        hits += check(Image.fromarray(blobs.astype(np.uint8)), prompts[i]).correct
    assert hits <= 2


def test_checker_rejects_wrong_attributes():
    image = render("a red circle on a white background", 64, 64, 0)
    assert check(image, "a red circle on a white background").correct
    for wrong, right in [
        ("a blue circle on a white background", 2),
        ("a red square on a white background", 2),
        ("a red circle on a black background", 2),
        ("a white circle on a red background", 1),  # colours swapped: only the shape is right
    ]:
        result = check(image, wrong)
        assert not result.correct and result.attributes_right == right, (wrong, result)
    assert not check(image, "a photo of a cat").correct
    # A flat image has a background but no object.
    flat = Image.new("RGB", (64, 64), COLOURS["white"])
    assert read(flat).shape is None and not check(flat, "a red circle on a white background").correct


def test_checker_tells_the_shapes_apart_by_geometry():
    rng = np.random.default_rng(3)
    for shape in SHAPES:
        for _ in range(20):
            assert read(render(Prompt("green", shape, "black"), 64, 64, rng)).shape == shape
    # An upside-down triangle is no shape of the grammar.
    upright = np.asarray(render(Prompt("green", "triangle", "black"), 64, 64, 5))
    assert read(upright[::-1].copy()).shape is None


# --------------------------------------------------------------------------------------------------
# The semantic latent space.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("width, height", BUCKETS)
def test_the_latents_describe_the_scene_exactly_also_when_corrupted(width, height):
    """Read with the exact rules, the analytic latents give back the rendered image pixel for pixel; so do
    the corrupted latents the decoder learns to clean up (the corruption never changes the scene)."""
    import torch

    from training.shapes import latents

    generator = torch.Generator().manual_seed(0)
    prompts = [all_prompts()[i] for i in torch.randint(0, len(all_prompts()), (64,), generator=generator)]
    images, z = latents.scenes(prompts, width, height, generator)
    assert z.shape == (64, latents.CHANNELS, height // latents.SCALE, width // latents.SCALE)
    assert z.abs().max() <= 1
    assert torch.equal(latents.render_exact(z, width, height), images)
    corrupted = latents.corrupt(z, generator, clean_share=0.0)
    assert not torch.equal(corrupted, z)
    assert torch.equal(latents.render_exact(corrupted, width, height), images)
    # The position channels are the cells' own coordinates, the same in every image.
    assert torch.equal(z[:, :2], latents.position_grid(width, height).expand(64, 2, *z.shape[2:]))


# --------------------------------------------------------------------------------------------------
# The committed model.
# --------------------------------------------------------------------------------------------------
def _sample(n: int, seed: int):
    rng = np.random.default_rng(seed)
    training = grammar.training_prompts()
    return [training[i] for i in rng.integers(0, len(training), n)], [int(s) for s in rng.integers(0, 2**31, n)]


@pytest.fixture(scope="module")
def pipe_fp32():
    from training.shapes.evaluate import load

    return load(MODEL, torch.float32)


def _correct(pipe, width, height, seed):
    from training.shapes.evaluate import generate

    prompts, seeds = _sample(SAMPLE, seed)
    images = generate(pipe, prompts, seeds, width, height, DEFAULT_STEPS, batch=SAMPLE)
    assert all(i.size == (width, height) for i in images)
    return sum(check(i, p).correct for i, p in zip(images, prompts, strict=True))


def test_committed_model_is_small_and_safetensors_only():
    files = [f for f in MODEL.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 20 * 1024 * 1024
    weights = [f for f in files if f.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt")]
    assert weights and all(f.suffix == ".safetensors" for f in weights)
    index = json.loads((MODEL / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"


def test_committed_model_has_the_training_schedule(pipe_fp32):
    config = pipe_fp32.scheduler.config
    assert type(pipe_fp32.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert config.shift == SHIFT and not config.use_dynamic_shifting
    assert pipe_fp32.vae_scale_factor == 4 and not pipe_fp32.transformer.config.guidance_embeds


@pytest.mark.slow  # every prompt of the grammar through the pipeline
def test_committed_model_draws_its_prompts_at_64x64(pipe_fp32):
    assert _correct(pipe_fp32, 64, 64, seed=11) >= FLOOR_64


def test_committed_model_draws_its_prompts_at_128x64(pipe_fp32):
    assert _correct(pipe_fp32, 128, 64, seed=12) >= FLOOR_RECT


def test_committed_model_draws_in_bfloat16():
    from training.shapes.evaluate import load

    pipe = load(MODEL, torch.bfloat16)
    assert pipe.transformer.dtype == torch.bfloat16
    assert _correct(pipe, 64, 64, seed=11) >= FLOOR_64 - 1


def test_committed_model_draws_held_out_prompts(pipe_fp32):
    """Combinations never trained on (grammar.HELD_OUT): the model composes words it saw apart."""
    from training.shapes.evaluate import generate

    prompts = list(HELD_OUT[::2])  # 12 of the 24
    seeds = list(range(len(prompts)))
    images = generate(pipe_fp32, prompts, seeds, 64, 64, DEFAULT_STEPS, batch=len(prompts))
    assert sum(check(i, p).correct for i, p in zip(images, prompts, strict=True)) >= FLOOR_HELD_OUT
