"""Gradio's per-session bookkeeping, bounded like its session state.

Gradio keeps the state of at most STATE_SESSIONS sessions (ui/blocks.py), but other tables of its own grow
with every session hash a client mints: each streaming run's last outputs (`Blocks.pending_diff_streams`,
`pending_streams`: a run that ends without its final output, dropped or cancelled, leaves them for good),
the messages of sessions whose results nobody reads (`Queue.pending_messages_per_session`, 2,000 sessions)
and their event ids (`Queue.pending_event_ids_session`, unbounded). A hostile run saw the web process grow
about 8 KB a session past the cap (740 -> 798 MB over 2,817 sessions). Here each is bounded to a few times
the state's cap, the oldest sessions going first: a session that old has no state left to run with.
"""

from __future__ import annotations

from collections import OrderedDict

SESSIONS_PER_STATE = 2  # each table keeps at most this many times the sessions whose state Gradio keeps


class SessionTable(OrderedDict):
    """A session -> dict table that creates an entry on first use (as Gradio's defaultdicts do) and keeps the
    `capacity` most recently created."""

    def __init__(self, capacity: int, items=(), make=dict):
        super().__init__(items)
        self.capacity, self.make = capacity, make  # make None: a missing session is a KeyError, as in a dict
        self._trim()

    def __missing__(self, session):
        if self.make is None:
            raise KeyError(session)
        value = self[session] = self.make()
        return value

    def __setitem__(self, session, value) -> None:
        super().__setitem__(session, value)
        self._trim()

    def _trim(self) -> None:
        while len(self) > self.capacity:
            self.popitem(last=False)


def bound_sessions(demo, state_sessions: int) -> None:
    """Bound `demo`'s per-session tables (after demo.queue(): the queue's are made there)."""
    capacity = max(1, SESSIONS_PER_STATE * state_sessions)
    for name in ("pending_diff_streams", "pending_streams"):
        table = getattr(demo, name, None)
        if table is not None and not isinstance(table, SessionTable):
            setattr(demo, name, SessionTable(capacity, table.items()))
    queue = getattr(demo, "_queue", None)
    messages = getattr(queue, "pending_messages_per_session", None)
    if messages is not None and hasattr(messages, "max_size"):
        messages.max_size = min(messages.max_size, capacity)
    ids = getattr(queue, "pending_event_ids_session", None)
    if ids is not None and not isinstance(ids, SessionTable):
        queue.pending_event_ids_session = SessionTable(capacity, ids.items(), make=None)
