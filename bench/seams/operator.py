"""Maintenance events of what an operator does beside the clients, each judged against
the model (``maintenance.event`` verifies every session after each):

- ``cli-tools``: the online subcommands against the live server as the README runs
  them (``stat --json --tenant``, ``list --json``, ``layouts --server --json``,
  ``health``, ``top --iterations 1``, ``lookup``, ``fork``), each reply's stored state
  against the model; ``reload`` (SIGHUP) of the unchanged config, whose line must name
  what the server runs with (no tenant quota table; the keyring's current key with
  ``enc``), and every session verified after it; ``certs`` and ``keygen`` into the run's
  directory, their files loaded by the server's own loaders (and ``certs``' tokens used
  by ``tokens-file``);
  ``init --secure`` into a new directory: a config ``serve --print-config`` accepts,
  loopback, files 0600 and directories 0700, the shipped deploy files, and a second
  ``init`` there refused;
- ``drain``: ``kvtier drain`` of the live server: done with nothing left to write back,
  a write after it refused UNAVAILABLE; on a fleet node, with a live peer started for
  it (``bench.seams.peer_drain``): the peer RPC refused to tenants and for bytes its
  header does not describe, every window moved to the peer, which resumes each such
  session without replay and with the model's window; then the server killed with
  SIGKILL and started again, every version the model holds (memory-acked ones too)
  required to restore;
- ``tokens-file`` (TLS): a tenant token added to the live tokens file, then revoked;
  the server re-reads it once a second, so within ``RELOAD_S`` the new token works and
  then the revoked one is refused, while the other tenants' keep working; before it a
  plaintext HTTP/2 client on the TLS port must be answered a TLS alert and be audited
  (kind ``plaintext``) with the address it connected from, unless this host's last
  such record is under a minute old (one a minute per host);
- ``hung-node`` (shared metadata: every node serves the same sessions): a second node
  on the same bucket and Redis, a routed client over both (``AsyncClient(servers=[A,
  B], timeout_s=ROUTED_TIMEOUT_S)``), B stopped (SIGSTOP): every restore routed must
  fail over to A within its deadline and be judged as any;
- ``remote-replay``: the server restarted with a ``kvtier replay-worker`` as its remote
  replayer (the Replay service's Rebuild) for the rest of the combination, resumes
  judged as any.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import shutil
import signal
import socket
import time

from bench.seams import lives, peer_drain, prefix
from bench.seams.model import Held, Version, truncated
from bench.seams.verdict import now
from bench.seams.world import CLI, STARTED, Node, cli_output
from kvstore.format.errors import KVTierError, TierUnavailable
from kvtier import AsyncClient, RetryPolicy
from services.serving.tls_front import PROTOCOL_VERSION_ALERT, grpc_peer
from testing.live_server import Child

RELOAD_S = 8.0  # the tokens file is re-read once a second: a bound with room for load
ROUTED_TIMEOUT_S = 3.0
ROUTED_SLACK_S = 2.0  # a call's time past its deadline that is still "within" it
ROUTED_CALLS = 6
REMOTE_RESUMES = 4


def _server_args(sim, who: str = "admin") -> list[str]:
    args = ["--server", sim.node.target]
    if sim.combo.tls:
        args += ["--tls-ca", sim.creds.ca, "--token-file", str(sim.creds.root / f"{who}.token")]
    return args


async def _cli(sim, kind: str, args: list[str], *, expect: int = 0, admission: bool = False
               ) -> tuple[int, str]:
    """A subcommand; its exit status must be ``expect`` (``admission``: or 1 under a
    quota, which may refuse a new session)."""
    rc, out, said = await asyncio.to_thread(cli_output, args, {}, 120.0)
    sim.log(f"step={sim.step} tool={kind} rc={rc} said={said[:200]}")
    if rc != expect and not (admission and sim.combo.quota and rc == 1
                             and "RESOURCE_EXHAUSTED" in said):
        sim.ledger.add("unexpected", sim.combo.name, sim.step, kind, "-", f"exit {expect}",
                       f"exit {rc}: {said}")
    return rc, out


def _sure(sim, tenant: str) -> list[Held]:
    """The tenant's sessions the model holds for sure, a settled version each."""
    at = now()
    return [h for (t, _), h in sorted(sim.model.items())
            if t == tenant and not h.may_be_absent(at) and not h.uncertain]


