"""The client operations of a simulation, each judged against the reference model.

Every operation goes through the public client (``kvtier.AsyncClient``) of the tenant
it acts for; its reply either agrees with the model (which then moves on) or is a
documented error for the state, or it is recorded as a finding. ``Ops`` is a mixin of
``engine.Simulation``, which holds the model, the clients and the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import torch

from bench.seams.layouts import BUNDLED, hostile_layouts
from bench.seams.model import (
    Held,
    Version,
    digest,
    expected_coverage,
    extended,
    random_streams,
    random_window,
    same_streams,
    truncated,
)
from bench.seams.verdict import error_kind, named, now
from kvstore.format.errors import (
    InvalidRequest,
    KVTierError,
    ModelMismatch,
    NotFound,
    PermissionDenied,
    PreconditionFailed,
    QuotaExceeded,
    ReplayUnavailable,
    StaleGeneration,
    TierFull,
)
from kvstore.format.layout import layout_from_json, layout_to_json
from kvstore.format.registry import get_layout
from kvtier import request_id

SIZES = (1, 3, 64, 130, 511, 512, 517, 640, 1024, 1100, 1536)
REPLAYS = ("0", "1", "small", "127", "128", "over-window", "over-tokens")
# Fingerprints some spills state (no replayer has these weights: a Resume that must
# replay answers ModelMismatch), and one no session states.
MODELS = ("seams-model-a", "seams-model-b")
OTHER_MODEL = "seams-model-other"


class Ops:
    # -- helpers --

    def tokens(self, spec, count: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.rng.getrandbits(62))
        return torch.randint(0, spec.vocab_size, (count,), generator=gen)

    def spec(self, name: str):
        return self.layout_specs[name]

    def documented(self, exc: BaseException, *, admission: bool = False) -> bool:
        """Errors the state documents for any call: a quota or a full medium at
        admission."""
        if admission and isinstance(exc, QuotaExceeded):
            return self.combo.quota
        if admission and isinstance(exc, TierFull):
            return self.full
        return False

    def fail(self, exc: BaseException, step: int, op: str, session: str, expected: str
             ) -> None:
        self.ledger.add(error_kind(exc), self.combo.name, step, op, session, expected,
                        named(exc))

    def wrong(self, step: int, op: str, session: str, expected: str, got: str) -> None:
        self.ledger.add("wrong", self.combo.name, step, op, session, expected, got)

    # -- spills --

    async def spill_new(self, step: int, tenant: str, sid: str) -> None:
        layout = self.rng.choice(self.layouts)
        spec = self.spec(layout)
        n = self.rng.choice(SIZES)
        tokens = self.tokens(spec, n)
        model = self.rng.choice(MODELS) if self.rng.random() < 0.15 else ""
        await self._spill(step, "spill-new", tenant, sid, spec, tokens,
                          random_streams(spec, n, self.rng), None,
                          self.rng.choice((1, 1, 2, 5)), model=model)

    async def spill_next(self, step: int, held: Held, rewrite: bool) -> None:
        base = held.candidates()[-1]
        spec = self.spec(base.layout)
        old = len(base.tokens)
        n = old + self.rng.choice((1, 7, 128, 512, 600))
        tokens = torch.cat([base.tokens, self.tokens(spec, n - old)])
        persistent = (random_streams(spec, n, self.rng) if rewrite
                      else extended(spec, base.persistent, old, n, self.rng))
        gen = max(v.generation for v in held.versions) + self.rng.choice((1, 1, 3))
        await self._spill(step, "spill-rewrite" if rewrite else "spill-extend", held.tenant,
                          held.sid, spec, tokens, persistent, held, gen, model=held.model)

    async def _spill(self, step: int, op: str, tenant: str, sid: str, spec, tokens,
                     persistent, held: Held | None, gen: int, *, window: bool | None = None,
                     ttl: bool | None = None, model: str = "") -> Version | None:
        n = len(tokens)
        with_window = self.rng.random() < 0.4 if window is None else window
        win = random_window(spec, n, self.rng) if with_window else None
        ack = self.rng.choice(("memory", "durable"))
        ttl_s = self.session_ttl if (self.rng.random() < 0.25 if ttl is None else ttl) else 0.0
        name = f"{tenant}/{sid}"
        self.log(f"step={step} op={op} s={name} gen={gen} n={n} ack={ack} "
                 f"win={int(win is not None)} ttl={ttl_s} layout={spec.name} model={model}")
        try:
            reply = await self.client(tenant).spill(
                tenant, sid, spec, tokens.numpy().astype("uint32"), persistent, window=win,
                generation=gen, ack=ack, ttl_s=ttl_s, model_fingerprint=model)
        except KVTierError as exc:
            if not self.documented(exc, admission=True):
                self.fail(exc, step, op, name, f"gen {gen} stored")
                if error_kind(exc) == "unexpected":  # it may have landed: either is right
                    self._maybe(tenant, sid, held, Version(gen, spec.name, tokens, persistent,
                                                           win, False, f"{op}@{step}?"), ttl_s,
                                model)
            return None
        except Exception as exc:  # noqa: BLE001 - a client crash is a finding, not an abort
            self.fail(exc, step, op, name, f"gen {gen} stored")
            return None
        if reply.generation != gen:
            self.wrong(step, op, name, f"generation {gen}", f"generation {reply.generation}")
        if reply.window_kept and win is None:
            self.wrong(step, op, name, "window_kept False (no window spilled)",
                       "window_kept True")
        version = Version(gen, spec.name, tokens, persistent,
                          win if reply.window_kept else None, reply.durable,
                          f"{op}@{step}")
        if ack == "durable" and not reply.durable:
            self.ledger.add("unexpected", self.combo.name, step, op, name,
                            "a durable ack says durable", "durable=False")
        if held is None:
            held = self.model[(tenant, sid)] = Held(tenant, sid, [version], ttl_s=ttl_s,
                                                    model=model)
        else:
            held.push(version)
            held.ttl_s = ttl_s
        held.touched = now()
        self.deleted.discard((tenant, sid))
        return version

    def _maybe(self, tenant, sid, held, version, ttl_s, model) -> None:
        if held is None:
            held = self.model[(tenant, sid)] = Held(tenant, sid, [], ttl_s=ttl_s, model=model)
        held.versions.append(version)
        held.uncertain = True

    async def lookup_spill(self, step: int, source: Held, sid: str) -> None:
        """The same tokens as ``source`` under another session of its tenant, with other
        tensors, after a lookup found ``source``'s chunks."""
        base = source.current
        spec = self.spec(base.layout)
        try:
            held = await self.client(source.tenant).lookup(source.tenant, spec,
                                                           base.tokens.numpy().astype("uint32"))
            self.log(f"step={step} op=lookup s={source.tenant}/{source.sid} held={held}")
        except KVTierError as exc:
            self.fail(exc, step, "lookup", f"{source.tenant}/{source.sid}", "tokens held")
            return
        n = len(base.tokens)
        whole = n // spec.chunk_tokens * spec.chunk_tokens
        # its own chunks (of no stated model, as this lookup states none) are all held
        settled = not source.uncertain and not source.model \
            and not source.may_be_absent(now())
        if held > whole or (settled and held != whole):
            self.wrong(step, "lookup", f"{source.tenant}/{source.sid}",
                       f"{whole if settled else f'<= {whole}'} tokens held", f"{held}")
        version = await self._spill(step, "lookup-spill", source.tenant, sid, spec, base.tokens,
                                    random_streams(spec, n, self.rng), None, 1, window=False)
        if version is not None:
            await self.restore(step, self.model[(source.tenant, sid)], op="lookup-restore")

    async def stale_spill(self, step: int, held: Held) -> None:
        base = held.current
        spec = self.spec(base.layout)
        persistent = random_streams(spec, len(base.tokens), self.rng)
        name = f"{held.tenant}/{held.sid}"
        self.log(f"step={step} op=stale-spill s={name} gen={base.generation}")
        try:
            await self.client(held.tenant).spill(
                held.tenant, held.sid, spec, base.tokens.numpy().astype("uint32"), persistent,
                generation=base.generation, ack="durable")
        except StaleGeneration:
            return
        except KVTierError as exc:
            if held.may_be_absent(now()) and not isinstance(exc, StaleGeneration):
                return
            if not self.documented(exc, admission=True):
                self.fail(exc, step, "stale-spill", name, "StaleGeneration")
            return
        if held.may_be_absent(now()):  # expired and collected: the spill made it anew
            held.settle(Version(base.generation, spec.name, base.tokens, persistent, None,
                                True, f"stale-spill@{step}"))
            return
        if same_streams(persistent, base.persistent) and base.window is None:
            return  # fewer tokens than an entry: nothing differs, a retry answered as such
        self.ledger.add("unexpected", self.combo.name, step, "stale-spill", name,
                        "StaleGeneration (other tensors, same generation)", "accepted")
        held.versions = [base, Version(base.generation, spec.name, base.tokens, persistent,
                                       None, True, f"stale-spill@{step}")]
        base.durable = True
        held.uncertain = True

    # -- restore, resume --

    async def restore(self, step: int, held: Held, *, op: str = "restore",
                      replay: str | None = None, model: str = "") -> None:
        """Restore (``replay`` None) or Resume of ``held``, judged; ``model``: the
        fingerprint stated (the session's own, so it must be served)."""
        name = f"{held.tenant}/{held.sid}"
        kv = self.client(held.tenant)
        r = 0
        if replay is not None:
            n = len(held.current.tokens)
            r = {"0": 0, "1": 1, "small": self.rng.randint(2, 16), "127": 127, "128": 128,
                 "over-window": self.spec(held.current.layout).window_tokens + 50,
                 "over-tokens": n + 20}[replay]
        self.log(f"step={step} op={op} s={name} R={r if replay is not None else '-'}")
        try:
            if replay is None:
                got = await kv.restore(held.tenant, held.sid,
                                       want_window=self.rng.random() < 0.7,
                                       model_fingerprint=model)
            else:
                got = await kv.resume(held.tenant, held.sid, replay_tokens=r,
                                      model_fingerprint=model)
        except NotFound as exc:
            if held.may_be_absent(now()):
                self.forget(held)
                return
            self.ledger.add("lost", self.combo.name, step, op, name,
                            held.current.describe(), named(exc))
            self.forget(held)
            return
        except ReplayUnavailable:
            if replay is not None:
                return
            raise
        except ModelMismatch as exc:
            # documented for a replay: no replayer has the weights the session states
            if not (replay is not None and held.model):
                self.fail(exc, step, op, name, held.current.describe())
            return
        except InvalidRequest as exc:
            if replay is not None and self.replay_refusal(held, r):
                return
            self.fail(exc, step, op, name, held.current.describe())
            return
        except KVTierError as exc:
            self.fail(exc, step, op, name, held.current.describe())
            return
        except Exception as exc:  # noqa: BLE001
            self.fail(exc, step, op, name, held.current.describe())
            return
        if got.model_fingerprint != held.model:
            self.wrong(step, op, name, f"model fingerprint {held.model!r}",
                       f"{got.model_fingerprint!r}")
        self.judge(step, op, held, got, replay=None if replay is None else r)

    async def resume_twice(self, step: int, held: Held, first: str, then: str) -> None:
        await self.restore(step, held, op="resume", replay=first)
        if (held.tenant, held.sid) in self.model:
            await self.restore(step, held, op="resume-again", replay=then)

    def replay_refusal(self, held: Held, r: int) -> bool:
        """Whether InvalidRequest is documented for a Resume with R = ``r``: a session
        of no tokens (no window to rebuild), or R shorter than its unfinished entry."""
        n = len(held.current.tokens)
        m = max(s.tokens_per_entry for s in self.spec(held.current.layout).persistent_streams)
        return n == 0 or 0 < r < n % m

    def judge(self, step: int, op: str, held: Held, got, *, replay: int | None) -> None:
        name = f"{held.tenant}/{held.sid}"
        tokens = torch.as_tensor(got.token_ids.astype("int64"))
        match = None
        for version in held.candidates():
            if version.generation == got.generation and torch.equal(tokens, version.tokens) \
                    and same_streams(got.persistent, version.persistent):
                match = version
        if match is None:
            want = " or ".join(v.describe() for v in held.candidates())
            if len(held.trail) > 1:  # what changed it since a restore last agreed
                want += f" after {', '.join(held.trail)}"
            self.wrong(step, op, name, want, f"gen {got.generation} n {len(tokens)} digest "
                                             f"{digest(got.persistent)}")
            # one finding per cause: what the server holds now is what later calls are
            # judged against
            held.settle(Version(got.generation, held.current.layout, tokens, got.persistent,
                                None, held.current.durable, f"as {op} got it@{step}"))
            held.window_replayed = True
            return
        held.settle(match)
        spec = got.layout
        if got.window is not None and not held.window_replayed and not got.replayed \
                and (match.window is None or not same_streams(got.window, match.window)):
            self.wrong(step, op, name, f"window {digest(match.window)}",
                       f"window {digest(got.window)} from {got.window_start}")
        if got.window is not None and not got.replayed \
                and (got.window_replayed_tokens > 0) != held.window_replayed:
            self.wrong(step, op, name, "window_replayed_tokens "
                       + ("> 0 (a replay's window)" if held.window_replayed
                          else "0 (the window as spilled)"),
                       f"{got.window_replayed_tokens}")
        if got.replayed:
            held.window_replayed = True
        if replay is not None and spec.ephemeral_streams:
            need = expected_coverage(spec, len(tokens), replay, self.default_replay)
            covered = len(tokens) - got.window_start if got.window is not None else 0
            if covered < need and "short-window" not in held.flagged:
                held.flagged.add("short-window")  # one finding per session
                self.wrong(step, op, name, f"window over >= {need} tokens (R={replay})",
                           f"window over {covered} tokens, replayed={got.replayed}")

    def forget(self, held: Held, *, deleted: bool = False) -> None:
        """The model no longer holds ``held``; unless ``deleted``, the server may still
        list and count it (an expired session until a compaction collects it)."""
        self.model.pop((held.tenant, held.sid), None)
        if not deleted:
            self.vanished.add((held.tenant, held.sid))

    async def restore_deleted(self, step: int, tenant: str, sid: str) -> None:
        name = f"{tenant}/{sid}"
        self.log(f"step={step} op=restore-deleted s={name}")
        try:
            with request_id(f"seams-{step}"):
                got = await self.client(tenant).restore(tenant, sid)
        except NotFound as exc:
            if exc.request_id != f"seams-{step}":  # the trailers name the call's id
                self.ledger.add("unexpected", self.combo.name, step, "restore-deleted",
                                name, f"request id seams-{step} in the trailers",
                                str(exc.request_id))
            return
        except KVTierError as exc:
            self.fail(exc, step, "restore-deleted", name, "SessionNotFound")
            return
        self.wrong(step, "restore-deleted", name, "SessionNotFound (deleted)",
                   f"gen {got.generation} n {len(got.token_ids)}")

    async def identity(self, step: int, held: Held) -> None:
        """Restore and Resume stating another model's fingerprint: ModelMismatch, the
        session untouched; then a Restore stating its own (when it states one)."""
        name = f"{held.tenant}/{held.sid}"
        kv = self.client(held.tenant)
        self.log(f"step={step} op=identity s={name} model={held.model or '-'}")
        for call in (lambda: kv.restore(held.tenant, held.sid, model_fingerprint=OTHER_MODEL),
                     lambda: kv.resume(held.tenant, held.sid, model_fingerprint=OTHER_MODEL)):
            try:
                got = await call()
            except ModelMismatch:
                continue
            except NotFound as exc:
                if not held.may_be_absent(now()):
                    self.ledger.add("lost", self.combo.name, step, "identity", name,
                                    held.current.describe(), named(exc))
                self.forget(held)
                return
            except KVTierError as exc:
                self.fail(exc, step, "identity", name, f"ModelMismatch ({OTHER_MODEL} "
                          f"stated, the session's is {held.model!r})")
                continue
            self.wrong(step, "identity", name, f"ModelMismatch ({OTHER_MODEL} stated, the "
                       f"session's is {held.model!r})",
                       f"served gen {got.generation} of model {got.model_fingerprint!r}")
        if held.model:
            await self.restore(step, held, op="identity-restore", model=held.model)

    async def stat_session(self, step: int, held: Held) -> None:
        """Stat of one session: its generation, tokens, chunks and fingerprint as the
        model holds them."""
        name = f"{held.tenant}/{held.sid}"
        self.log(f"step={step} op=stat-session s={name}")
        try:
            info = (await self.client(held.tenant).stat(held.tenant, held.sid)).session
        except NotFound as exc:
            if not held.may_be_absent(now()):
                self.ledger.add("lost", self.combo.name, step, "stat-session", name,
                                held.current.describe(), named(exc))
            self.forget(held)
            return
        except KVTierError as exc:
            self.fail(exc, step, "stat-session", name, held.current.describe())
            return
        spec = self.spec(held.current.layout)
        fits = [v for v in held.candidates() if v.generation == info.generation
                and len(v.tokens) == info.num_tokens]
        if not fits or info.chunks != info.num_tokens // spec.chunk_tokens \
                or info.model_fingerprint != held.model:
            want = " or ".join(f"gen {v.generation} n {len(v.tokens)}"
                               for v in held.candidates())
            self.wrong(step, "stat-session", name, f"{want}, whole chunks, model "
                       f"{held.model!r}", f"gen {info.generation} n {info.num_tokens} chunks "
                       f"{info.chunks} model {info.model_fingerprint!r}")

    async def prefetch(self, step: int, held: Held) -> None:
        """Prefetch (to the host tier), then a restore judged as any."""
        name = f"{held.tenant}/{held.sid}"
        self.log(f"step={step} op=prefetch s={name}")
        try:
            await self.client(held.tenant).prefetch(held.tenant, held.sid, timeout_s=5.0)
        except NotFound as exc:
            if not held.may_be_absent(now()):
                self.ledger.add("lost", self.combo.name, step, "prefetch", name,
                                held.current.describe(), named(exc))
            self.forget(held)
            return
        except KVTierError as exc:
            self.fail(exc, step, "prefetch", name, "prefetched")
            return
        await self.restore(step, held, op="prefetch-restore")

    async def list_layouts(self, step: int) -> None:
        """ListLayouts names every layout the model registered."""
        self.log(f"step={step} op=list-layouts")
        try:
            listed = await self.admin_client().layouts()
        except KVTierError as exc:
            self.fail(exc, step, "list-layouts", "-", "the layouts")
            return
        names = {info.spec.name for info in listed}
        missing = [n for n in self.layouts if n not in names]
        if missing:
            self.wrong(step, "list-layouts", "-", f"{sorted(self.layouts)} listed",
                       f"{missing} missing")

    # -- forks, deletes, evictions --

    async def fork(self, step: int, held: Held, new: str, upto: int | None = None) -> bool:
        base = held.current
        n = len(base.tokens)
        spec = self.spec(base.layout)
        if upto is None:
            upto = self.rng.choice((0, 100, spec.chunk_tokens, 2 * spec.chunk_tokens, n, n + 5))
        name = f"{held.tenant}/{held.sid}->{new}"
        self.log(f"step={step} op=fork s={name} upto={upto}")
        try:
            reply = await self.client(held.tenant).fork(held.tenant, held.sid, new,
                                                        upto_tokens=upto)
        except KVTierError as exc:
            cut = min(upto, n) // spec.chunk_tokens * spec.chunk_tokens
            if isinstance(exc, InvalidRequest) and cut == 0 and upto < n:
                return False
            if isinstance(exc, PreconditionFailed) and upto > n:  # documented: past its end
                return False
            if isinstance(exc, NotFound) and held.may_be_absent(now()):
                return False
            if not self.documented(exc, admission=True):
                self.fail(exc, step, "fork", name, f"fork of {min(upto, n)} tokens")
            return False
        k = reply.num_tokens
        whole = k == n
        if not whole and (k % spec.chunk_tokens or k > upto):
            self.wrong(step, "fork", name, f"fork upto {upto} of {n}", f"{k} tokens")
        if reply.generation != 1 or reply.chunks != k // spec.chunk_tokens:
            self.wrong(step, "fork", name, f"generation 1, {k // spec.chunk_tokens} chunks",
                       f"generation {reply.generation}, {reply.chunks} chunks")
        persistent = base.persistent if whole else truncated(spec, base.persistent, k)
        window = base.window if whole and reply.window_kept else None
        copy = Version(1, base.layout, base.tokens[:k].clone(), persistent, window,
                       base.durable, f"fork@{step}")
        # a fork keeps its source's TTL, counted from the fork
        self.model[(held.tenant, new)] = Held(held.tenant, new, [copy],
                                              window_replayed=held.window_replayed and whole,
                                              ttl_s=held.ttl_s, model=held.model,
                                              trail=[*held.trail, copy.origin])
        self.deleted.discard((held.tenant, new))
        return True

    async def fork_burst(self, step: int, held: Held, news: list[str]) -> None:
        """Parallel forks of one source, then the quota counted."""
        n = len(held.current.tokens)
        await asyncio.gather(*(self.fork(step, held, new, n) for new in news))
        await self.check_quota(step, held.tenant, "fork-burst")

    async def delete(self, step: int, held: Held) -> None:
        name = f"{held.tenant}/{held.sid}"
        self.log(f"step={step} op=delete s={name}")
        try:
            await self.client(held.tenant).delete(held.tenant, held.sid)
        except NotFound:
            if not held.may_be_absent(now()):
                self.ledger.add("lost", self.combo.name, step, "delete", name,
                                held.current.describe(), "SessionNotFound")
        except KVTierError as exc:
            self.fail(exc, step, "delete", name, "deleted")
            return  # still there, as far as anyone knows
        self.forget(held, deleted=True)
        self.vanished.discard((held.tenant, held.sid))
        self.deleted.add((held.tenant, held.sid))

    async def evict(self, step: int, held: Held) -> None:
        name = f"{held.tenant}/{held.sid}"
        target = self.rng.choice(("", "disk", "object"))
        self.log(f"step={step} op=evict s={name} to={target or '-'}")
        try:
            await self.client(held.tenant).evict(held.tenant, held.sid, target)
        except NotFound:
            if not held.may_be_absent(now()):
                self.ledger.add("lost", self.combo.name, step, "evict", name,
                                held.current.describe(), "SessionNotFound")
            self.forget(held)
        except KVTierError as exc:
            if not (isinstance(exc, TierFull) and self.full):
                self.fail(exc, step, "evict", name, f"evicted to {target or 'next'}")

    # -- lookups, layouts, counts --

    async def lookup_foreign(self, step: int, tenant: str, other: Held) -> None:
        """A tenant asking for another tenant's tokens must find none of them."""
        spec = self.spec(other.current.layout)
        self.log(f"step={step} op=lookup-foreign s={tenant} of={other.tenant}/{other.sid}")
        try:
            held = await self.client(tenant).lookup(
                tenant, spec, other.current.tokens.numpy().astype("uint32"))
        except KVTierError as exc:
            self.fail(exc, step, "lookup-foreign", f"{tenant}:{other.tenant}/{other.sid}", "0")
            return
        if held:
            self.wrong(step, "lookup-foreign", f"{tenant}:{other.tenant}/{other.sid}",
                       "0 tokens held (another tenant's)", f"{held} tokens held")

    async def register(self, step: int, hostile: bool) -> None:
        kv = self.admin_client()
        if not hostile:
            name = f"seams-copy-{len(self.layouts)}"
            text = json.dumps({**json.loads(layout_to_json(get_layout(BUNDLED))), "name": name})
            what = "valid"
        else:
            what, text = self.rng.choice(hostile_layouts())
        self.log(f"step={step} op=register-layout what={what}")
        try:
            layout_id = await kv.register_layout(text)
        except (InvalidRequest, PermissionDenied) as exc:
            self.log(f"step={step} register-layout what={what} refused: {named(exc)[:120]}")
            if not hostile and not isinstance(exc, PermissionDenied):
                self.fail(exc, step, "register-layout", what, "registered")
            return
        except KVTierError as exc:
            self.fail(exc, step, "register-layout", what, "registered or InvalidRequest")
            return
        self.log(f"step={step} register-layout what={what} accepted as {layout_id}")
        spec = layout_from_json(text)
        self.layout_specs[spec.name] = spec
        for client in self.clients.values():
            await client.layout(layout_id)
        if not hostile:
            self.layouts.append(spec.name)
            return
        await self.try_layout(step, what, spec)

    async def try_layout(self, step: int, what: str, spec) -> None:
        """A hostile layout the server took: a small spill and a resume on it must end in
        a documented error or work, never INTERNAL."""
        persistent_bytes = spec.persistent_bytes_per_token * 8
        if persistent_bytes > 1 << 20:
            self.ledger.add("unexpected", self.combo.name, step, "register-layout", what,
                            "refused at registration", f"accepted ({persistent_bytes:.0f} B "
                            "for 8 tokens)")
            return
        tenant = self.tenants[0]
        sid = self.new_sid()
        # ids across the whole vocabulary the layout declares, as its client may send
        tokens = torch.randint(0, spec.vocab_size, (8,),
                               generator=torch.Generator().manual_seed(step))
        kv = self.client(tenant)
        try:
            await kv.spill(tenant, sid, spec, tokens.numpy().astype("uint32"),
                           random_streams(spec, 8, random.Random(step)), generation=1,
                           ack="durable")
            await kv.resume(tenant, sid, replay_tokens=4)
        except KVTierError as exc:
            if error_kind(exc) == "internal":
                self.fail(exc, step, "hostile-layout-use", f"{tenant}/{sid} {what}",
                          "a documented error or a resume")
        except Exception as exc:  # noqa: BLE001
            self.fail(exc, step, "hostile-layout-use", f"{tenant}/{sid} {what}", "no crash")
        with contextlib.suppress(KVTierError):
            await kv.delete(tenant, sid)

    def check_listed(self, step: int, op: str, tenant: str, listed) -> None:
        """List names every session of the tenant the model holds for sure, each with
        the generation and tokens of a version the model allows."""
        by_id = {info.session.session_id: info for info in listed}
        for (who, sid), held in sorted(self.model.items()):
            if who != tenant or held.may_be_absent(now()):
                continue
            info = by_id.get(sid)
            if info is None:
                self.ledger.add("lost", self.combo.name, step, op, f"{tenant}/{sid}",
                                f"listed: {held.current.describe()}", "not listed")
                continue
            if not any(v.generation == info.generation and len(v.tokens) == info.num_tokens
                       for v in held.candidates()):
                self.wrong(step, op, f"{tenant}/{sid}", "listed as "
                           + " or ".join(f"gen {v.generation} n {len(v.tokens)}"
                                         for v in held.candidates()),
                           f"gen {info.generation} n {info.num_tokens}")

    async def check_quota(self, step: int, tenant: str, op: str = "count") -> None:
        """Sessions listed (and durable bytes) against the configured quota."""
        from bench.seams.switches import DURABLE_BYTES, SESSIONS

        kv = self.client(tenant)
        try:
            listed = await kv.list(tenant)
            usage = (await kv.stat(usage_of=tenant)).tenant_usage
        except KVTierError as exc:
            self.fail(exc, step, op, tenant, "list and stat")
            return
        self.log(f"step={step} op={op} tenant={tenant} listed={len(listed)} "
                 f"durable={usage.durable_bytes}")
        if op.startswith("count-"):  # nothing runs beside a verification: List is exact
            self.log(f"step={step} listed: " + " ".join(
                f"{i.session.session_id}:{i.generation}:{i.num_tokens}" for i in listed))
            self.check_listed(step, op, tenant, listed)
        if not self.combo.quota:
            return
        # an overshoot is counted when it grows, not again at every count that sees it
        for what, limit, value in (("sessions", SESSIONS, len(listed)),
                                   ("durable bytes", DURABLE_BYTES, usage.durable_bytes)):
            seen = self.overshoots.get((tenant, what), limit)
            if value > seen:
                self.overshoots[(tenant, what)] = value
                self.ledger.add("quota_overshoot", self.combo.name, step, op, tenant,
                                f"<= {limit} {what}", f"{value}")
