"""Whether a process is alive, answered one way everywhere (the aot build cache, the tensor-parallel
sidecar and its ranks, the load bench). Part of the contract: torch-free, imports only the standard library.
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
