"""Helpers shared by the tests that launch the app (import as `from helpers import ...`)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_demo(manager, defaults=None, queue_size: int = 8, edge=None):
    """Build and launch the app in this process on a free loopback port; returns (demo, url)."""
    from ui import build_demo, launch_kwargs

    demo = build_demo(manager, defaults, queue_size=queue_size, edge=edge)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, ssr_mode=False, quiet=True,
                **launch_kwargs(demo=demo))
    return demo, f"http://127.0.0.1:{port}/"


def spy_generate(manager, monkeypatch) -> list:
    """How each manager.generate call ends (its result or its exception), in the order they end."""
    outcomes, real = [], manager.generate

    def spy(**kwargs):
        try:
            outcomes.append(real(**kwargs))
        except Exception as exc:
            outcomes.append(exc)
            raise
        return outcomes[-1]

    monkeypatch.setattr(manager, "generate", spy)
    return outcomes
