"""The sidecar's secrets on disk: the per-launch HMAC token and rank 0's address file, both 0600.

The token never appears on a command line or in a log; the app keeps it in memory and passes the
file's path through the environment. The address file says where rank 0 listens and where the token is.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path


def new_token() -> bytes:
    return secrets.token_hex(32).encode()


def write_private(path: Path, data: bytes) -> Path:
    """Create `path` readable by this user only (0600), atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def write_address(path: Path, host: str, port: int, token_file: Path) -> Path:
    info = {"host": host, "port": port, "token_file": str(token_file), "pid": os.getpid()}
    return write_private(path, json.dumps(info).encode())


def read_address(path: Path) -> tuple[str, int, bytes]:
    """(host, port, token) from an address file rank 0 wrote."""
    info = json.loads(Path(path).read_text())
    return info["host"], int(info["port"]), Path(info["token_file"]).read_bytes()
