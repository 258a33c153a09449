"""Rank 0's handshake cannot be held open, and torchrun's stores listen on loopback.

- A peer that sends a length prefix and then one byte at a time, each inside the per-read timeout, is cut
  off at the handshake's deadline (the whole exchange, not each read).
- A real client gets through at once while silent and slow connections are pending at rank 0's server.
- torchrun started the way the launcher starts it (one node) has no listening socket beyond loopback.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.connection import Connection
from types import SimpleNamespace

import pytest

from engine.worker import wire

# A handshake deadline of 1 s against a byte every 0.3 s lets about 3 bytes through; a deadline per read
# (the bug) would take all 64. A busy machine drips slower, so the count only falls under load.
DRIPPED_AT_MOST = 16


def _drip(sock: socket.socket, every_s: float, stop: threading.Event, sent: list | None = None) -> None:
    """Read the challenge, then send a 64-byte response one byte at a time (counted in `sent`)."""
    try:
        sock.recv(4096)
        sock.sendall(struct.pack("!i", 64))
        while not stop.wait(every_s):
            sock.sendall(b"x")
            if sent is not None:
                sent.append(1)
    except OSError:
        pass


def _still_open(sock: socket.socket) -> bool:
    """Neither closed nor reset by the other end (nothing to read is fine)."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_a_dripping_peer_is_cut_off_at_the_whole_handshake_deadline():
    server, client = socket.socketpair()
    stop, sent = threading.Event(), []
    threading.Thread(target=_drip, args=(client, 0.3, stop, sent), daemon=True).start()
    conn = Connection(server.detach())
    try:
        with pytest.raises((OSError, EOFError)):
            wire.authenticate_incoming(conn, b"k" * 32, timeout_s=1.0)
        dripped = len(sent)
    finally:
        stop.set()
        conn.close()
        client.close()
    print(f"dripping peer cut off after {dripped} of 64 bytes (deadline 1 s, a byte every 0.3 s)")
    assert dripped <= DRIPPED_AT_MOST


def test_a_client_that_never_answers_is_cut_off_when_dialling(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop, sent = threading.Event(), []

    def serve():
        sock, _ = listener.accept()
        _drip(sock, 0.3, stop, sent)  # the server side drips its challenge the same way
        sock.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        with pytest.raises((OSError, EOFError)):
            wire.dial("127.0.0.1", port, b"k" * 32, timeout_s=1.0)
        dripped = len(sent)
    finally:
        stop.set()
        listener.close()
    assert dripped <= DRIPPED_AT_MOST


@pytest.fixture
def rank0_server(tmp_path, monkeypatch):
    from engine.tp import sidecar
    from engine.tp.launch import TOKEN_FILE_VAR
    from engine.tp.tokens import new_token, write_private

    token_file = write_private(tmp_path / "tp.token", new_token())
    monkeypatch.setenv(TOKEN_FILE_VAR, str(token_file))
    args = SimpleNamespace(listen=None, port=0, parent_pid=None, address_file=tmp_path / "tp.json")
    config = SimpleNamespace(key=SimpleNamespace(as_dict=lambda: {"preset": "tiny-flux"}, precision="fp32"))
    server = sidecar._Rank0Server(args, config)
    yield server, token_file.read_bytes()
    server.close()


def test_silent_and_slow_connections_do_not_lock_the_real_client_out(rank0_server):
    server, token = rank0_server
    stop = threading.Event()
    stallers = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]  # connect, say nothing
    dripper = socket.create_connection(("127.0.0.1", server.port))
    threading.Thread(target=_drip, args=(dripper, 0.5, stop), daemon=True).start()
    time.sleep(0.3)  # all four are accepted and pending before the real client dials
    try:
        conn = wire.dial("127.0.0.1", server.port, token, timeout_s=5.0)
        served = server.wait_client(timeout=5.0)
        assert served is not None
        # Served ahead of them, not after their handshakes timed out: the server has cut none of them off yet.
        pending = [_still_open(sock) for sock in stallers]
        print(f"real client authenticated with {sum(pending)} of 3 silent connections still pending")
        assert all(pending), "the real client was served only after the silent connections were cut off"
        conn.close()
        served.close()
    finally:
        stop.set()
        for sock in [*stallers, dripper]:
            sock.close()


def test_torchrun_stores_listen_on_loopback_only(tmp_path):
    """The launcher's torchrun command for one node, running a script that reports every listening socket
    of torchrun and of its rank."""
    from engine.tp import launch

    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        import os
        import torch.distributed as dist

        def listening(pid):
            inodes = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
            found = []
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                for line in open(table).read().splitlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and fields[9] in inodes:
                        found.append(fields[1].rsplit(":", 1)[0])
            return found

        dist.init_process_group("gloo")
        print("LISTEN", os.environ["MASTER_ADDR"], *listening(os.getppid()), *listening(os.getpid()), flush=True)
        dist.destroy_process_group()
    """))
    argv = launch.torchrun_argv(1, python=sys.executable)
    at = argv.index(launch.SIDECAR_MODULE)
    argv = argv[:at - 1] + [str(probe)]
    env = {**os.environ, "PYTHONPATH": str(launch.Path(__file__).resolve().parent.parent)}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)
    line = next((x for x in out.stdout.splitlines() if x.startswith("LISTEN")), None)
    assert line, out.stdout[-2000:] + out.stderr[-3000:]
    _, master, *addresses = line.split()
    print(f"torchrun (one node): MASTER_ADDR {master}, listening on {addresses}")
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    assert addresses and all(a in loopback for a in addresses), addresses


def test_several_nodes_bind_the_store_to_the_endpoint_address():
    from engine.tp import launch

    argv = launch.torchrun_argv(2, nnodes=2, node_rank=0, rdzv_endpoint="10.0.0.1:29500", python="/py")
    assert argv[1:4] == ["-m", launch.TORCHRUN_MODULE, "--store-host=10.0.0.1"]
    single = launch.torchrun_argv(2, python="/py")
    assert "--store-host=127.0.0.1" in single and "--local-addr=127.0.0.1" in single
