"""Maintenance events between a simulation's operations, each ending with every session
checked against the model (``Simulation.verify_all``):

- ``restart``: SIGTERM (the write-back drains: every acked version is durable), start;
- ``kill9``: SIGKILL; a memory-acked version may be gone, back to the last durable one;
- ``compact-offline``: stopped, ``kvtier compact --data-dir D --json`` with the server's
  ``--config``; on an encrypted directory first without it, as the README's command
  runs: then it must either work or refuse (exit 2), and lose nothing either way;
- ``compact-live``: the same against the live server (``--server``, an admin token);
  with shared metadata compact must refuse, and ``kvtier fleet-gc`` sweeps the bucket
  with no grace period instead;
- ``repair``: stopped, ``kvtier repair --data-dir D --json`` (encrypted: first without
  the key, then with it);
- ``full-disk``: a ballast file beside the data directory leaves a few MiB of its tmpfs
  free; spills until one is refused, restores, deletes (every one must work), spills
  again once the deletes' space is back, the ballast removed;
- ``migrate`` (single-node combinations, at the end): ``kvtier migrate`` into a bucket
  of its own, then the directory served shared;
- ``backup``: ``kvtier backup`` then ``kvtier restore-backup`` (``bench.seams.backups``):
  intact, exit 0 and every session bit-exact when served from the restored directory;
  damaged (a segment removed, replaced by a symlink, a byte flipped), exit 1;
- ``rekey``: encrypted, ``kvtier keygen --rotate`` adds a current key. Live (half the time):
  ``kvtier reload`` gives it to the running server, which reseals its own disk in the
  background, while ``kvtier rekey --json`` runs beside it (Redis and the bucket) until
  it reports nothing under the old keys (bounded); the old keys then leave the keyring
  and a second reload makes the server forget them, never stopping it. Offline (the other
  half): a restart takes the key, rekey runs beside the live server, then with it
  stopped (the disk). Either way it must end reporting nothing under the old keys and
  naming them as no longer needed, and every session must read as the model has it with
  the new key alone. In clear, rekey must refuse (exit 2);
- ``cli-tools``, ``tokens-file``, ``hung-node``, ``remote-replay``, ``drain``: what an
  operator does beside the clients (``bench.seams.operator``).

Before a stop the write-back queue holds fresh prefix chunks of both acks
(``bench.seams.prefix``), so each restart judges what it keeps of them.

Windows live in memory only: after any restart none of the spilled ones may come back.
"""

from __future__ import annotations

import asyncio
import os

from bench.seams import backups, operator, prefix
from bench.seams.lives import start, stop
from bench.seams.verdict import named
from bench.seams.world import run_cli
from kvstore.format.errors import KVTierError, TierFull

BALLAST_FREE = 6 << 20  # what the ballast leaves free: a little above the disk reserve
FILL_TOKENS = 4096
SETTLE_S = 8.0
# The disk tier stops value writes while less than its 4 MiB reserve would be left
# (metadata and deletes may use it): a quarter of it must still be free when it refuses.
KEPT_FREE = 1 << 20  # how long a spill may wait for a full medium's freed space


def applies(sim, kind: str) -> bool:
    """Whether ``kind`` means something for the combination: the tokens file needs
    TLS; a hung node, a second node on the same data (shared metadata); migrate, a
    single node."""
    if kind == "tokens-file":
        return sim.combo.tls
    if kind == "hung-node":
        return sim.combo.shared
    if kind == "migrate":
        return not sim.combo.shared
    return True


async def event(sim, kind: str) -> None:
    sim.log(f"step={sim.step} event={kind}")
    sim.step += 1
    if kind in ("restart", "kill9", "repair", "compact-offline", "backup", "drain"):
        await fresh_chunks(sim)
    if kind == "restart":
        await stop(sim, "term")
        await start(sim, kind)
    elif kind == "kill9":
        await stop(sim, "kill")
        await start(sim, kind)
    elif kind == "backup":
        await backups.event(sim)
    elif kind in operator.EVENTS:
        await operator.EVENTS[kind](sim)
    elif kind == "compact-offline":
        prefix.forget_all(sim, kind)
        await stop(sim, "term")
        args = ["compact", "--data-dir", str(sim.data_dir), "--json"]
        if sim.combo.enc:  # the README's command first, as an operator may run it
            await tool(sim, kind, args, bare=True)
        await _compact(sim, kind, args)
        await start(sim, kind)
    elif kind == "compact-live":
        prefix.forget_all(sim, kind)
        args = ["compact", "--data-dir", str(sim.data_dir), "--json", "--server",
                sim.node.target]
        if sim.combo.tls:
            args += ["--tls-ca", sim.creds.ca, "--token-file",
                     str(sim.creds.root / "admin.token")]
        await _compact(sim, kind, args)
    elif kind == "repair":
        await stop(sim, "term")
        args = ["repair", "--data-dir", str(sim.data_dir), "--json"]
        if sim.combo.enc:
            await tool(sim, kind, args, bare=True)
        await tool(sim, kind, args, bare=False)
        await start(sim, kind)
    elif kind == "full-disk":
        await full_disk(sim)
    elif kind == "rekey":
        await rekey(sim)
    await sim.verify_all(kind)


