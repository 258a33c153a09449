"""The worker protocol's messages (client <-> engine) and the tensor-parallel operations (rank 0 ->
every rank)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import ShowcaseError
from engine.protocol.requests import EngineReady, Footprint, GenerateRequest, GenerateResult, StepProgress
from engine.protocol.vocabulary import BucketInfo, BucketKey, LoraInfo


class Fault(enum.StrEnum):
    """One-shot faults a test can arm in an engine started with TestingOptions(inject_faults=True)."""

    OOM = "oom"  # the next request raises the device's out-of-memory error
    CRASH = "crash"  # the worker process dies at the next request's first step


# A message's class is its kind: both ends dispatch on it (`dispatch`), and the connection pickles it.
# Client -> engine:


@dataclass(frozen=True)
class Generate:
    request: GenerateRequest


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Warm:
    bucket: BucketKey | None  # None: the engine's start-up warm list


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class InjectFault:
    """Tests only; refused unless EngineOptions.testing.inject_faults."""

    fault: Fault


@dataclass(frozen=True)
class CompileGranted:
    """The host's compile scheduler lets the engine compile a bucket."""

    bucket: BucketKey


# Engine -> client:


@dataclass(frozen=True)
class CompileWanted:
    """The engine asks the host's compile scheduler for a compile slot."""

    bucket: BucketKey
    waiting: int = 0  # requests blocked on it (on_cold=wait)
    hits: int = 0  # requests that asked for it so far
    startup_rank: int | None = None  # its place in the engine's start-up warm list


@dataclass(frozen=True)
class CompileFinished:
    """The engine gives back the compile slot it was granted."""

    bucket: BucketKey


@dataclass(frozen=True)
class FootprintChanged:
    """Its memory footprint changed (after a warm-up)."""

    footprint: Footprint


@dataclass(frozen=True)
class FoldersChanged:
    """Its compile or temporary folders moved (the cache disk filled up or turned read-only), and why."""

    folders: tuple[tuple[str, str], ...]
    notice: str = ""


@dataclass(frozen=True)
class Ready:
    ready: EngineReady


@dataclass(frozen=True)
class Fatal:
    """The engine could not start; it exits."""

    error: ShowcaseError


@dataclass(frozen=True)
class BucketChanged:
    info: BucketInfo


@dataclass(frozen=True)
class LoraChanged:
    """Its LoRA slot changed (a swap, a scale, a recompile): sent before the result of the call that changed it."""

    info: LoraInfo


@dataclass(frozen=True)
class Progress:
    progress: StepProgress


@dataclass(frozen=True)
class Result:
    result: GenerateResult


@dataclass(frozen=True)
class RequestFailed:
    """One request failed; the engine keeps serving."""

    request_id: str | None  # None: a message that was not a request could not be handled
    error: ShowcaseError


def dispatch(message, handlers: dict[type, Callable], log, peer: str) -> bool:
    """Run `handlers[type(message)](message)`. An unknown message is logged and False returned, so the
    caller can answer it (never silently dropped)."""
    handler = handlers.get(type(message))
    if handler is None:
        log.error("unknown message from %s: %r", peer, type(message).__name__)
        return False
    handler(message)
    return True


# ------------------------------------------------------------------------------------------------
# Tensor-parallel operations (rank 0 broadcasts each one; every rank runs it in the same order)
# ------------------------------------------------------------------------------------------------


class TPOpKind(enum.StrEnum):
    GENERATE = "generate"
    WARM = "warm"
    PING = "ping"  # keeps the followers' control-group wait alive when idle
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class TPOp:
    kind: TPOpKind
    request: GenerateRequest | None = None
    bucket: BucketKey | None = None


class RankExit(enum.IntEnum):
    """Exit codes of a sidecar rank (and of the by-hand launcher)."""

    OK = 0
    USAGE = 2  # bad arguments
    LOAD_FAILED = 3  # the model failed to load on some rank (rank 0 told the client)
    GROUP_BROKEN = 4  # a rank died or the ranks disagreed; the in-flight request failed
    ORPHANED = 5  # torchrun or the app that launched the sidecar went away
    INJECTED_CRASH = 17  # tests: Fault.CRASH

    @property
    def consequence(self) -> str | None:
        """For exits caused by *another* rank's failure: what this rank did (None otherwise)."""
        return {
            RankExit.LOAD_FAILED: "could not load",
            RankExit.GROUP_BROKEN: "left the broken group",
            RankExit.ORPHANED: "saw torchrun or the app go away",
        }.get(self)