async def cli_tools(sim) -> None:
    tenant = sim.tenants[0]
    rc, out = await _cli(sim, "cli-stat", ["stat", "--json", "--tenant", tenant,
                                           *_server_args(sim)])
    if rc == 0:
        usage = json.loads(out).get("tenantUsage", {})
        _counted(sim, "cli-stat", tenant, int(usage.get("sessions", -1)))
    rc, out = await _cli(sim, "cli-list", ["list", "--json", "--tenant", tenant,
                                           *_server_args(sim, tenant)])
    if rc == 0:
        listed = {json.loads(line)["session"]["sessionId"] for line in out.splitlines()
                  if line.strip()}
        for held in _sure(sim, tenant):
            if held.sid not in listed:
                sim.ledger.add("lost", sim.combo.name, sim.step, "cli-list",
                               f"{tenant}/{held.sid}", "listed", "not listed")
    rc, out = await _cli(sim, "cli-layouts", ["layouts", "--json", *_server_args(sim)])
    if rc == 0:
        names = {entry.get("name") for entry in json.loads(out)}
        if set(sim.layouts) - names:
            sim.wrong(sim.step, "cli-layouts", "-", f"{sorted(sim.layouts)} listed",
                      f"{sorted(set(sim.layouts) - names)} missing")
    await _cli(sim, "cli-health", ["health", *_server_args(sim)])
    await _cli(sim, "cli-top", ["top", "--iterations", "1", "--interval", "0.1",
                                *_server_args(sim)])
    await _cli_lookup_and_fork(sim, tenant)
    await _generate(sim, tenant)
    await _reload(sim)
    await _certs_and_keygen(sim)
    await _init(sim)


async def _reload(sim) -> None:
    """``kvtier reload`` of the config the node runs: taken, and its line states the
    quotas (only ``[quota.default]``: no tenant table) and the current key it runs with."""
    rc, out = await _cli(sim, "cli-reload", ["reload", "--data-dir", str(sim.data_dir)])
    if rc != 0:
        return
    want = ["reloaded:", "quotas (0 tenant tables)"]
    if sim.combo.enc:
        want.append("keyring (current seams)")
    missing = [part for part in want if part not in out]
    if missing:
        sim.wrong(sim.step, "cli-reload", "-", f"a line naming {want}", out.strip())


def _counted(sim, op: str, tenant: str, got: int) -> None:
    sure = len([h for (t, _), h in sim.model.items()
                if t == tenant and not h.may_be_absent(now())])
    most = len([1 for (t, _) in [*sim.model, *sim.vanished] if t == tenant])
    if not sure <= got <= most:
        sim.wrong(sim.step, op, tenant, f"{sure}..{most} sessions", f"{got}")


async def _cli_lookup_and_fork(sim, tenant: str) -> None:
    """``kvtier lookup`` of a settled session's tokens (every whole chunk held), then
    ``kvtier fork`` of its whole chunks into a new session the model holds."""
    sessions = _sure(sim, tenant)
    if not sessions:
        return
    held = sim.rng.choice(sessions)
    base = held.current
    spec = sim.spec(base.layout)
    n = len(base.tokens)
    tokens = ",".join(str(int(t)) for t in base.tokens)
    rc, out = await _cli(sim, "cli-lookup", ["lookup", "--tenant", tenant, "--layout",
                                             base.layout, "--model", held.model,
                                             *_server_args(sim, tenant), tokens])
    whole = n // spec.chunk_tokens * spec.chunk_tokens
    if rc == 0 and not out.startswith(f"{whole} of {n} tokens held"):
        sim.wrong(sim.step, "cli-lookup", f"{tenant}/{held.sid}",
                  f"{whole} of {n} tokens held", out.strip()[:100])
    if not 0 < whole < n:
        return
    new = sim.new_sid()
    rc, out = await _cli(sim, "cli-fork", ["fork", "--tenant", tenant, "--upto-tokens",
                                           str(whole), *_server_args(sim, tenant), held.sid,
                                           new], admission=True)
    if rc != 0:
        return  # a quota may refuse it: the exit status was judged
    copy = Version(1, base.layout, base.tokens[:whole].clone(),
                   truncated(spec, base.persistent, whole), None, base.durable,
                   f"cli-fork@{sim.step}")
    sim.model[(tenant, new)] = Held(tenant, new, [copy], ttl_s=held.ttl_s, model=held.model)
    sim.deleted.discard((tenant, new))


