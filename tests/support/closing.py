"""What a test opened and must close however it ends: the ``opened`` and ``managers``
fixtures, closed in the test's own event loop by the conftest's ``pytest_pyfunc_call``."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar


class Closable(Protocol):
    async def close(self) -> Any: ...


T = TypeVar("T", bound=Closable)


class Opened:
    """The ``opened`` fixture: ``adopt(thing)`` anything with an ``async close()`` (a tier,
    a store from ``open_manager``); what is still adopted when the test ends is closed."""

    def __init__(self) -> None:
        self._open: list[Closable] = []

    def adopt(self, thing: T) -> T:
        """Close ``thing`` when the test ends, unless closed (``close``) or abandoned first."""
        self._open.append(thing)
        return thing

    async def close(self, thing: Closable) -> None:
        """Close ``thing`` now: the test goes on without it (reopens, or checks the close)."""
        self._open.remove(thing)
        await thing.close()

    def abandon(self, thing: Closable) -> None:
        """Never close ``thing``: it stands for a process that died with it open."""
        self._open.remove(thing)

    async def close_all(self) -> None:
        """Close what is still open, the last opened first; raise the first close's error
        once every close was tried."""
        errors: list[Exception] = []
        while self._open:
            try:
                await self._open.pop().close()
            except Exception as exc:  # the others still close
                errors.append(exc)
        if errors:
            raise errors[0]
