"""Layouts at run time: what a server serves besides the shipped presets.

- ``layouts`` in the config: canonical layout JSON inline, or paths of files holding one
  layout object or a JSON list of them, loaded at start (a bad one stops the start);
- ``RegisterLayout``: a layout a client sends, checked hard (``check_bounds``: nothing in
  it may make the server allocate without bound; ``check_replayer``: a layout naming a
  replayer whose model runs here is that model's cache exactly, else ``LayoutMismatch``),
  idempotent for the same layout (same id and replayer), refused for a known name of
  another shape; kept in ``{data_dir}/layouts.json`` (written atomically), so it is
  served again after a restart. Who may register is ``register_layouts``: ``admin``
  (admin credentials only), ``any`` (any caller the server lets in), ``none``; ``auto``
  (the default) is ``admin`` when the server authenticates and ``any`` when it does not
  (a server without identities has no admins). Every registration is logged and, with
  an audit log, audited (kind ``layout``).

Layouts live in the process's registry (``kvstore.format.registry.register_layout``), which the
store resolves session layouts from. With shared metadata a registration also goes to
the fleet's bucket (``kvstore.fleet.shared_layouts``; a name registered there by another
node as another layout is refused), and a node that meets a layout id it does not know
(Spill, Lookup, Restore, Resume, Fork: ``resolve``) or lists layouts (``sync``) loads it
from there, checked as RegisterLayout checks one and kept like one.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstore.fleet.shared_layouts import BucketLayouts
from kvstore.format.errors import (
    InvalidRequest,
    LayoutMismatch,
    PermissionDenied,
    TierFull,
    TierUnavailable,
    UnknownLayout,
)
from kvstore.format.layout import (
    NAME,
    LayoutSpec,
    cache_difference,
    layout_from_json,
    layout_to_json,
)
from kvstore.format.layout_bounds import MAX_JSON_BYTES, check_bounds, parse_layout
from kvstore.format.presets import SHIPPED
from kvstore.format.registry import all_layouts, get_layout, register_layout
from kvstore.tiers.base import MetaStore
from kvstore.tiers.disk.headroom import DEFAULT_RESERVE_BYTES, PAGE_BYTES, check_room

log = logging.getLogger(__name__)
FILE_NAME = "layouts.json"
MAX_REGISTERED = 256  # layouts registered at run time, all callers together
# Their canonical JSON together: what the registry, layouts.json (rewritten whole on each
# registration) and a ListLayouts reply (encoded on the event loop) hold; the count
# alone would let that grow with the size of each layout.
MAX_REGISTERED_BYTES = 4 << 20


def check_replayer(spec: LayoutSpec, owns: Sequence[LayoutSpec] | None) -> None:
    """LayoutMismatch when ``spec`` names a replayer and is not the cache of the model
    ``owns`` describes (one layout per way it may store that model's cache), that
    replayer's here (``cache_difference``): a replay of it would feed the model token
    ids past its vocabulary, or rebuild a window of another size. ``owns`` None: the
    model runs elsewhere (remote workers), which checks every layout it is sent."""
    if not owns:
        return
    differs = [cache_difference(spec, own) for own in owns]
    if None not in differs:
        theirs = ", ".join(own.layout_id for own in owns)
        raise LayoutMismatch(f"layout {spec.name} names replayer {spec.replayer!r} but is "
                             f"not the cache of its model here ({theirs}): {differs[0]}")


def _specs_in(text: str, where: str) -> list[LayoutSpec]:
    """One layout object or a JSON list of them."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{where}: not JSON: {exc}") from exc
    items = value if isinstance(value, list) else [value]
    try:
        return [layout_from_json(json.dumps(item)) for item in items]
    except InvalidRequest as exc:
        raise InvalidRequest(f"{where}: {exc}") from exc


def _configured(entry: str) -> list[LayoutSpec]:
    entry = entry.strip()
    if entry.startswith(("{", "[")):
        return _specs_in(entry, "config layouts (inline)")
    try:
        text = Path(entry).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequest(f"config layouts: cannot read {entry}: {exc.strerror}") from exc
    return _specs_in(text, f"config layouts ({entry})")


