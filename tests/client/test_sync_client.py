"""The blocking ``Client`` runs its calls on its own loop thread: closing it must end every
call another thread still waits on (an engine's lookup threads are not daemons, so a wait
left for ever keeps the engine's process from exiting), and a call after close fails."""

from __future__ import annotations

import socket
import threading

import pytest

from kvstore.format.errors import TierUnavailable
from kvtier import Client


def test_close_ends_a_call_another_thread_waits_on_and_later_calls_fail():
    silent = socket.socket()  # accepts connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    client = Client(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=None,
                    shared_memory=False)
    outcome: list[BaseException | str] = []
    started = threading.Event()

    def ask() -> None:
        started.set()
        try:
            client.layouts()
            outcome.append("answered")
        except BaseException as exc:  # noqa: BLE001 - what the waiter got is the finding
            outcome.append(exc)

    waiter = threading.Thread(target=ask)
    waiter.start()
    started.wait()
    try:
        client.close()
        waiter.join(timeout=30)
        assert not waiter.is_alive(), "the call still waits after close"
        assert isinstance(outcome[0], TierUnavailable), outcome
        assert "closed" in str(outcome[0])
        with pytest.raises(TierUnavailable, match="closed"):
            client.layouts()
        client.close()  # a second close is a no-op
    finally:
        silent.close()
