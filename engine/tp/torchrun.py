"""torchrun with its key-value stores bound to one address: `python -m engine.tp.torchrun --store-host=H ...`.

torchrun's rendezvous store (and the store the ranks meet in) is a TCPStore whose server listens on every
interface, whatever host it is given: anyone who can reach the machine could write into it. Here every
TCPStore *server* created in this process is handed a socket already bound to `--store-host` (TCPStore's
`master_listen_fd`): loopback for a single node; for several nodes, the rendezvous endpoint's address
the host chose. Clients are unchanged. Every other argument goes to torchrun as it is.
"""

from __future__ import annotations

import logging
import socket
import sys

from engine import settings

log = logging.getLogger(__name__)

STORE_HOST_FLAG = "--store-host="
# The ranks learn it too: a rank 0 that hosts its own store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) binds alike.
STORE_HOST_VAR = "SHOWCASE_TP_STORE_HOST"
_SERVERS: dict[int, socket.socket] = {}


def _bound_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind torchrun's store to {host}:{port} ({exc.strerror}): give "
                                 "--rdzv-endpoint an address of this machine that the other nodes reach") from None
    sock.listen(128)
    return sock


def bind_stores(host: str) -> None:
    """From now on, TCPStore servers made in this process listen on `host` only (idempotent)."""
    import torch.distributed as dist

    base = dist.TCPStore
    if getattr(base, "_showcase_store_host", None) is not None:
        base._showcase_store_host = host
        return

    class BoundTCPStore(base):
        _showcase_store_host = host

        def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
            # A multi-tenant server already running on this port is shared by the C++ side: no new socket.
            if is_master and kwargs.get("master_listen_fd") is None and int(port) not in _SERVERS:
                sock = _bound_socket(BoundTCPStore._showcase_store_host, int(port))
                port = sock.getsockname()[1]
                _SERVERS[port] = sock  # keeps the descriptor open for the process's lifetime
                kwargs["master_listen_fd"] = sock.fileno()
                kwargs["use_libuv"] = True  # the libuv server takes over a listening socket
            super().__init__(host_name, port, world_size, is_master, *args, **kwargs)

    BoundTCPStore.__name__ = BoundTCPStore.__qualname__ = "TCPStore"
    dist.TCPStore = BoundTCPStore


def bind_stores_from_env() -> None:
    host = settings.tp_store_host()
    if host:
        bind_stores(host)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].startswith(STORE_HOST_FLAG):
        print(f"usage: python -m engine.tp.torchrun {STORE_HOST_FLAG}HOST [torchrun arguments]", file=sys.stderr)
        return 2
    bind_stores(argv.pop(0)[len(STORE_HOST_FLAG):])
    from torch.distributed.run import main as torchrun_main  # imports the rendezvous modules after the patch

    sys.argv = ["torchrun", *argv]
    torchrun_main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