async def _generate(sim, tenant: str) -> None:
    """``kvtier generate`` on a new session (the bundled model, spilled durably), twice
    in half the events: the second continues the first, a generation on and longer; the
    session is then deleted (its tensors are the model's, not the simulation's)."""
    sid = sim.new_sid()
    prompt = f"step {sim.step}: "
    args = ["generate", "--tenant", tenant, "--session", sid, "--max-new-tokens", "4",
            *_server_args(sim, tenant)]
    seen = []
    for turn in ("one", "two") if sim.rng.random() < 0.5 else ("one",):
        rc, _ = await _cli(sim, f"cli-generate-{turn}", [*args, "--prompt", prompt],
                           admission=True)
        if rc != 0:
            break
        try:
            stat = await sim.client(tenant).stat(tenant, sid)
        except KVTierError as exc:
            sim.fail(exc, sim.step, f"cli-generate-{turn}", f"{tenant}/{sid}", "spilled")
            break
        seen.append((stat.session.generation, stat.session.num_tokens))
    if len(seen) == 2 and not (seen[1][0] > seen[0][0]
                               and seen[1][1] == seen[0][1] + len(prompt) + 4):
        sim.wrong(sim.step, "cli-generate", f"{tenant}/{sid}",
                  f"the second run a generation on, {len(prompt) + 4} tokens longer",
                  f"(generation, tokens) {seen}")
    try:
        await sim.client(tenant).delete(tenant, sid)
    except KVTierError as exc:
        if seen:
            sim.fail(exc, sim.step, "cli-generate-delete", f"{tenant}/{sid}", "deleted")


async def _certs_and_keygen(sim) -> None:
    """``kvtier certs`` and ``kvtier keygen`` into a fresh directory: both write files
    the server's own loaders take; keygen refuses to replace its keyring."""
    from kvstore.encryption.seal import load_keyring

    where = sim.root / f"tools-{sim.step}"
    shutil.rmtree(where, ignore_errors=True)
    rc, _ = await _cli(sim, "cli-certs", ["certs", str(where / "certs")])
    if rc == 0:
        sim.issued = where / "certs"  # tokens-file adds one of its tokens
    keyring = where / "keys.toml"
    rc, _ = await _cli(sim, "cli-keygen", ["keygen", str(keyring), "--id", "seams-new"])
    if rc != 0:
        return
    before = keyring.read_bytes()
    try:
        load_keyring(str(keyring), "")
    except KVTierError as exc:
        sim.fail(exc, sim.step, "cli-keygen", "-", "a keyring the server loads")
    if keyring.stat().st_mode & 0o077:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "cli-keygen", "-",
                       "a keyring only its owner reads (0600)", oct(keyring.stat().st_mode))
    await _cli(sim, "cli-keygen-again", ["keygen", str(keyring)], expect=2)
    if keyring.read_bytes() != before:
        sim.ledger.add("lost", sim.combo.name, sim.step, "cli-keygen-again", "-",
                       "the keyring left as it was", "replaced")


async def _init(sim) -> None:
    """``kvtier init --secure`` into a new directory: what it writes is a config the
    server accepts, on loopback, private, with the deploy files the wheel ships; a second
    ``init`` into it is refused (exit 2) and changes nothing."""
    from services.cli.init import DEPLOY_FILES, deploy_file

    where = sim.root / f"init-{sim.step}"
    shutil.rmtree(where, ignore_errors=True)
    rc, _ = await _cli(sim, "cli-init", ["init", str(where), "--secure", "--listen",
                                         "127.0.0.1:0", "--metrics-port", "0"])
    if rc != 0:
        return
    config = where / "kvtier.toml"
    loose = sorted(str(p.relative_to(where)) for p in [where, *where.rglob("*")]
                   if p.stat().st_mode & 0o077)
    if loose:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "cli-init", "-",
                       "files 0600 and directories 0700", f"open to others: {loose[:5]}")
    differ = [n for n in DEPLOY_FILES if (where / "deploy" / n).read_bytes() != deploy_file(n)]
    if differ:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "cli-init", "-",
                       "the shipped deploy files", f"differ: {differ}")
    # after the modes: the server's checks open the audit log it names
    rc, out = await _cli(sim, "cli-init-config", ["serve", "--config", str(config),
                                                  "--print-config"])
    if rc == 0 and "127.0.0.1:0" not in out:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "cli-init", "-",
                       "a config listening on loopback", out[:200])
    before = config.read_bytes()
    await _cli(sim, "cli-init-again", ["init", str(where)], expect=2)
    if config.read_bytes() != before:
        sim.ledger.add("lost", sim.combo.name, sim.step, "cli-init-again", "-",
                       "the config left as it was", "replaced")
    shutil.rmtree(where, ignore_errors=True)