async def fresh_chunks(sim) -> None:
    """Prefix chunks written just before a stop, one write of each ack, so a restart
    judges chunks still within their retention time."""
    for ack in ("durable", "memory"):
        sim.step += 1
        await prefix.write(sim, sim.step, prefix.new_prefix(sim, sim.tenants[0]), ack)


async def _compact(sim, kind: str, args: list[str]) -> None:
    """``kvtier compact`` with the server's config; a fleet node's must be refused (its
    chunks are the fleet's), and the fleet's own sweep runs instead, with no grace
    period: every chunk no manifest names is collected, the sessions must all hold."""
    if not sim.combo.shared:
        await tool(sim, kind, args, bare=False)
        return
    await tool(sim, kind, args, bare=False, refusal="metadata = 'shared'")
    await tool(sim, "fleet-gc", ["fleet-gc", "--json", "--grace-s", "0", "--retain-s", "0",
                                  "--spill-bound-s", "0.5", "--margin-s", "0.2"], bare=False)


async def tool(sim, kind: str, args: list[str], *, bare: bool, refusal: str = ""
                ) -> tuple[int, dict | None]:
    """A CLI tool with the server's config (``bare``: without it, nor any key);
    ``refusal``: it must exit 2 saying so."""
    if not bare:
        args = [*args, "--config", str(sim.config_path)]
    rc, report, said = await asyncio.to_thread(run_cli, args, {})
    sim.log(f"step={sim.step} tool={kind} bare={bare} rc={rc} said={said[:200]}")
    if refusal:
        if rc != 2 or refusal not in said:
            sim.ledger.add("unexpected", sim.combo.name, sim.step, kind, "-",
                           f"refused (exit 2): {refusal}", f"exit {rc}: {said}")
    elif rc != 0 and not (bare and sim.combo.enc and rc == 2):
        sim.ledger.add("unexpected", sim.combo.name, sim.step, kind,
                       "-", "exit 0" + (" or a refusal (exit 2) without the key" if bare
                                        else ""), f"exit {rc}: {said}")
    return rc, report


async def rekey(sim) -> None:
    """Rotate the keyring, reseal everything under the new key, retire the old ones."""
    from kvstore.encryption.seal import keyring_from_file

    if not sim.combo.enc:
        await tool(sim, "rekey", ["rekey", "--json"], bare=False, refusal="encrypts nothing")
        return
    keys = sim.root / "keys.toml"
    old = keyring_from_file(keys).key_ids
    new = f"seams-{sim.step}"
    await tool(sim, "keygen-rotate", ["keygen", "--rotate", str(keys), "--id", new],
               bare=True)
    prefix.forget_all(sim, "rekey")
    if sim.rng.random() < 0.5:
        await _rekey_live(sim, old, new, keys)
        return
    await stop(sim, "term")
    await start(sim, "rekey")  # new writes sealed under the new key
    _, online = await tool(sim, "rekey-online", ["rekey", "--json"], bare=False)
    if online is not None and online["current"] != new:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "rekey-online", "-",
                       f"resealed under {new}", str(online["current"]))
    await stop(sim, "term")
    _, offline = await tool(sim, "rekey-offline", ["rekey", "--json"], bare=False)
    if _retired(sim, "rekey-offline", offline, old):
        _keep_only(keys, new)
    await start(sim, "rekey")


REKEY_LIVE_TRIES = 60  # rekey runs, 0.5 s apart, while the server reseals its disk


async def _rekey_live(sim, old: list[str], new: str, keys) -> None:
    """Rotate without a stop: reload, rekey beside the resealing server until nothing is
    left under ``old``, drop ``old`` from the keyring, reload again."""
    reload = ["reload", "--data-dir", str(sim.data_dir)]
    await tool(sim, "rekey-reload", reload, bare=True)
    report = None
    for _ in range(REKEY_LIVE_TRIES):
        _, report = await tool(sim, "rekey-live", ["rekey", "--json"], bare=False)
        if report is None or not report["sealed_under_old"]:
            break
        await asyncio.sleep(0.5)
    if _retired(sim, "rekey-live", report, old):
        _keep_only(keys, new)
        await tool(sim, "rekey-reload", reload, bare=True)


def _retired(sim, kind: str, report: dict | None, old: list[str]) -> bool:
    if report is None or report["sealed_under_old"] or report["no_longer_needed"] != old:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, kind, "-",
                       f"nothing left under {old}, each no longer needed", str(report))
        return False
    return True


def _keep_only(keys, key_id: str) -> None:
    """As rekey's report says: every other key leaves the keyring."""
    tables = keys.read_text().split("[[key]]")
    kept = [t for t in tables[1:] if f'id = "{key_id}"' in t]
    keys.write_text(tables[0] + "".join("[[key]]" + t for t in kept))


