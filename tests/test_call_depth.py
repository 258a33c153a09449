"""How deep the worker's call path is: the Python frames from the serving loop that takes a request off its
queue to the diffusers pipeline's `__call__`, on the tiny in-process engine. Each frame is a layer a reader
follows to see what a request runs through; the ceiling keeps new layers from creeping in."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_FRAMES = 8  # frames from the serving loop's take (included) to the frame calling the pipeline (included)


def _config(cache_dir):
    from engine.config.presets import get_preset
    from engine.protocol import EngineConfig, EngineKey, EngineOptions

    return EngineConfig(EngineKey("tiny-shapes", "cpu", "fp32"), get_preset("tiny-shapes"),
                        EngineOptions(warm_sizes=()), str(cache_dir))


def frames_to_the_pipeline(stack: list[inspect.FrameInfo]) -> list[str]:
    """The frames of `stack` (innermost first, as inspect.stack gives them) from the worker loop's outermost
    one (where the serving thread takes requests off the queue) to the caller of the pipeline: outermost first."""
    path = [f for f in reversed(stack)]
    loop = next((i for i, f in enumerate(path) if Path(f.filename).resolve() == REPO / "engine/worker/loop.py"), None)
    assert loop is not None, "the pipeline was not called from the worker loop's serving thread: " + \
        " > ".join(f.function for f in path)
    return [f"{Path(f.filename).resolve().relative_to(REPO)}:{f.function}" for f in path[loop:]]


def test_the_worker_reaches_the_pipeline_in_few_frames(cache_dir, tiny_models, monkeypatch):
    from engine.protocol import GenerateRequest
    from engine.serving.gpu import make_gpu_calls
    from engine.serving.inprocess import InProcessClient

    monkeypatch.setenv("SHOWCASE_SHORT_REQUEST_MS", "0")  # the request runs on the serving thread, not a niced one
    engine = InProcessClient(_config(cache_dir), gpu=make_gpu_calls("direct")).start()
    try:
        assert engine.wait_ready(300)
        pipeline_cls = type(engine.runner.pipe)
        original = pipeline_cls.__call__
        stacks = []

        def recording_call(pipe, *args, **kwargs):
            stacks.append(inspect.stack(context=0)[1:])  # without this wrapper's own frame
            return original(pipe, *args, **kwargs)

        monkeypatch.setattr(pipeline_cls, "__call__", recording_call)
        result = engine.generate(GenerateRequest.checked(prompt="a red circle", width=64, height=64, steps=2, guidance=1.0,
                                                 seed=0, mode="eager"), timeout=300)
        assert result.image_png
    finally:
        engine.close()
    assert len(stacks) == 1
    frames = frames_to_the_pipeline(stacks[0])
    print(f"\n{len(frames)} frames from the worker loop to the pipeline's __call__ (ceiling {MAX_FRAMES}):")
    for name in frames:
        print(f"  {name}")
    assert len(frames) <= MAX_FRAMES


def test_the_count_starts_at_the_loop_and_ends_at_the_pipelines_caller():
    def frame(filename, function):
        return inspect.FrameInfo(None, str(REPO / filename), 1, function, None, None)

    stack = [frame("engine/pipeline/calls.py", "call"), frame("engine/worker/loop.py", "serve"),
             frame("engine/worker/loop.py", "run"), frame("threading.py", "run")]
    assert frames_to_the_pipeline(stack) == ["engine/worker/loop.py:run", "engine/worker/loop.py:serve",
                                             "engine/pipeline/calls.py:call"]
    with pytest.raises(AssertionError, match="worker loop"):
        frames_to_the_pipeline(stack[:1])
