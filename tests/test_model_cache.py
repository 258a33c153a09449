"""The random-weight tiny pipelines' cache is never trusted on its marker alone, and weight headers are read bounded.

- A folder marked complete whose component lacks its weights (what a sidecar rank other than 0 used to
  leave) is detected and rebuilt, with a warning; so is one with a corrupt weight header.
- A rank inside a torch.distributed group builds in a fresh process (transformers writes weights on global
  rank 0 only).
- A safetensors header whose length is absurd raises CorruptWeights naming the component (no folder path),
  from the footprint estimate too, instead of a MemoryError.
- A models folder that cannot be written (read-only, full) falls back to a private temporary one instead of
  failing the request with a raw OSError.
"""

from __future__ import annotations

import errno
import logging
import shutil
import struct
from pathlib import Path

import pytest

from engine.models import tiny
from engine.models.weights import CorruptWeights


def _copy(tiny_models, name: str, root: Path) -> Path:
    target = root / name
    shutil.copytree(tiny_models[name], target)
    return target


def _corrupt_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 5 * 10**18)
    path.write_bytes(bytes(data))


def test_a_marker_without_weights_is_detected_and_rebuilt(tiny_models, tmp_path, caplog):
    target = _copy(tiny_models, "tiny-flux", tmp_path)
    (target / "text_encoder" / "model.safetensors").unlink()
    assert (target / tiny.COMPLETE_MARKER).is_file()
    assert "text_encoder has no weight files" in tiny.check_pipeline_folder(target)
    with caplog.at_level(logging.WARNING, logger="engine.models.tiny"):
        assert tiny.ensure_tiny_pipeline("tiny-flux", tmp_path) == target
    assert "rebuilding it" in caplog.text
    assert tiny.check_pipeline_folder(target) is None
    rebuilt = (target / "text_encoder" / "model.safetensors").read_bytes()
    assert rebuilt == (tiny_models["tiny-flux"] / "text_encoder" / "model.safetensors").read_bytes()


def test_a_corrupt_weight_header_is_detected_and_rebuilt(tiny_models, tmp_path):
    target = _copy(tiny_models, "tiny-sdxl", tmp_path)
    _corrupt_header(target / "unet" / "diffusion_pytorch_model.safetensors")
    assert "component unet" in tiny.check_pipeline_folder(target)
    tiny.ensure_tiny_pipeline("tiny-sdxl", tmp_path)
    assert tiny.check_pipeline_folder(target) is None


def test_a_rank_in_a_process_group_builds_in_a_fresh_process(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(tiny, "_build_in_subprocess", lambda name, out: calls.append((name, out)))
    tiny.build_tiny_pipeline("tiny-flux", tmp_path / "out")
    assert calls == [("tiny-flux", tmp_path / "out")]


def test_a_corrupt_header_names_the_component_not_a_memory_error(tiny_models, tmp_path, monkeypatch):
    from helpers import engine_manager

    from engine.protocol import EngineKey
    from engine.serving import budget, footprints

    target = _copy(tiny_models, "tiny-flux", tmp_path)
    _corrupt_header(target / "text_encoder" / "model.safetensors")
    with pytest.raises(CorruptWeights, match=r"component text_encoder \(model.safetensors\) are corrupt") as err:
        budget.safetensors_parameters(target)
    assert str(tmp_path) not in str(err.value)

    with engine_manager(tmp_path / "cache") as m:
        monkeypatch.setattr(footprints, "resolve_source", lambda config: str(target))
        with pytest.raises(CorruptWeights, match="component text_encoder"):
            m.budgets.estimate(EngineKey("tiny-flux", "cpu", "fp32", 1))


def test_an_unwritable_models_folder_falls_back_to_a_private_temporary_one(tmp_path, monkeypatch, caplog):
    """The cache's models folder turns read-only after start: its lock file cannot be created."""
    import builtins

    readonly = tmp_path / "cache" / "models"
    readonly.mkdir(parents=True)
    real_open = builtins.open

    def open_ro(path, mode="r", *args, **kwargs):
        if Path(path).parent == readonly and any(c in mode for c in "wa+x"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(tiny, "open", open_ro, raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with caplog.at_level(logging.WARNING, logger="engine.models.tiny"):
        path = tiny.ensure_tiny_pipeline("tiny-flux", readonly)
    assert path.parent.parent.parent == tmp_path / "tmp" and tiny.check_pipeline_folder(path) is None
    assert (path.parent.parent.stat().st_mode & 0o777) == 0o700
    assert "Read-only file system" in caplog.text and "--cache-dir" in caplog.text
