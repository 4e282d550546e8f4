"""One switch combination simulated: its server's lives, the operations drawn from the
seed, and the maintenance events between them (restarts, compactions, repair, migrate,
a full medium), every session checked against the reference model after each.

Choices are drawn from ``random.Random(f"{seed}:{combination}")`` and the model's state
alone, so a seed replays the same operations (timings aside: which admission a quota
refuses among concurrent ones may differ). Each step is logged as ``step=N op=...``.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

from bench.seams import lives, maintenance, prefix
from bench.seams.layouts import BUNDLED
from bench.seams.model import Held
from bench.seams.ops import REPLAYS, Ops
from bench.seams.switches import SESSION_TTL_S, Combination, write_config
from bench.seams.verdict import Ledger
from bench.seams.world import STARTED, Moto, Node, Redis, Tmpfs
from kvstore.format.registry import get_layout
from kvtier import AsyncClient
from testing.live_server import ROOT, Child, Credentials

TMPFS_MIB = 48
EVENTS = ("restart", "compact-live", "kill9", "backup", "compact-offline", "cli-tools",
          "repair", "tokens-file", "full-disk", "hung-node", "remote-replay", "drain",
          "rekey")
FINAL = ("migrate",)  # after the last step, single-node combinations (half of them)
EVENT_EVERY = 200  # steps between maintenance events (each restarts or runs a tool)
MAX_SESSIONS = 10  # per tenant, so quota and capacity are met and sessions stay small
# resumes replay on the server's CPU (the costliest step): fewer of them, every R still
WEIGHTS = {"spill-new": 12, "spill-extend": 12, "spill-rewrite": 5, "lookup-spill": 5,
           "stale-spill": 2, "restore": 16, "resume": 5, "resume-twice": 2, "fork": 5,
           "fork-burst": 1, "delete": 6, "restore-deleted": 2, "lookup-foreign": 3, "register": 3,
           "evict": 4, "count": 3, "write-chunks": 4, "read-chunks": 3, "write-pages": 2,
           "read-pages": 2, "identity": 2, "stat-session": 2, "prefetch": 2, "list-layouts": 1}
NO_SESSION = ("register", "count", "write-chunks", "read-chunks", "write-pages", "read-pages",
              "list-layouts")


# Server log lines no operation of a simulation may cause.
SERVER_LOG_FINDINGS = ("corrupt copy", "Traceback (most recent call last)",
                       "exception was never retrieved")


class Simulation(Ops):
    def __init__(self, combo: Combination, seed: int, steps: int, *, workdir: Path,
                 redis: Redis, moto: Moto, creds: Credentials, ledger: Ledger, log) -> None:
        self.combo, self.seed, self.steps = combo, seed, steps
        self.rng = random.Random(f"{seed}:{combo.name}")
        self.root = workdir / combo.slug
        self.root.mkdir(parents=True, exist_ok=True)
        self.redis, self.moto, self.creds = redis, moto, creds
        self.ledger, self.log = ledger, log
        self.tenants = ("acme", "beta")
        self.model: dict[tuple[str, str], Held] = {}
        self.prefixes: list[prefix.Prefix] = []  # prefix chunks written (bench.seams.prefix)
        self.held_reads: list[prefix.HeldRead] = []  # in-place reads with a live read lease
        self.deleted: set[tuple[str, str]] = set()
        # forgotten (expired or lost) but maybe still listed and counted by the server
        self.vanished: set[tuple[str, str]] = set()
        self.layouts = [BUNDLED]
        self.layout_specs = {BUNDLED: get_layout(BUNDLED)}
        self.session_ttl = SESSION_TTL_S if combo.ret else 0.0
        self.default_replay = 128
        self.full = False
        self.overshoots: dict[tuple[str, str], int] = {}  # (tenant, what) -> most seen
        self.clients: dict[str, AsyncClient] = {}
        self._admin: AsyncClient | None = None
        self._ids = 0
        self.step = 0
        self.lives = 0
        self.probe: subprocess.Popen | None = None
        self.replay_worker: Child | None = None  # the remote replayer, once one serves
        self.issued: Path | None = None  # what `kvtier certs` last wrote (bench.seams.operator)
        self.stalls = {"source": "", "count": 0, "probes": 0, "max_ms": 0.0}
        self._stalls_at_start = 0.0
        self.ran = False
        self.seconds: dict[str, list] = {}  # kind -> [operations, seconds]

    # -- clients --

    def client(self, tenant: str) -> AsyncClient:
        if tenant not in self.clients:
            self.clients[tenant] = self._open(tenant)
        return self.clients[tenant]

    def admin_client(self) -> AsyncClient:
        if not self.combo.tls:
            return self.client(self.tenants[0])
        if self._admin is None:
            self._admin = self._open("admin")
        return self._admin

    def _open(self, who: str) -> AsyncClient:
        options = {"timeout_s": 60.0}
        if self.combo.tls:
            options.update(tls_ca=self.creds.ca, token=self.creds.tokens[who])
        return AsyncClient(self.node.target, **options)

    async def close_clients(self) -> None:
        for kv in [*self.clients.values(), *([self._admin] if self._admin else [])]:
            await kv.close()
        self.clients, self._admin = {}, None

    def new_sid(self) -> str:
        self._ids += 1
        return f"s{self._ids}"

    # -- the server's lives --

    def config(self, shared: bool | None = None) -> Path:
        worker = self.replay_worker.target if self.replay_worker is not None else ""
        return write_config(self.combo, self.root, self.data_dir, redis_url=self.redis.url,
                            replay_worker=worker,
                            s3_endpoint=self.moto.endpoint, bucket=self.bucket,
                            creds_root=self.creds.root if self.combo.tls else None,
                            shared=shared)

    async def start(self, config: Path | None = None) -> bool:
        self.node = Node(config or self.config_path, self.root / "server.log", {},
                         self.creds if self.combo.tls else None)
        ok = await asyncio.to_thread(self.node.start)
        if not ok:
            return False
        self.lives += 1
        self._internal_mark = self.internal_seen()
        baseline = await asyncio.to_thread(self.node.stalls)
        if baseline is not None:
            self.stalls["source"] = "kvtier_event_loop_stalls_total"
            self._stalls_at_start = baseline
        else:
            self.stalls["source"] = "probe-fallback (no kvtier_event_loop_stalls_total)"
            argv = [sys.executable, "-m", "bench.seams.probe", self.node.target]
            if self.combo.tls:
                argv += [self.creds.ca, self.creds.tokens["admin"]]
            self.probe = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True)
            STARTED.append(self.probe)
        return True

    async def end_life(self, how: str) -> None:
        """Stop the server (``term``: SIGTERM, ``kill``: SIGKILL), counting its stalls
        and the INTERNAL answers it counted."""
        await self.close_clients()
        await self.count_server_internal()
        if self.probe is None:
            total = await asyncio.to_thread(self.node.stalls)
            if total is not None:
                self._count_stalls(total - self._stalls_at_start)
        else:
            self.probe.stdin.close()
            import json

            line = (await asyncio.to_thread(self.probe.stdout.readline)).strip()
            self.probe.wait()
            self.probe = None
            if line:
                probe = json.loads(line)
                self.stalls["probes"] += probe["probes"]
                self.stalls["max_ms"] = max(self.stalls["max_ms"], probe["max_ms"])
                self._count_stalls(probe["over_50ms"])
        if how == "kill":
            await asyncio.to_thread(self.node.kill)
        else:
            code = await asyncio.to_thread(self.node.stop)
            if code not in (0, None):
                self.ledger.add("unexpected", self.combo.name, self.step, "stop", "-",
                                "exit 0 after SIGTERM", f"exit {code}")

    def internal_seen(self) -> int:
        return self.ledger.by_combination.get(self.combo.name, {}).get("internal", 0)

    async def count_server_internal(self) -> None:
        """INTERNAL or UNKNOWN answers the server counted this life
        (``kvtier_requests_total``) beyond those the client saw (a retried call, a tool)."""
        try:
            samples = await asyncio.to_thread(self.node.metrics)
        except OSError:
            return
        counted = sum(v for k, v in samples.items() if k.startswith("kvtier_requests_total{")
                      and ('code="INTERNAL"' in k or 'code="UNKNOWN"' in k))
        extra = int(counted) - (self.internal_seen() - self._internal_mark)
        if extra > 0:
            self.ledger.add("internal", self.combo.name, self.step, "server-count", "-",
                            "no INTERNAL/UNKNOWN in kvtier_requests_total",
                            f"{extra} more than the client saw", count=extra)

    def _count_stalls(self, count: float) -> None:
        if count > 0:
            self.stalls["count"] += int(count)
            self.ledger.add("stalls_over_50ms", self.combo.name, self.step, "stalls", "-",
                            "0 event-loop ticks over 50 ms late",
                            f"{int(count)} ({self.stalls['source']})", count=int(count))

    # -- the run --

    async def run(self) -> dict:
        self.tmpfs = Tmpfs(self.root / "mnt", TMPFS_MIB)
        self.on_tmpfs = self.tmpfs.mounted
        try:
            self.data_dir = self.tmpfs.path / "data"
            self.bucket = f"seams-{self.seed}-{self.combo.slug}"[:63]
            if self.combo.shared:
                await asyncio.to_thread(self.moto.bucket, self.bucket)
            self.config_path = self.config()
            if not await self.start():
                self.refused()
                return self.summary()
            self.ran = True
            try:
                await self.loop()
                if maintenance.applies(self, "migrate") and self.rng.random() < 0.5:
                    await maintenance.migrate(self)
            except lives.Abort:
                self.log(f"combo={self.combo.name} aborted at step {self.step}")
            finally:
                prefix.judge_all_held(self)
                if self.node.alive():
                    await self.end_life("term")
                if self.replay_worker is not None:
                    await asyncio.to_thread(self.replay_worker.stop)
                self.read_server_log()
        finally:
            self.tmpfs.close()
        return self.summary()

    def read_server_log(self) -> None:
        """What the server logged that no operation may cause: a corrupt copy (nothing
        in a simulation damages a medium), a traceback, a task whose error nobody read,
        a log line that is not JSON (the config says ``log_format = "json"``)."""
        path = self.root / "server.log"
        if not path.exists():
            return
        seen = set()
        for line in path.read_text(errors="replace").splitlines():
            if line[:4].isdigit() and "unformatted" not in seen:  # a text line: not JSON
                seen.add("unformatted")
                self.ledger.add("unexpected", self.combo.name, self.step, "server-log", "-",
                                'log_format = "json": one JSON object a line', line[:300])
            message = line.partition(": ")[2] if line[:4].isdigit() else line
            if any(mark in line for mark in SERVER_LOG_FINDINGS) and message not in seen:
                seen.add(message)
                self.ledger.add("unexpected", self.combo.name, self.step, "server-log", "-",
                                "no corrupt copy, traceback or unread task error", line[:300])

    def refused(self) -> None:
        from services.cli import serve

        said = self.node.refusal
        documented = "shared" in (serve.__doc__ or "") and "encryption" in (serve.__doc__ or "")
        self.log(f"combo={self.combo.name} refused at start: {said}")
        if not documented:
            self.ledger.add("unexpected", self.combo.name, 0, "serve", "-",
                            "serves, or a refusal kvtier serve documents", said)

    async def loop(self) -> None:
        offset = (self.seed + sum(map(ord, self.combo.name))) % len(EVENTS)
        every = min(EVENT_EVERY, max(20, self.steps // 2))
        next_event, index = every, offset
        while self.step < self.steps:
            if self.step >= next_event:
                while not maintenance.applies(self, EVENTS[index % len(EVENTS)]):
                    index += 1
                await maintenance.event(self, EVENTS[index % len(EVENTS)])
                index += 1
                next_event += every
                continue
            batch = self.draw()
            first = self.step
            self.step += len(batch)
            await asyncio.gather(*(self.timed(kind, op, first + i)
                                   for i, (kind, op) in enumerate(batch)))
            if not self.node.alive():
                await self.revive(first)

    async def revive(self, step: int) -> None:
        """The server died under the operations: a finding, then a start as after a
        kill -9 (the model's memory-acked versions may be gone)."""
        code = self.node.child.proc.returncode
        self.ledger.add("internal", self.combo.name, step, "server-died", "-",
                        "the server keeps serving", f"exit {code}")
        await maintenance.event(self, "kill9")

    async def timed(self, kind: str, op, step: int) -> None:
        started = time.monotonic()
        await op(step)
        spent = self.seconds.setdefault(kind, [0, 0.0])
        spent[0] += 1
        spent[1] += time.monotonic() - started

    def draw(self) -> list:
        """Up to six operations on distinct sessions, run together."""
        busy: set = set()
        return [self.pick(busy) for _ in range(self.rng.randint(1, 6))]

    def pick(self, busy: set) -> tuple[str, object]:
        """(kind, operation) of one weighted draw; a kind that needs a session the tenant
        lacks becomes a spill of a new one."""
        return self._pick(self.rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0],
                          busy)

    def _pick(self, kind: str, busy: set):
        tenant = self.rng.choice(self.tenants)
        if kind in ("write-chunks", "read-chunks", "write-pages", "read-pages"):
            pages = kind.endswith("pages")  # independent chunks
            reading = kind.startswith("read")
            found = prefix.choose(self, tenant, busy, written=reading, independent=pages)
            if reading and found is not None:
                return kind.replace("-", "_"), lambda s: prefix.read(
                    self, s, found, "read-pages" if pages else "read-chunks")
            if found is None or self.rng.random() < 0.5:
                found = prefix.new_prefix(self, tenant, independent=pages)
                busy.add((tenant, found.pid))
            return ("write_pages" if pages else "write_chunks"), \
                lambda s: prefix.write(self, s, found)
        if kind == "list-layouts":
            return "list_layouts", self.list_layouts
        mine = [h for k, h in sorted(self.model.items()) if k[0] == tenant and k not in busy]
        held = self.rng.choice(mine) if mine else None
        if held is not None:
            busy.add((tenant, held.sid))
        if kind == "lookup-spill":
            whole = [h for h in mine
                     if len(h.current.tokens) >= self.spec(h.current.layout).chunk_tokens]
            if whole:
                busy.discard((tenant, held.sid))
                held = self.rng.choice(whole)
                busy.add((tenant, held.sid))
        if kind == "spill-new" or (held is None and kind not in NO_SESSION):
            if len(mine) >= MAX_SESSIONS and held is not None:
                return "delete", lambda s: self.delete(s, held)
            sid = self.new_sid()
            busy.add((tenant, sid))
            return "spill_new", lambda s: self.spill_new(s, tenant, sid)
        if kind in ("spill-extend", "spill-rewrite"):
            if len(held.current.tokens) > 3000:
                return "delete", lambda s: self.delete(s, held)
            return "spill_next", lambda s: self.spill_next(s, held, kind == "spill-rewrite")
        if kind == "lookup-spill":
            sid = self.new_sid()
            return "lookup_spill", lambda s: self.lookup_spill(s, held, sid)
        if kind == "stale-spill":
            return "stale_spill", lambda s: self.stale_spill(s, held)
        if kind == "restore":
            return "restore", lambda s: self.restore(s, held)
        if kind == "resume-twice":  # a later Resume must not get a shorter replay's window
            first, then = self.rng.choice(REPLAYS), self.rng.choice(REPLAYS)
            return "resume_twice", lambda s: self.resume_twice(s, held, first, then)
        if kind == "resume":
            replay = self.rng.choice(REPLAYS)
            return "resume", lambda s: self.restore(s, held, op="resume", replay=replay)
        if kind == "fork":
            new = self.new_sid()
            return "fork", lambda s: self.fork(s, held, new)
        if kind == "fork-burst":
            news = [self.new_sid() for _ in range(6)]
            return "fork_burst", lambda s: self.fork_burst(s, held, news)
        if kind == "delete":
            return "delete", lambda s: self.delete(s, held)
        if kind == "restore-deleted":
            gone = sorted(k for k in self.deleted if k not in busy)
            if not gone:
                return "restore", lambda s: self.restore(s, held)
            key = self.rng.choice(gone)
            busy.add(key)
            return "restore_deleted", lambda s: self.restore_deleted(s, *key)
        if kind == "lookup-foreign":
            other = next(t for t in self.tenants if t != tenant)
            return "lookup_foreign", lambda s: self.lookup_foreign(s, other, held)
        if kind == "register":
            hostile = self.rng.random() < 0.6
            return "register", lambda s: self.register(s, hostile)
        if kind == "evict":
            return "evict", lambda s: self.evict(s, held)
        if kind == "identity":
            return "identity", lambda s: self.identity(s, held)
        if kind == "stat-session":
            return "stat_session", lambda s: self.stat_session(s, held)
        if kind == "prefetch":
            return "prefetch", lambda s: self.prefetch(s, held)
        return "check_quota", lambda s: self.check_quota(s, tenant)

    async def verify_all(self, why: str) -> None:
        """Every session of the model restored (each a step), in sorted order."""
        for key in sorted(self.model):
            held = self.model.get(key)
            if held is not None:
                self.step += 1
                await self.restore(self.step, held, op=f"verify-{why}")
        for tenant in self.tenants:
            self.step += 1
            await self.check_quota(self.step, tenant, f"count-{why}")
        await prefix.verify(self, why)

    def summary(self) -> dict:
        counts = self.ledger.by_combination.get(self.combo.name, {})
        return {"combination": self.combo.name, "ran": self.ran, "steps": self.step,
                "server_starts": self.lives, "stalls": dict(self.stalls),
                "tmpfs": self.on_tmpfs,
                "op_seconds": {k: round(v[1] / v[0], 4) for k, v in sorted(self.seconds.items())},
                **{k: counts.get(k, 0) for k in self.ledger.counts}}
