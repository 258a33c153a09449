"""Each preset's task (text to image, edit, video) read from its declaration, and each task's default model: the
embedded one that draws, never a random-weight preset unless nothing else makes that task (no model needed)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config.defaults import task_default, task_of_request
from engine.config.presets import load_presets
from engine.protocol import Task


@pytest.mark.parametrize(("name", "task"), [
    ("tiny-shapes", Task.TEXT_TO_IMAGE), ("flux2-klein-4b", Task.TEXT_TO_IMAGE),  # FLUX.2: references optional
    ("tiny-shapes-edit", Task.EDIT), ("tiny-shapes-img2img", Task.EDIT), ("tiny-flux-inpaint", Task.EDIT),
    ("tiny-shapes-video", Task.VIDEO), ("tiny-wan-i2v", Task.VIDEO), ("tiny-ltx", Task.VIDEO),
])
def test_a_presets_task_comes_from_its_inputs_and_frames(name, task):
    preset = load_presets()[name]
    assert preset.task is task
    assert preset.describe()["task"] == str(task)


def test_random_weight_presets_say_so_and_the_embedded_ones_draw():
    presets = load_presets()
    assert presets["tiny-wan"].random_weights and not presets["tiny-wan"].draws
    assert presets["tiny-wan"].describe()["random_weights"] is True
    for name in ("tiny-shapes", "tiny-shapes-edit", "tiny-shapes-video"):
        assert presets[name].draws and not presets[name].random_weights
        assert presets[name].describe()["random_weights"] is False
    assert not presets["flux1-dev"].random_weights and not presets["flux1-dev"].draws  # real weights, no checker


def test_each_tasks_default_is_the_embedded_model_that_draws():
    presets = list(load_presets().values())
    assert {task: task_default(presets, task).name for task in Task} == {
        Task.TEXT_TO_IMAGE: "tiny-shapes", Task.EDIT: "tiny-shapes-edit", Task.VIDEO: "tiny-shapes-video"}


def test_a_random_weight_preset_is_a_default_only_where_nothing_else_makes_that_task():
    presets = load_presets()
    served = [presets[name] for name in ("tiny-wan", "tiny-wan-i2v", "wan2.1-t2v-1.3b", "tiny-flux")]
    assert task_default(served, "video").name == "wan2.1-t2v-1.3b"  # real weights beat noise, first served or not
    assert task_default(served, "video", preferred="tiny-wan").name == "wan2.1-t2v-1.3b"
    assert task_default(served[:2], "video").name == "tiny-wan"  # only noise serves clips here
    assert task_default(served, "edit") is None


def test_the_hosts_own_choice_wins_where_it_makes_that_task():
    presets = load_presets()
    served = [presets[name] for name in ("tiny-shapes", "flux1-dev", "tiny-shapes-edit")]
    assert task_default(served, Task.TEXT_TO_IMAGE, preferred="flux1-dev").name == "flux1-dev"
    assert task_default(served, Task.EDIT, preferred="flux1-dev").name == "tiny-shapes-edit"
    moved = dataclasses.replace(presets["tiny-shapes"], name="another-shapes")
    assert task_default([moved, presets["tiny-shapes"]], Task.TEXT_TO_IMAGE).name == "another-shapes"  # served order


def test_a_request_with_no_model_names_its_task_by_what_it_sends():
    assert task_of_request() is Task.TEXT_TO_IMAGE
    assert task_of_request(images=True) is Task.EDIT
    assert task_of_request(frames=True, images=True) is Task.VIDEO
