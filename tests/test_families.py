"""The family registry (engine/families): one home per pipeline class, read back by `--model` folder detection,
the preset table and the pipeline call; no other source file names a pipeline class."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.config.presets import load_presets, preset_for_model
from engine.families import registry
from engine.families.family import PipelineFamily
from engine.protocol import ImageInputs

REPO = Path(__file__).resolve().parent.parent
CLASS_NAME = re.compile(r"\b(?:Flux|Flux2|Flux2Klein|FluxKontext|FluxImg2Img|FluxInpaint|Wan|WanImageToVideo|LTX|"
                        r"LTXImageToVideo|QwenImageEditPlus|StableDiffusion3|StableDiffusionXL)Pipeline\b")


def _folder(root: Path, name: str, cls: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": cls, "_diffusers_version": "0.42.1"}))
    return folder


def test_pipeline_class_names_live_only_in_the_families_and_the_tiny_builders():
    offenders = []
    for path in [*REPO.joinpath("engine").rglob("*.py"), *REPO.joinpath("ui").rglob("*.py"), REPO / "app.py"]:
        rel = path.relative_to(REPO)
        if rel.parts[:2] in (("engine", "families"), ("engine", "models")):
            continue
        if CLASS_NAME.search(path.read_text()):
            offenders.append(str(rel))
    assert offenders == [], f"pipeline class names outside engine/families and engine/models: {offenders}"


def test_every_preset_row_has_a_registered_family():
    for preset in load_presets().values():
        family = registry.find(preset.pipeline)
        assert family is not None, preset.name
        if preset.video:
            assert family.task == "video", preset.name


@pytest.mark.parametrize("cls, frames", [("WanPipeline", True), ("WanImageToVideoPipeline", True),
                                         ("LTXPipeline", True), ("LTXImageToVideoPipeline", True)])
def test_model_takes_a_wan_or_ltx_folder_with_its_family_defaults(tmp_path, cls, frames):
    folder = _folder(tmp_path / "models", cls.lower(), cls)
    preset = preset_for_model(str(folder), allowed_roots=[tmp_path / "models"])
    family = registry.find(cls)
    assert preset.pipeline == cls
    assert preset.video is frames and preset.frames == family.frames
    assert (preset.steps, preset.guidance, preset.fps) == (family.steps, family.guidance, family.fps)
    if cls.endswith("ImageToVideoPipeline"):
        assert preset.inputs is ImageInputs.FIRST_FRAME


def test_a_new_family_is_one_record_and_every_reader_finds_it(tmp_path):
    """A family declared the way a module of engine/families declares one is read back by the registry and by
    `--model` folder detection, with its own defaults and task; an unregistered class is refused."""
    folder = _folder(tmp_path / "models", "toy", "ToyDiffusionPipeline")
    with pytest.raises(Exception, match="not supported"):
        preset_for_model(str(folder), allowed_roots=[tmp_path / "models"])
    toy = PipelineFamily(pipeline="ToyDiffusionPipeline", task="text-to-image", bucket_family="default",
                         denoiser="transformer", alignment=16, cfg=True, takes_negative=True, steps=7, guidance=2.5)
    registry.register(toy)
    try:
        assert registry.find("ToyDiffusionPipeline") is toy
        assert toy in registry.families()
        preset = preset_for_model(str(folder), allowed_roots=[tmp_path / "models"])
        assert (preset.pipeline, preset.steps, preset.guidance) == ("ToyDiffusionPipeline", 7, 2.5)
        assert preset.cfg and preset.negative_prompt and not preset.video
        assert preset.task == "text-to-image"
    finally:
        registry._FAMILIES.pop("ToyDiffusionPipeline", None)


def test_a_class_is_declared_once():
    flux = registry.find("FluxPipeline")
    with pytest.raises(ValueError, match="declared twice"):
        registry.register(PipelineFamily(pipeline="FluxPipeline", task="text-to-image", bucket_family="flux",
                                         denoiser="transformer", alignment=16, cfg=False, takes_negative=False,
                                         steps=1, guidance=0.0))
    assert registry.find("FluxPipeline") is flux


def test_only_flux1_declares_a_step_function_the_stepper_knows():
    from engine.pipeline.stepping import STEP_FUNCTIONS

    stepped = {f.pipeline for f in registry.families() if f.step}
    assert stepped == {"FluxPipeline"}
    assert all(f.step in STEP_FUNCTIONS for f in registry.families() if f.step)