async def drain(sim) -> None:
    """``kvtier drain`` of the live server, then SIGKILL and a start: a drained node
    holds nothing a crash can lose, so every version the model holds, memory-acked ones
    included, must restore after it."""
    peer = await peer_drain.start_peer(sim) if sim.combo.shared else None
    try:
        if peer is not None:
            await peer_drain.hostile_calls(sim, peer)
        rc, out = await _cli(sim, "cli-drain", ["drain", "--json", "--interval", "0.5",
                                                "--timeout", "120", *_server_args(sim)])
        last = json.loads(out) if rc == 0 and out.strip() else {}
        sim.log(f"step={sim.step} drain: {out.strip()[:300]}")
        if peer is not None and last.get("done"):
            await peer_drain.check_moved(sim, peer, last)
    finally:
        if peer is not None:
            await peer_drain.stop_peer(sim, peer)
    if rc == 0 and not (last.get("done") and last.get("writebackPending") == 0
                        and last.get("writebackFailed") == 0):
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "cli-drain", "-",
                       "done, nothing left to write back", out[:200])
    if rc != 0 or not last.get("done"):
        await lives.stop(sim, "term")  # as an operator would after a failed drain
        await lives.start(sim, "drain")
        return
    await _refused_while_drained(sim)
    for held in sim.model.values():
        held.drained()  # every acked version written back: a kill loses none
    await sim.end_life("kill")
    prefix.after_stop(sim, "term")
    for held in sim.model.values():
        for version in held.versions:
            version.window = None  # memory tiers only
        held.window_replayed = False
    await lives.start(sim, "drain")


async def _refused_while_drained(sim) -> None:
    """A fork on the drained server is refused UNAVAILABLE (a routed client would send it
    to another node), and creates nothing."""
    tenant = sim.tenants[0]
    sessions = _sure(sim, tenant)
    if not sessions:
        return
    held = sessions[0]
    options: dict = {"timeout_s": 20.0, "retry": RetryPolicy(attempts=1)}
    if sim.combo.tls:
        options.update(tls_ca=sim.creds.ca, token=sim.creds.tokens[tenant])
    new = sim.new_sid()
    async with AsyncClient(sim.node.target, **options) as kv:
        try:
            await kv.fork(tenant, held.sid, new, upto_tokens=len(held.current.tokens))
            got = "the fork made"
        except TierUnavailable as exc:
            got = "" if "draining" in str(exc) else f"UNAVAILABLE: {exc}"
        except KVTierError as exc:
            got = f"{type(exc).__name__}: {exc}"
    sim.log(f"step={sim.step} drained-fork {tenant}/{held.sid}: {got or 'refused'}")
    sim.deleted.add((tenant, new))  # never created: a restore of it must find nothing
    if got:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "drained-fork",
                       f"{tenant}/{held.sid}", "UNAVAILABLE: the node is draining", got[:200])


