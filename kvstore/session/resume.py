"""What a Restore or a Resume does with a session's window: the store's policy, decided
once per call from the session as read, before any byte is sent.

    async with manager.reading(tenant, session_id) as reader:
        plan = await plan_window(reader, resume=True, replay_tokens=0, can_replay=True,
                                 default_replay_tokens=128)
        plan.window          # the held window to send (read and verified), or None
        plan.replay          # rebuild the window by replay, with plan.replay_tokens (R)
        plan.keep_window     # store the rebuilt window as the session's afterwards

A Restore returns the held window as it is. A Resume returns it when the engine spilled
it or a replay of at least ``min(R, num_tokens)`` tokens built it; otherwise, where the
server can replay (``can_replay``), it replays R tokens and keeps the window it rebuilds
unless that one is partial (``manifest.full_window``: the store also keeps none that
covers less than the one it holds, ``Spiller.store_window``).

R is the Resume's ``replay_tokens``, else the layout's stated ``replay_tokens`` (the R at
which its replayer's window meets the fidelity goal: docs/wire-format.md section 1), else
the server's default. A larger R costs a longer replay; a smaller one is honoured, and
rebuilds a window below the fidelity the layout states.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.session.manifest import full_window
from kvstore.session.restore import SessionReader
from kvstore.tiers.base import Buffer


@dataclass(frozen=True)
class ResumePlan:
    window: Buffer | None  # the held window to send, read and verified; None: none sent
    window_tier: str | None  # where the held window is: read from, or named by the manifest
    window_held: bool  # a window is held that this call reports (SessionHeader.window_available)
    replay_needed: bool  # the layout has window streams and none is held
    replay: bool  # this call rebuilds the window by replay
    replay_tokens: int  # R of that replay (0 without one)
    keep_window: bool  # the rebuilt window is offered to the store as the session's


async def plan_window(reader: SessionReader, *, resume: bool, want_window: bool = True,
                      replay_tokens: int = 0, can_replay: bool = False,
                      default_replay_tokens: int) -> ResumePlan:
    """The plan for a Restore (``resume`` False: the held window only if ``want_window``)
    or a Resume (asking for ``replay_tokens``, 0: the default) of the session ``reader``
    holds; ``can_replay``: whether this server can rebuild its layout's window."""
    m, spec = reader.manifest, reader.spec
    r = 0
    if resume:
        r = replay_tokens or spec.replay_tokens or default_replay_tokens
    # A held window made by a shorter replay than this Resume asks for is rebuilt with
    # the larger R where this server can replay.
    outdated = (resume and can_replay and m.window_key is not None
                and m.window_coverage < min(r, m.num_tokens))
    window, tier = None, None
    if (want_window or resume) and not outdated:
        window, tier = await reader.window()  # (None, None) where it is gone
    if not (want_window or resume):  # not read: held where the manifest names a tier
        held, tier = m.window_tier is not None, m.window_tier
    else:
        held = window is not None
    needed = bool(spec.ephemeral_streams) and not held
    replay = resume and needed
    return ResumePlan(
        window=window, window_tier=tier if held else None, window_held=held,
        replay_needed=needed, replay=replay, replay_tokens=r if replay else 0,
        keep_window=replay and full_window(r, m.num_tokens, spec.window_tokens))
