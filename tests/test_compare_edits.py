"""Compare on an edit (ui/compare.py with ui/edit_inputs.py): every configuration edits the same source, each
edit's drift is against eager fp32's edit, side by side (bf16 here; eager on cpu: nothing compiles)."""

from __future__ import annotations

import pytest
from helpers import NoProgress
from PIL import Image, ImageDraw

from ui.handlers import Handlers, UIDefaults

pytestmark = pytest.mark.slow  # loads the edit preset's engine and runs two configurations


@pytest.fixture(scope="module")
def handlers(manager):
    return Handlers(manager.serving(), UIDefaults(device="cpu", mode="eager"))


def source(tmp_path) -> str:
    image = Image.new("RGB", (64, 64), (40, 80, 220))
    ImageDraw.Draw(image).ellipse((16, 16, 48, 48), fill=(220, 40, 40))
    path = tmp_path / "source.png"
    image.save(path)
    return str(path)


def compare(handlers, **form):
    return list(handlers.compare(**{**dict(prompt="make the circle green", preset="tiny-shapes-edit", size="64x64",
                                           steps=2, guidance=None, seed=3, devices=["cpu"], precisions=None,
                                           modes=None, wait_for_warm=False, timing_s=0), **form},
                                 request=None, progress=NoProgress()))


def test_compare_edits_the_same_source_in_every_configuration(handlers, tmp_path):
    outputs = compare(handlers, images=[source(tmp_path)],
                      configurations="eager/fp32; eager/bf16")
    gallery, payload, _ = outputs[-1]
    results = {r["config"]: r for r in payload["results"]}
    assert list(results) == ["cpu/fp32/eager", "cpu/bf16/eager"], payload
    assert all("error" not in r for r in results.values()), results
    assert all(r["engine"].startswith("tiny-shapes-edit@") for r in results.values())
    assert all(r["references"] == ["64x64"] for r in results.values()), results  # the source: part of the bucket
    assert len(gallery) == 2  # one edit each: the shapes grammar's text prompts are not drawn for an edit
    bf16 = results["cpu/bf16/eager"]
    assert bf16["drift_psnr_db"] is not None and "dB" in bf16["drift"], bf16  # against eager fp32's edit
    print(f"bf16 edit against eager fp32's: {bf16['drift']}")
    reference = results["cpu/fp32/eager"]
    assert reference.get("reference") or payload["reference"] == "cpu/fp32/eager"
    # the edit checker read the source (a red circle on blue) and scored each edit against it
    assert all(isinstance(r["fidelity_this"], bool) for r in results.values()), results


def test_compare_refuses_a_source_for_a_preset_that_draws_from_text(handlers, tmp_path):
    import gradio as gr

    with pytest.raises(gr.Error, match="takes text to image only: remove the input image"):
        compare(handlers, preset="tiny-shapes", images=[source(tmp_path)], configurations="eager/fp32")


def test_compare_shows_its_image_input_only_for_presets_that_edit(handlers):
    from ui.edit_inputs import EditInputs

    edits = EditInputs(handlers)
    assert edits.takes_images("tiny-shapes-edit")["visible"] is True
    assert edits.takes_images("tiny-shapes")["visible"] is False


def test_compare_decodes_its_source_once_for_every_configuration(handlers, tmp_path, monkeypatch):
    from engine.config import images

    decodes = []
    decoded = images._decoded
    monkeypatch.setattr(images, "_decoded", lambda name, *a: decodes.append(name) or decoded(name, *a))
    outputs = compare(handlers, images=[source(tmp_path)], configurations="eager/fp32; eager/bf16")
    assert all("error" not in r for r in outputs[-1][1]["results"]), outputs[-1][1]
    assert decodes == ["image 1"]  # two configurations' edits (and the checker's source) share one decode