async def full_disk(sim) -> None:
    if not sim.tmpfs.mounted:
        sim.log(f"step={sim.step} full-disk skipped: no tmpfs (not root)")
        return
    ballast = sim.tmpfs.path / "ballast"  # beside the data directory, not in it
    size = sim.tmpfs.free() - BALLAST_FREE
    if size > 0:
        with open(ballast, "wb") as handle:
            os.posix_fallocate(handle.fileno(), 0, size)
    sim.full = True
    # a medium filling sheds retained chunks first (README "Retention"): prefix chunks
    # are retained cache, so any may go
    prefix.forget_all(sim, "full-disk")
    made, refused = [], None
    try:
        tenant = sim.tenants[sim.step % 2]
        spec = sim.spec("kvtier-bundled")
        for _ in range(60):
            sim.step += 1
            sid = sim.new_sid()
            tokens = sim.tokens(spec, FILL_TOKENS)
            try:
                await sim.client(tenant).spill(
                    tenant, sid, spec, tokens.numpy().astype("uint32"),
                    _streams(sim, spec), generation=1, ack="durable")
            except KVTierError as exc:
                refused = exc
                break
            made.append(sid)
            from bench.seams.model import Held, Version

            sim.model[(tenant, sid)] = Held(tenant, sid, [Version(
                1, spec.name, tokens, sim._last_streams, None, True, f"fill@{sim.step}")])
        sim.log(f"step={sim.step} full-disk filled {len(made)} then "
                f"{named(refused) if refused else 'no refusal'} free={sim.tmpfs.free()}")
        if refused is not None and not sim.documented(refused, admission=True):
            sim.fail(refused, sim.step, "fill", f"{tenant}/-", "TierFull or QuotaExceeded")
        free = sim.tmpfs.free()
        if isinstance(refused, TierFull) and free < KEPT_FREE:
            sim.ledger.add("unexpected", sim.combo.name, sim.step, "fill", f"{tenant}/-",
                           f">= {KEPT_FREE} B left free on the medium (the disk tier's "
                           "reserve) once spills are refused", f"{free} B free")
        for key in sorted(sim.model)[:3]:  # reads need no free space
            sim.step += 1
            await sim.restore(sim.step, sim.model[key], op="restore-full")
        for sid in made:
            sim.step += 1
            held = sim.model.get((tenant, sid))
            if held is not None:
                await sim.delete(sim.step, held)
        if isinstance(refused, TierFull) and made:
            await _spill_settles(sim, tenant)
    finally:
        ballast.unlink(missing_ok=True)
        sim.full = False


async def _spill_settles(sim, tenant: str) -> None:
    """After the deletes a spill must be taken again (once the server has its space
    back, within ``SETTLE_S``)."""
    spec = sim.spec("kvtier-bundled")
    sid = sim.new_sid()
    tokens = sim.tokens(spec, 512)
    last = None
    for _ in range(int(SETTLE_S / 0.5)):
        sim.step += 1
        try:
            await sim.client(tenant).spill(tenant, sid, spec, tokens.numpy().astype("uint32"),
                                           _streams(sim, spec, 512), generation=1,
                                           ack="durable")
        except TierFull as exc:
            last = exc
            await asyncio.sleep(0.5)
            continue
        from bench.seams.model import Held, Version

        sim.model[(tenant, sid)] = Held(tenant, sid, [Version(
            1, spec.name, tokens, sim._last_streams, None, True, f"refill@{sim.step}")])
        return
    sim.ledger.add("unexpected", sim.combo.name, sim.step, "spill-after-deletes",
                   f"{tenant}/{sid}", f"taken within {SETTLE_S} s of the deletes",
                   named(last) if last else "-")


def _streams(sim, spec, tokens: int = FILL_TOKENS):
    from bench.seams.model import random_streams

    sim._last_streams = random_streams(spec, tokens, sim.rng)
    return sim._last_streams


async def migrate(sim) -> None:
    """Stopped, migrated into a bucket of its own, served shared, every session checked."""
    sim.log(f"step={sim.step} event=migrate")
    sim.step += 1
    await stop(sim, "term")
    prefix.forget_all(sim, "migrate")
    sim.bucket = f"seams-{sim.seed}-{sim.combo.slug}-m"[:63]
    await asyncio.to_thread(sim.moto.bucket, sim.bucket)
    shared = sim.config(shared=True)
    rc, report, said = await asyncio.to_thread(
        run_cli, ["migrate", "--config", str(shared), "--data-dir", str(sim.data_dir),
                  "--json"], {})
    sim.log(f"step={sim.step} tool=migrate rc={rc} said={said[:200]}")
    if rc == 2 and sim.combo.enc:  # documented: migrate refuses encryption at rest
        await start(sim, "migrate-refused")
    elif rc != 0:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "migrate", "-", "exit 0",
                       f"exit {rc}: {said}")
        await start(sim, "migrate-failed")
    else:
        await start(sim, "migrate", shared)
    await sim.verify_all("migrate")
