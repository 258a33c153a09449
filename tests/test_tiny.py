"""The random-weight tiny pipelines: they build offline, reload with the generic loader, generate images,
rebuild bit-identically, and ensure_tiny_pipeline builds each one only once."""

from __future__ import annotations

import os

# Everything here must work without the Hub; set before huggingface_hub reads it at import.
os.environ["HF_HUB_OFFLINE"] = "1"

import hashlib
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from engine.errors import InvalidRequest
from engine.models import tiny, tiny_tokenizers


def _file_hashes(folder: Path) -> dict[str, str]:
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


def _generate(pipe, prompt: str = "a red fox in the snow", height: int = 64, width: int = 64):
    # Flux2Klein's first positional parameter is `image`: always pass prompt by keyword.
    return pipe(
        prompt=prompt,
        height=height,
        width=width,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images


@pytest.fixture(scope="session")
def models_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def built(models_root):
    """Every preset, built once through ensure_tiny_pipeline for the whole session."""
    return {name: tiny.ensure_tiny_pipeline(name, models_root) for name in tiny.TINY_PRESETS}


@pytest.fixture(scope="session")
def flux_pipe(built):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(built["tiny-flux"], dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


EXPECTED_CLASS = {
    "tiny-flux": "FluxPipeline",
    "tiny-flux2-klein": "Flux2KleinPipeline",
    "tiny-sd3": "StableDiffusion3Pipeline",
    "tiny-sdxl": "StableDiffusionXLPipeline",
}


def test_presets_listed():
    assert tiny.TINY_PRESETS == tuple(EXPECTED_CLASS)


@pytest.mark.parametrize("name", tiny.TINY_PRESETS)
def test_builds_reloads_and_generates(built, name):
    import diffusers
    from diffusers import DiffusionPipeline

    path = built[name]
    assert (path / tiny.COMPLETE_MARKER).is_file()
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size < 8_000_000, f"{name} is {size} bytes; it should stay tiny"
    assert list(path.rglob("*.safetensors")), "weights must be safetensors"
    assert not list(path.rglob("*.bin"))

    pipe = DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
    assert type(pipe).__name__ == EXPECTED_CLASS[name]
    assert pipe.vae_scale_factor == 8
    pipe.set_progress_bar_config(disable=True)
    images = _generate(pipe)
    assert images.shape == (1, 64, 64, 3)
    assert torch.isfinite(torch.from_numpy(images)).all()
    assert images.std() > 0.01, "a random-weight model still gives a non-constant image"

    # The specific class loads the same folder too.
    specific = getattr(diffusers, EXPECTED_CLASS[name]).from_pretrained(path, dtype=torch.float32)
    specific.set_progress_bar_config(disable=True)
    assert (_generate(specific) == images).all()


@pytest.mark.parametrize(("height", "width"), [(64, 128), (128, 64), (128, 128)])
def test_flux_sizes(flux_pipe, height, width):
    assert _generate(flux_pipe, height=height, width=width).shape == (1, height, width, 3)


def test_flux_empty_and_very_long_prompt(flux_pipe):
    assert _generate(flux_pipe, prompt="").shape == (1, 64, 64, 3)
    long_prompt = " ".join(f"castle{i % 50} near a lake" for i in range(500))  # 2000 words
    assert len(long_prompt.split()) == 2000
    assert _generate(flux_pipe, prompt=long_prompt).shape == (1, 64, 64, 3)  # truncated, not a crash


def test_flux2_klein_chat_template(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["tiny-flux2-klein"] / "tokenizer")
    messages = [{"role": "user", "content": "a cat"}]
    off = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert off == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert on == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    for special in tiny_tokenizers.QWEN_SPECIAL_TOKENS:  # each one a single token, never split by BPE
        assert len(tok(special, add_special_tokens=False).input_ids) == 1


def test_tokenizers_keep_capitals_and_lengths(built):
    from transformers import AutoTokenizer

    clip = AutoTokenizer.from_pretrained(built["tiny-flux"] / "tokenizer")
    t5 = AutoTokenizer.from_pretrained(built["tiny-flux"] / "tokenizer_2")
    assert clip.model_max_length == 77
    assert t5.model_max_length >= 512
    text = "A Photo of MOUNT Fuji, 1999!"
    # (CLIP's unk token is <|endoftext|>, also its eos: look at the text tokens only.)
    assert clip.unk_token_id not in clip(text, add_special_tokens=False).input_ids
    assert t5.unk_token_id not in t5(text, add_special_tokens=False).input_ids


def test_rebuild_is_byte_identical(built, tmp_path):
    # In-process rebuild: the tokenizer caches are cleared so they are trained again as well.
    for fn in (tiny_tokenizers._clip_vocab_merges, tiny_tokenizers._t5_vocab, tiny_tokenizers._qwen_vocab_merges,
               tiny_tokenizers.training_corpus):
        fn.cache_clear()
    tiny.build_tiny_pipeline("tiny-flux", tmp_path / "again")
    original = _file_hashes(built["tiny-flux"])
    original.pop(tiny.COMPLETE_MARKER)
    assert _file_hashes(tmp_path / "again") == original


def _rebuild_in_subprocess(out: str) -> None:
    tiny.build_tiny_pipeline("tiny-flux2-klein", Path(out))


@pytest.mark.slow  # rebuilds a model in a child process
def test_rebuild_in_another_process_is_byte_identical(built, tmp_path):
    # A fresh interpreter has different hash seeds: this is what broke the `tokenizers` trainers.
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_rebuild_in_subprocess, args=(str(tmp_path / "again"),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    original = _file_hashes(built["tiny-flux2-klein"])
    original.pop(tiny.COMPLETE_MARKER)
    assert _file_hashes(tmp_path / "again") == original


def test_ensure_builds_once(tmp_path, monkeypatch):
    calls = []
    real_build = tiny.build_tiny_pipeline

    def counting_build(name, out_dir):
        calls.append(name)
        real_build(name, out_dir)

    monkeypatch.setattr(tiny, "build_tiny_pipeline", counting_build)
    first = tiny.ensure_tiny_pipeline("tiny-sdxl", tmp_path)
    assert first == tmp_path / "tiny-sdxl"
    marker = first / tiny.COMPLETE_MARKER
    mtime = marker.stat().st_mtime_ns
    second = tiny.ensure_tiny_pipeline("tiny-sdxl", tmp_path)
    assert second == first
    assert calls == ["tiny-sdxl"]
    assert marker.stat().st_mtime_ns == mtime
    assert not list(tmp_path.glob(".tiny-sdxl.tmp-*")), "the temporary build folder was renamed away"


def test_ensure_replaces_incomplete_folder(tmp_path):
    broken = tmp_path / "tiny-sdxl"
    (broken / "unet").mkdir(parents=True)  # e.g. copied by hand, no marker
    (tmp_path / ".tiny-sdxl.tmp-dead").mkdir()  # leftover of a builder that died
    path = tiny.ensure_tiny_pipeline("tiny-sdxl", tmp_path)
    assert (path / tiny.COMPLETE_MARKER).is_file()
    assert (path / "model_index.json").is_file()
    assert not (tmp_path / ".tiny-sdxl.tmp-dead").exists()


def _ensure_in_subprocess(root: str, log: str) -> None:
    real_build = tiny.build_tiny_pipeline

    def logging_build(name, out_dir):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)  # widen the window in which the other processes must wait on the lock
        real_build(name, out_dir)

    tiny.build_tiny_pipeline = logging_build
    tiny.ensure_tiny_pipeline("tiny-flux", Path(root))


@pytest.mark.slow  # builds a model in several processes at once
def test_ensure_parallel_processes_build_once(tmp_path):
    root, log = tmp_path / "models", tmp_path / "builds.log"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_ensure_in_subprocess, args=(str(root), str(log))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(log.read_text().split()) == 1, "exactly one process built it; the others waited and reused it"
    assert (root / "tiny-flux" / tiny.COMPLETE_MARKER).is_file()
    assert not list(root.glob(".tiny-flux.tmp-*"))


def test_unknown_name_raises(tmp_path):
    with pytest.raises(InvalidRequest) as err:
        tiny.ensure_tiny_pipeline("tiny-nope", tmp_path)
    for name in tiny.TINY_PRESETS:
        assert name in str(err.value)
    with pytest.raises(InvalidRequest):
        tiny.build_tiny_pipeline("tiny-nope", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_building_a_tiny_model_draws_no_library_progress_bar(tmp_path, capfd):
    """A first start builds the embedded models: transformers' "Writing model shards" bar took console lines
    before the URL."""
    from engine.models.tiny import build_tiny_pipeline

    build_tiny_pipeline("tiny-flux", tmp_path / "tiny-flux")
    assert "Writing model shards" not in capfd.readouterr().err
