"""The worker protocol: a message's class is its kind; each end handles every message sent its way, and an
unknown message is refused, never dropped."""

from __future__ import annotations

import logging

from engine.protocol import (
    BucketChanged,
    Cancel,
    CompileFinished,
    CompileGranted,
    CompileWanted,
    Fatal,
    FoldersChanged,
    FootprintChanged,
    Generate,
    InjectFault,
    LoraChanged,
    Progress,
    Ready,
    RequestFailed,
    Result,
    Shutdown,
    Warm,
    dispatch,
)
from engine.worker.client import ConnectionClient
from engine.worker.loop import WorkerLoop

TO_ENGINE = {Generate, Cancel, Warm, Shutdown, InjectFault, CompileGranted}
FROM_ENGINE = {CompileWanted, CompileFinished, FootprintChanged, Ready, Fatal, BucketChanged, Progress, Result,
               RequestFailed, FoldersChanged, LoraChanged}


def test_each_end_handles_every_message_sent_its_way():
    assert set(WorkerLoop._handlers(object.__new__(WorkerLoop))) == TO_ENGINE
    assert set(ConnectionClient._handlers(object.__new__(ConnectionClient))) == FROM_ENGINE


def test_a_message_goes_to_its_classs_handler_and_an_unknown_one_is_refused(caplog):
    seen = []
    handlers = {Cancel: seen.append, Shutdown: seen.append}
    assert dispatch(Cancel("r1"), handlers, logging.getLogger("test"), "the test")
    assert dispatch(Shutdown(), handlers, logging.getLogger("test"), "the test")
    assert seen == [Cancel("r1"), Shutdown()]
    assert not dispatch(Warm(None), handlers, logging.getLogger("test"), "the test")
    assert "unknown message from the test: 'Warm'" in caplog.text


def test_engine_options_are_composed_by_concern_and_read_by_flat_name():
    import dataclasses
    import pickle

    from engine.protocol import BatchingOptions, EngineOptions, Mode, RecipeOptions, WarmupOptions

    options = EngineOptions(warm_sizes=(), max_batch=1, cuda_graphs=True, warm_modes=("aot",))
    assert options.warmup == WarmupOptions(modes=(Mode.AOT,), sizes=())
    assert options.batching == BatchingOptions(max_batch=1) and options.recipe == RecipeOptions(cuda_graphs=True)
    assert (options.warm_sizes, options.max_batch, options.cuda_graphs) == ((), 1, True)  # the flags' spelling
    assert EngineOptions.batch_wait_ms == BatchingOptions.batch_wait_ms  # a flat name's default, on the class
    assert pickle.loads(pickle.dumps(options)) == options  # it travels to a worker pickled
    changed = dataclasses.replace(options, max_autotune=True)
    assert changed.recipe.max_autotune and changed.batching == options.batching
    assert EngineOptions(recipe=RecipeOptions(loras=True), fuse_qkv=True).recipe == RecipeOptions(loras=True, fuse_qkv=True)