async def tokens_file(sim) -> None:
    """A tenant token added to the live tokens file, then revoked."""
    if not sim.combo.tls:
        sim.log(f"step={sim.step} tokens-file skipped: no TLS")
        return
    await _plaintext_audited(sim)
    issued = sim.issued
    if issued is None:  # certs writes the token and its tokens-file entry
        where = sim.root / f"tools-{sim.step}"
        rc, _ = await _cli(sim, "cli-certs", ["certs", str(where / "certs")])
        if rc != 0:
            return
        issued = sim.issued = where / "certs"
    token = (issued / "beta.token").read_text().strip()
    entry = _entry(issued / "tokens.toml", "beta")
    path = sim.creds.root / "tokens.toml"
    original = path.read_text()
    kv = AsyncClient(sim.node.target, tls_ca=sim.creds.ca, token=token, timeout_s=10.0)
    try:
        _replace(path, original + "\n" + entry)
        took = await _until(kv, accepted=True)
        sim.log(f"step={sim.step} tokens-file added: accepted after {took}")
        if took is None:
            sim.ledger.add("unexpected", sim.combo.name, sim.step, "tokens-file-add", "beta",
                           f"a token added to the tokens file works within {RELOAD_S} s",
                           "still refused")
        _replace(path, original)
        took = await _until(kv, accepted=False)
        sim.log(f"step={sim.step} tokens-file revoked: refused after {took}")
        if took is None:
            sim.ledger.add("wrong", sim.combo.name, sim.step, "tokens-file-revoke", "beta",
                           f"a revoked token refused within {RELOAD_S} s", "still accepted")
    finally:
        _replace(path, original)
        await kv.close()
    await sim.check_quota(sim.step, "beta", "tokens-file-still")  # the old token works


def _plaintext_attempt(target: str) -> tuple[str, bytes]:
    """A plaintext HTTP/2 preface sent to ``target``: (the address it came from, as gRPC
    names a peer; what the server answered before hanging up)."""
    host, _, port = target.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as raw:
        raw.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(9))
        answer = b""
        while chunk := raw.recv(64):
            answer += chunk
        return grpc_peer(raw.getsockname()), answer


def _plaintext_records(sim) -> list[dict]:
    path = sim.creds.root / "audit.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [event for line in lines if (event := json.loads(line))["kind"] == "plaintext"]


async def _plaintext_audited(sim) -> None:
    before = _plaintext_records(sim)
    started = time.time()
    peer, answer = await asyncio.to_thread(_plaintext_attempt, sim.node.target)
    new = _plaintext_records(sim)[len(before):]
    sim.log(f"step={sim.step} plaintext from {peer}: {len(new)} record(s)")
    if answer != PROTOCOL_VERSION_ALERT:
        sim.ledger.add("wrong", sim.combo.name, sim.step, "plaintext", peer,
                       "a TLS alert (protocol_version)", answer[:40].hex())
    host = peer.rpartition(":")[0]
    recent = [e for e in before if e["peer"].rpartition(":")[0] == host and started -
              datetime.datetime.fromisoformat(e["time"]).timestamp() < 60]
    if (new and (new[0]["peer"], new[0]["reason"].split(" (")[0]) == (
            peer, "plaintext on a TLS port")) or (not new and recent):
        return
    sim.ledger.add("wrong", sim.combo.name, sim.step, "plaintext-audit", peer,
                   "one record naming the peer and \"plaintext on a TLS port\" (or one of "
                   "this host under a minute old)", json.dumps(new)[:200])


def _entry(tokens_toml, tenant: str) -> str:
    """The ``[[token]]`` block of ``tenant``'s role-tenant token in a certs tokens file."""
    blocks = tokens_toml.read_text().split("[[token]]")
    for block in blocks[1:]:
        if f'tenant = "{tenant}"' in block and 'role = "tenant"' in block:
            return "[[token]]" + block.split("[[client_cert]]")[0]
    raise ValueError(f"no token of tenant {tenant} in {tokens_toml}")


def _replace(path, text: str) -> None:
    """Written whole and renamed in, as an operator's editor or tooling should."""
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(text)
    temp.chmod(0o600)
    os.replace(temp, path)


async def _until(kv: AsyncClient, *, accepted: bool) -> float | None:
    """Seconds until a List with the new token is accepted (or refused); None past
    ``RELOAD_S``."""
    started = time.monotonic()
    while time.monotonic() - started < RELOAD_S:
        try:
            await kv.list("beta")
            ok = True
        except KVTierError:
            ok = False
        if ok == accepted:
            return round(time.monotonic() - started, 2)
        await asyncio.sleep(0.2)
    return None


