"""Processes, read one way everywhere: whether one is alive (the aot build cache, the tensor-parallel
sidecar and its ranks, the load bench), its descendants and its resident memory (the soak and load
benches). Part of the contract: torch-free, imports only the standard library.
"""

from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while process `pid` runs: it exists (or exists under another user) and is not a zombie, which
    has exited and only waits for its parent to read its status."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc here: kill's answer stands
        return True


def process_tree(root: int) -> list[int]:
    """`root` and its descendants, from each task's /proc children list (psutil's recursive children
    walks all of /proc, too costly to sample every few seconds on a loaded box). [] once `root` is gone."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        found.append(pid)
        for tid in tasks:
            try:
                todo += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
            except (OSError, ValueError):
                pass
    return found


def resident_bytes(pid: int) -> int | None:
    """Resident memory of a process (None once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
