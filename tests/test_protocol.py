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
               RequestFailed, FoldersChanged}


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