async def hung_node(sim) -> None:
    """Restores through a routed client while one of its two nodes is stopped."""
    if not sim.combo.shared:
        sim.log(f"step={sim.step} hung-node skipped: no shared metadata")
        return
    text = sim.config_path.read_text()
    data_b = sim.root / f"node-b-{sim.step}"
    text = re.sub(r'(?m)^data_dir = .*$', f'data_dir = "{data_b}"', text)
    text = re.sub(r'(?m)^node_id = "(.*)"$', r'node_id = "\1-b"', text)
    config_b = sim.root / "serve-b.toml"
    config_b.write_text(text)
    node_b = Node(config_b, sim.root / "server-b.log", {},
                  sim.creds if sim.combo.tls else None)
    if not await asyncio.to_thread(node_b.start):
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "hung-node", "-",
                       "a second fleet node starts", node_b.refusal)
        return
    kept = sim.clients
    try:
        sim.clients = {}
        for tenant in sim.tenants:
            options = {"timeout_s": ROUTED_TIMEOUT_S}
            if sim.combo.tls:
                options.update(tls_ca=sim.creds.ca, token=sim.creds.tokens[tenant])
            sim.clients[tenant] = AsyncClient(servers=[sim.node.target, node_b.target],
                                              **options)
        node_b.child.proc.send_signal(signal.SIGSTOP)
        sim.log(f"step={sim.step} hung-node: {node_b.target} stopped (SIGSTOP)")
        keys = sorted(sim.model)
        for key in sim.rng.sample(keys, min(ROUTED_CALLS, len(keys))):
            held = sim.model.get(key)
            if held is None:
                continue
            sim.step += 1
            started = time.monotonic()
            await sim.restore(sim.step, held, op="routed-restore")
            took = time.monotonic() - started
            if took > ROUTED_TIMEOUT_S + ROUTED_SLACK_S:
                sim.ledger.add("unexpected", sim.combo.name, sim.step, "routed-restore",
                               f"{held.tenant}/{held.sid}", f"within the {ROUTED_TIMEOUT_S} s "
                               "deadline (failed over from the stopped node)",
                               f"{took:.1f} s")
    finally:
        for client in sim.clients.values():
            await client.close()
        sim.clients = kept
        if node_b.alive():
            node_b.child.proc.send_signal(signal.SIGCONT)
        await asyncio.to_thread(node_b.stop)
        shutil.rmtree(data_b, ignore_errors=True)


async def remote_replay(sim) -> None:
    """The server restarted with a ``kvtier replay-worker`` as its replayer for the rest
    of the combination (``Simulation.replay_worker``): every later window rebuild is a
    Rebuild call; a few resumes now must replay there."""
    if sim.replay_worker is not None:
        sim.log(f"step={sim.step} remote-replay: already remote")
        return
    worker = Child([*CLI, "replay-worker", "--listen", "127.0.0.1:0", "--log-level",
                    "WARNING"], "kvtier replay-worker serving on ",
                   sim.root / "replay-worker.log", {})
    try:
        await asyncio.to_thread(worker.start)
    except RuntimeError as exc:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "replay-worker", "-",
                       "serving", str(exc))
        return
    STARTED.append(worker.proc)
    sim.replay_worker = worker
    await lives.stop(sim, "term")
    sim.config_path = sim.config()
    await lives.start(sim, "remote-replay")
    # windows went with the restart: a resume of a session of no stated model replays,
    # on the worker
    keys = sorted(k for k, h in sim.model.items() if not h.model
                  and len(h.current.tokens) and not h.may_be_absent(now()))
    for key in sim.rng.sample(keys, min(REMOTE_RESUMES, len(keys))):
        held = sim.model.get(key)
        if held is not None:
            sim.step += 1
            await sim.restore(sim.step, held, op="remote-resume",
                              replay=sim.rng.choice(("small", "128")))
    replays = sum(v for k, v in (await asyncio.to_thread(sim.node.metrics)).items()
                  if k.startswith("kvtier_replays_total"))
    sim.log(f"step={sim.step} remote-replay: {replays:.0f} windows rebuilt remotely")
    if keys and not replays:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "remote-replay", "-",
                       "resumes rebuilt by the replay worker (Rebuild)", "no replay")


EVENTS = {"cli-tools": cli_tools, "tokens-file": tokens_file, "hung-node": hung_node,
          "remote-replay": remote_replay, "drain": drain}