class ServerLayouts:
    """The configured and registered layouts of one server, put in the process's registry."""

    def __init__(self, entries: tuple[str, ...], data_dir: Path, policy: str,
                 max_message_bytes: int, shared: BucketLayouts | None = None,
                 replayer_model: Callable[[str], Sequence[LayoutSpec] | None] = (
                     lambda _: None)) -> None:
        """``shared``: the fleet's layouts (metadata = "shared", ``fleet_layouts``);
        ``replayer_model``: the caches of a replayer's model where this server runs it
        (``services.server.replay_backend.model_layouts``), None where it does not."""
        self.policy = policy
        self.replayer_model = replayer_model
        self.max_message_bytes = max_message_bytes
        self.shared = shared
        self.path = Path(data_dir) / FILE_NAME
        self.registered: dict[str, LayoutSpec] = {}  # name -> spec, as stored in the file
        self.registered_bytes = 0  # their canonical JSON, all together
        self._lock = asyncio.Lock()
        for entry in entries:
            for spec in _configured(entry):
                self._add(spec, "config layouts", self.check_replayer)
        # Registered before: kept as stored (their replays are refused by the replayer
        # itself, LayoutMismatch, when a layout is not its model's cache).
        for spec in self._stored():
            self.registered[spec.name] = self._add(spec, str(self.path))
            self.registered_bytes += len(layout_to_json(spec))

    def _add(self, spec: LayoutSpec, where: str, *checks) -> LayoutSpec:
        try:
            check_bounds(spec, self.max_message_bytes)
            for check in checks:
                check(spec)
            return register_layout(spec)
        except InvalidRequest as exc:  # of its class (LayoutMismatch stays one)
            raise type(exc)(f"{where}: {exc}") from exc

    def _stored(self) -> list[LayoutSpec]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise InvalidRequest(f"cannot read {self.path}: {exc.strerror}") from exc
        return _specs_in(text, str(self.path))

    def check_replayer(self, spec: LayoutSpec) -> None:
        """``check_replayer`` against this server's model of ``spec``'s replayer."""
        if spec.replayer != "none":
            check_replayer(spec, self.replayer_model(spec.replayer))

    def check_caller(self, role: str | None) -> None:
        """PermissionDenied unless a caller of ``role`` (None: not authenticated) may
        register layouts here."""
        if self.policy == "none":
            raise PermissionDenied("this server does not register layouts "
                                   "(register_layouts = 'none'): list them in its config")
        if self.policy == "admin" and role != "admin":
            raise PermissionDenied("this server registers layouts for admin credentials "
                                   "only (register_layouts = 'admin')")

    async def register(self, text: str) -> tuple[LayoutSpec, bool]:
        """(the layout, whether it was new: to the fleet, with shared metadata) for a
        RegisterLayout's JSON."""
        spec = parse_layout(text, self.max_message_bytes)
        self.check_replayer(spec)
        async with self._lock:
            known = {s.name: s for s in all_layouts()}.get(spec.name)
            if known is not None:
                same = register_layout(spec)  # the same one, or InvalidRequest
                if self.shared is not None and spec.name in self.registered:
                    await self._share(spec)  # one this node holds from before the bucket
                return same, False
            self._check_room(spec)
            created = await self._share(spec) if self.shared is not None else True
            await self._store(spec)
        log.info("layout %s registered (replayer %s)", spec.layout_id, spec.replayer)
        return spec, created

    def _check_room(self, spec: LayoutSpec) -> None:
        if len(self.registered) >= MAX_REGISTERED:
            raise TierFull(f"this server holds {MAX_REGISTERED} registered layouts, "
                           "the most it keeps")
        if self.registered_bytes + len(layout_to_json(spec)) > MAX_REGISTERED_BYTES:
            raise TierFull(f"the registered layouts' JSON would pass "
                           f"{MAX_REGISTERED_BYTES} bytes, the most this server keeps")

    async def _store(self, spec: LayoutSpec) -> None:
        """Into layouts.json, then the registry (under the lock, room checked)."""
        try:
            await asyncio.to_thread(_write_atomically, self.path,
                                    [*self.registered.values(), spec])
        except OSError as exc:  # no server path in what the client sees
            log.error("cannot store layout %s in %s: %s", spec.layout_id, self.path, exc)
            error = TierFull if exc.errno in (errno.ENOSPC, errno.EDQUOT) else TierUnavailable
            raise error(f"cannot store layout {spec.layout_id} on this server's disk: "
                        f"{exc.strerror}") from exc
        self.registered[spec.name] = register_layout(spec)
        self.registered_bytes += len(layout_to_json(spec))

    # -- the fleet's layouts in the bucket (kvstore.fleet.shared_layouts) --

    async def share_registered(self) -> None:
        """Put every layout registered here in the fleet's bucket (a migration brings its
        directory's along); InvalidRequest, before any is put, when the bucket holds
        another layout under one of their names."""
        clashes = []
        assert self.shared is not None  # a fleet's registry (callers check)
        for spec in self.registered.values():
            body = await self.shared.get(spec.name)
            if body is not None and body != layout_to_json(spec).encode():
                clashes.append(spec.name)
        if clashes:
            raise InvalidRequest(f"the fleet's bucket holds other layouts named {clashes}; "
                                 "rename them in this directory's layouts.json first")
        for spec in self.registered.values():
            await self._share(spec)

    async def _share(self, spec: LayoutSpec) -> bool:
        """Put ``spec`` in the fleet's bucket; whether it was new there. InvalidRequest
        when another node registered another layout under its name, as a local
        registration refuses it."""
        body = layout_to_json(spec).encode()
        assert self.shared is not None  # a fleet's registry (callers check)
        theirs = await self.shared.put_new(spec.name, body)
        if theirs is None or theirs == body:
            return theirs is None
        other = self._parse_shared(spec.name, theirs)
        if other is None:
            raise InvalidRequest(f"layout name {spec.name!r} is taken in this fleet's bucket "
                                 "by an object that is not a layout")
        if other.layout_hash != spec.layout_hash:
            raise InvalidRequest(f"layout name {spec.name!r} is already registered in this "
                                 f"fleet as {other.layout_id}, with another shape")
        raise InvalidRequest(f"layout {other.layout_id} is already registered in this fleet "
                             f"with replayer {other.replayer!r}, not {spec.replayer!r}")

    def _parse_shared(self, name: str, body: bytes) -> LayoutSpec | None:
        """The layout a bucket object holds, checked as RegisterLayout checks one (None,
        logged, when it is not one, or not the one its name says)."""
        try:
            spec = parse_layout(body.decode("utf-8"), self.max_message_bytes)
        except (InvalidRequest, UnicodeDecodeError) as exc:
            log.error("fleet layout object %s is not a layout: %s", name, exc)
            return None
        if spec.name != name:
            log.error("fleet layout object %s holds layout %s", name, spec.layout_id)
            return None
        return spec

    async def resolve(self, layout_id: str) -> bool:
        """Load ``layout_id`` from the fleet's bucket when this node has not met it (another
        node registered it); whether it did. Nothing to do for a known layout or with
        local metadata: the caller's lookup answers UnknownLayout for one nobody has."""
        name = layout_id.partition("@")[0]
        if self.shared is None or _known(layout_id) or not NAME.match(name):
            return False
        async with self._lock:
            if _known(layout_id):  # loaded meanwhile
                return False
            spec = await self._fetch(name)
            if spec is None or spec.layout_id != layout_id:
                return False
            await self._admit(spec)
        return True

    async def sync(self) -> None:
        """Load every layout of the fleet's bucket this node has not met (ListLayouts).
        An unreachable bucket leaves the node's own list."""
        if self.shared is None:
            return
        try:
            names = await self.shared.names()
            async with self._lock:
                known = {spec.name for spec in all_layouts()}
                for name in names:
                    if name not in known and NAME.match(name):
                        spec = await self._fetch(name)
                        if spec is not None:
                            await self._admit(spec)
        except (TierUnavailable, TierFull) as exc:
            log.warning("fleet layouts not listed: %s", exc)

    async def _fetch(self, name: str) -> LayoutSpec | None:
        assert self.shared is not None  # a fleet's registry (callers check)
        body = await self.shared.get(name)
        return None if body is None else self._parse_shared(name, body)

    async def _admit(self, spec: LayoutSpec) -> None:
        """A layout from the bucket, kept as a registered one (layouts.json too)."""
        self._check_room(spec)
        await self._store(spec)
        log.info("layout %s loaded from the fleet's bucket", spec.layout_id)


def fleet_layouts(meta: MetaStore) -> BucketLayouts | None:
    """The fleet's layouts in the bucket, when ``meta`` is shared metadata."""
    from kvstore.fleet.shared_meta import SharedMetaStore

    if not isinstance(meta, SharedMetaStore):
        return None
    return BucketLayouts(meta.io, meta.paths.root, max_bytes=MAX_JSON_BYTES,
                         max_names=MAX_REGISTERED)


def _known(layout_id: str) -> bool:
    try:
        get_layout(layout_id)
    except UnknownLayout:
        return False
    return True


def _write_atomically(path: Path, specs: list[LayoutSpec]) -> None:
    """The file is either the old list or the new one, whatever happens meanwhile;
    ``TierFull`` when writing it would eat into the medium's reserve."""
    body = "[\n" + ",\n".join(layout_to_json(s) for s in specs) + "\n]\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    # the data directory's medium keeps the disk tier's reserve (its deletes need it)
    check_room(path.parent, len(body) + PAGE_BYTES, DEFAULT_RESERVE_BYTES)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(body)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def is_builtin(spec: LayoutSpec) -> bool:
    return any(spec.name == shipped.name for shipped in SHIPPED)
