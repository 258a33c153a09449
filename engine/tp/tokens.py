"""The sidecar's secrets on disk: the HMAC token and rank 0's address file.

The token never appears on a command line or in a log: the app keeps it in memory and passes the file's
path through the environment; a sidecar started by hand writes a fresh one per launch next to its address
file, or uses a long-lived one the host made (`python -m engine.tp.tokens FILE`, for `--listen`, where
the app runs on another machine and the file is copied there once).

The address file (0600, no secret in it) says where rank 0 listens, where its token is, what it serves
and how it was started, so an app attaching with `--tp-address` can say "not running: start it with ...".

    python -m engine.tp.tokens FILE     # write a new token file (0600), for `sidecar --token-file FILE`
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import sys
from pathlib import Path

from engine.errors import InvalidRequest

MIN_TOKEN_CHARS = 32  # a token of fewer characters is refused (ours are 64 hex characters: 256 bits)


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


def read_token(path: Path, *, private: bool = True) -> bytes:
    """A token file's bytes (surrounding whitespace removed), refused if short or, with `private`, readable
    by others: a token anyone on the machine can read protects nothing."""
    path = Path(path)
    try:
        data = path.read_bytes().strip()
        mode = path.stat().st_mode
    except OSError as exc:
        raise InvalidRequest(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    if len(data) < MIN_TOKEN_CHARS:
        raise InvalidRequest(f"the token file {path} holds {len(data)} characters; a token needs at least "
                             f"{MIN_TOKEN_CHARS} (make one with: python -m engine.tp.tokens {path})")
    if private and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InvalidRequest(f"the token file {path} is readable by other users (mode {mode & 0o777:o}); "
                             f"make it private: chmod 600 {path}")
    return data


def write_address(path: Path, host: str, port: int, token_file: Path, **extra) -> Path:
    """Rank 0's address; keeps what the launcher already wrote there (how to start it, what it serves)."""
    info = read_address_info(path) if Path(path).exists() else {}
    info.update(extra)
    info.update({"host": host, "port": port, "token_file": str(token_file), "pid": os.getpid(), "state": "listening"})
    return write_private(Path(path), json.dumps(info).encode())


def update_address(path: Path, **fields) -> Path:
    """Merge `fields` into an address file (the launcher: "starting", then "stopped" with the reason)."""
    info = read_address_info(path) if Path(path).exists() else {}
    info.update(fields)
    return write_private(Path(path), json.dumps(info).encode())


def read_address_info(path: Path) -> dict:
    """The address file as a dict; {} when it is unreadable or half written."""
    try:
        info = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def token_path_for(address_file: Path, info: dict) -> Path | None:
    """The token file an address file names; when that path does not exist here (the files were copied from
    node 0 to the app's machine), a file of the same name next to the address file."""
    named = info.get("token_file")
    if not named:
        return None
    path = Path(named)
    if not path.is_absolute():
        path = Path(address_file).parent / path
    if not path.exists():
        sibling = Path(address_file).parent / path.name
        if sibling.exists():
            return sibling
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m engine.tp.tokens FILE   (writes a new 0600 token file; never overwrites one)",
              file=sys.stderr)
        return 2
    path = Path(args[0])
    if path.exists():
        print(f"error: {path} exists; remove it first to make a new token", file=sys.stderr)
        return 2
    write_private(path, new_token())
    print(f"wrote a new token to {path} (0600); copy it only over a secure channel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
