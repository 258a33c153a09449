"""The shared test helpers fail when they should (a helper that never fails hides broken tests)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import BAD_INPUTS, free_port, poll, process_gone, wait_until


def test_wait_until_returns_the_value_or_fails_with_the_message():
    calls = iter([None, 0, "ready"])
    assert wait_until(lambda: next(calls), 5, 0.001) == "ready"
    with pytest.raises(AssertionError, match="the engine warming not met within"):
        wait_until(lambda: None, 0.05, 0.01, message=lambda: "the engine warming")
    assert poll(lambda: [], 0.02, 0.01) == []


def test_process_gone_sees_an_exited_child_even_before_it_is_reaped():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not process_gone(child.pid)
        child.kill()
        wait_until(lambda: process_gone(child.pid), 10, message="the killed child exiting")
    finally:
        child.kill()
        child.wait()
    assert process_gone(child.pid)


def test_free_port_and_the_shared_bad_input_table():
    assert 0 < free_port() < 65536
    assert len(BAD_INPUTS) >= 30
    assert all(isinstance(overrides, dict) and words for overrides, words in BAD_INPUTS)
