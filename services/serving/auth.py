"""Who is calling, and what they may do (README "Security").

Authentication: a bearer token in the ``authorization`` metadata (``Bearer <token>``),
found by its SHA-256 in the tokens file or checked as a JWT (``exp`` and ``aud`` checked;
the ``tenant`` and ``role`` claims read); without one, a client certificate (mTLS) whose
subject CN a ``[[client_cert]]`` entry of the tokens file maps. The tokens file (TOML)::

    [[token]]
    sha256 = "<hex sha256 of the token>"
    tenant = "acme"
    role = "tenant"          # tenant | admin | replay | peer

    [[client_cert]]
    cn = "acme-worker-1"
    tenant = "acme"
    role = "tenant"

is read again, and its content hash compared, at most once per second on a call, and at
once on a reload (SIGHUP, ``kvtier reload``). An edit that does not parse is refused with
a warning (the parser's line and column) and the last good version stays in force; a
file removed or unreadable grants nothing until it is back (``TokenFile``).

Authorization: ``METHOD_ROLES`` says which roles may call each method; the tenant a
request names must be the caller's (``check_tenant``, ``list_scope``) unless the caller
is an admin. ``AuthInterceptor`` does both for every call of the services it guards (the
health service stays open), sets the caller for the handlers (``caller()``: a context
variable, each RPC running in its own task), and writes the audit (``services.serving.audit``).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import logging
import os
import re
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvstore.format.errors import InvalidRequest, PermissionDenied, Unauthenticated
from services.serving.audit import AuditLog
from services.serving.errors import RecordsCalls, abort
from services.serving.interceptors import scoped

log = logging.getLogger(__name__)
TENANT, ADMIN, REPLAY, PEER = "tenant", "admin", "replay", "peer"
ROLES = (TENANT, ADMIN, REPLAY, PEER)
RELOAD_CHECK_S = 1.0
_TENANT_ID = re.compile(r"^[a-z0-9_-]{1,64}$")  # as services.server.validate.TENANT
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_JWT_SHAPE = re.compile(r"^[\w-]+\.[\w-]+\.[\w-]*$")

_KVTIER = "/kvtier.v1.KVTier/"
_DATA = frozenset({TENANT})  # the KV bytes themselves: the tenant's own only
_CONTROL = frozenset({TENANT, ADMIN})  # admin: every tenant (listing, stats, compaction)
METHOD_ROLES: dict[str, frozenset[str]] = {
    **{_KVTIER + m: _DATA for m in ("Spill", "Restore", "Resume", "LeaseSegment",
                                    "ReleaseSegments", "Lookup", "Fork", "WriteChunks",
                                    "ReadChunks")},
    **{_KVTIER + m: _CONTROL for m in ("Prefetch", "Evict", "Delete", "Stat", "List",
                                       "ListLayouts")},
    # who of these may register: the server's register_layouts (services.server.layout_registry)
    _KVTIER + "RegisterLayout": _CONTROL,
    _KVTIER + "Drain": frozenset({ADMIN}),  # the node's, not a tenant's, to stop
    # another fleet node's window, handed over while it drains: nodes only (the tenant is
    # the stored manifest's, checked by the receiver; services.server.peers)
    _KVTIER + "AdoptWindow": frozenset({PEER}),
    "/kvtier.v1.Replay/Rebuild": frozenset({REPLAY}),
}


@dataclass(frozen=True)
class Identity:
    tenant: str
    role: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequest(f"role must be one of {ROLES}, got {self.role!r}")
        if self.role == TENANT and not _TENANT_ID.match(self.tenant):
            raise InvalidRequest(f"a tenant credential needs a tenant id matching "
                                 f"{_TENANT_ID.pattern}, got {self.tenant!r}")


_CALLER: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("kvtier_caller",
                                                                          default=None)
# The tenant the running call asked for, as far as known (the audit's ``target``).
_TARGET: contextvars.ContextVar[str] = contextvars.ContextVar("kvtier_target", default="")


def caller() -> Identity | None:
    """The authenticated caller of the RPC running now; None when the server does not
    authenticate (tenants are then what requests name)."""
    return _CALLER.get()


# The abstract unix name the TLS front (``services.serving.tls_front``) binds its end of a
# relayed connection to: kvtier-peer/<token>/<the client's address>.
RELAYED_PEER_PREFIX = "kvtier-peer/"
_RELAYED = f"unix-abstract:{RELAYED_PEER_PREFIX}"


def client_peer(context: grpc.aio.ServicerContext) -> str:
    """The caller's address: ``context.peer()``, or on a connection the TLS front relayed,
    the address the client reached the front from (only this server's user can reach
    gRPC's private socket, so the name is the front's)."""
    seen = context.peer()
    if seen.startswith(_RELAYED):
        return seen[len(_RELAYED):].partition("/")[2]
    return seen


def target_of(request: object) -> str:
    """The tenant a unary request names (``tenant``, or its session ``ref``'s); "" for a
    stream, whose first message the handler reads (``check_tenant`` then records it)."""
    tenant = getattr(request, "tenant", None)
    if isinstance(tenant, str):
        return tenant
    ref = getattr(request, "ref", None)
    return ref.tenant if ref is not None and isinstance(getattr(ref, "tenant", None), str) else ""


def check_tenant(tenant: str) -> None:
    """PermissionDenied unless the caller may use ``tenant``'s sessions."""
    _TARGET.set(tenant)  # the audit names it (AuthInterceptor)
    identity = _CALLER.get()
    if identity is not None and identity.role != ADMIN and tenant != identity.tenant:
        raise PermissionDenied(f"this credential is tenant {identity.tenant!r}'s: it may not "
                               f"use tenant {tenant!r}'s sessions")


def list_scope(tenant: str | None) -> str | None:
    """The tenant a List covers: a tenant's own (also for an empty filter); for an admin,
    or without authentication, what was asked (None: every tenant)."""
    identity = _CALLER.get()
    if identity is None or identity.role == ADMIN:
        return tenant
    check_tenant(tenant or identity.tenant)
    return identity.tenant


def token_id(token: str) -> str:
    """How logs and the audit name a token: a prefix of its SHA-256, never the token."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


class TokenFile:
    """The tokens file: token digests and certificate CNs -> identities, kept current.

    At most once per ``RELOAD_CHECK_S``, on a call, the file is read whole and its
    SHA-256 compared with the last one read: any edit is seen, whatever it does to the
    size or the modification time. An edit that does not parse keeps the last good table
    in force, as Prometheus and Redis ACL LOAD do, with a warning once per state: one
    typo does not lock every tenant out. A file removed or unreadable fails closed (no
    token or certificate of it is accepted until it is readable again): removing it
    revokes everything. Write it atomically (a new file renamed over the old) so no call
    sees half an edit. At start-up (and on a reload) a bad file is an error.
    """

    def __init__(self, path: str | os.PathLike,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._clock = clock
        self._tokens: list[tuple[bytes, Identity]] = []
        self._certs: dict[str, Identity] = {}
        self._digest: bytes | None = None  # of the content last read, good or bad
        self._problem: str | None = None  # why the file is refused now
        self._checked = clock()
        try:
            self._load(self.path.read_bytes())
        except (OSError, ValueError, tomllib.TOMLDecodeError) as exc:
            raise InvalidRequest(f"auth_tokens_file {self.path}: {exc}") from exc

    def _load(self, content: bytes) -> None:
        self._digest = hashlib.sha256(content).digest()
        table = tomllib.loads(content.decode("utf-8"))
        tokens, certs = [], {}
        for i, entry in enumerate(table.get("token", [])):
            digest = str(entry.get("sha256", "")).lower()
            if not _SHA256_HEX.match(digest):
                raise ValueError(f"token #{i + 1}: sha256 must be 64 hex digits")
            tokens.append((bytes.fromhex(digest), _identity(entry, f"token #{i + 1}")))
        for i, entry in enumerate(table.get("client_cert", [])):
            if not entry.get("cn"):
                raise ValueError(f"client_cert #{i + 1}: cn is required")
            certs[str(entry["cn"])] = _identity(entry, f"client_cert #{i + 1}")
        unknown = set(table) - {"token", "client_cert"}
        if unknown:
            raise ValueError(f"unknown tables {sorted(unknown)}; known: token, client_cert")
        self._tokens, self._certs = tokens, certs

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        try:
            content = self.path.read_bytes()
        except OSError as exc:
            self._tokens, self._certs = [], {}
            self._refuse(f"cannot be read ({exc.strerror}): every token and client "
                         "certificate of it is refused until it is readable again")
            self._digest = None
            return
        if hashlib.sha256(content).digest() == self._digest:
            return
        try:
            self._load(content)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            # The parser's messages name a line and column, never the file's text.
            self._refuse(f"does not parse ({exc}): the last good version stays in force "
                         f"({len(self._tokens)} tokens, {len(self._certs)} client "
                         "certificates)")
            return
        self._problem = None
        log.info("auth_tokens_file %s reloaded: %d tokens, %d client certificates",
                 self.path, len(self._tokens), len(self._certs))

    def _refuse(self, problem: str) -> None:
        if problem != self._problem:
            log.warning("auth_tokens_file %s %s", self.path, problem)
        self._problem = problem

    def token(self, token: str) -> Identity | None:
        self._refresh()
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for known, identity in self._tokens:  # every entry compared: constant time
            if hmac.compare_digest(known, digest):
                found = identity
        return found

    def certificate(self, cn: str) -> Identity | None:
        self._refresh()
        return self._certs.get(cn)


def _identity(entry: dict, where: str) -> Identity:
    try:
        return Identity(str(entry.get("tenant", "")), str(entry.get("role", TENANT)))
    except InvalidRequest as exc:
        raise ValueError(f"{where}: {exc}") from exc


class JwtKey:
    """JWTs signed with a shared secret (HS*) or a public key (RS*, PS*, ES*, EdDSA)."""

    ASYMMETRIC = ["RS256", "RS384", "RS512", "PS256", "ES256", "ES384", "EdDSA"]
    SHARED = ["HS256", "HS384", "HS512"]

    def __init__(self, setting: str, audience: str = "") -> None:
        path = Path(setting)
        text = path.read_text().strip() if path.is_file() else setting
        self.algorithms = self.ASYMMETRIC if text.startswith("-----BEGIN") else self.SHARED
        self.key = text
        self.audience = audience or None

    def identity(self, token: str) -> Identity | None:
        import jwt  # only servers that check JWTs pay for it

        required = ["exp", "aud"] if self.audience else ["exp"]
        try:
            claims = jwt.decode(token, self.key, algorithms=self.algorithms,
                                audience=self.audience, options={"require": required})
        except jwt.ExpiredSignatureError as exc:
            raise Unauthenticated(f"the JWT {token_id(token)} has expired") from exc
        except jwt.InvalidTokenError:
            return None
        try:
            return Identity(str(claims.get("tenant", "")), str(claims.get("role", TENANT)))
        except InvalidRequest as exc:
            raise Unauthenticated(f"the JWT {token_id(token)} names no valid identity: "
                                  f"{exc}") from exc


class Authenticator:
    def __init__(self, tokens: TokenFile | None, jwt_key: JwtKey | None) -> None:
        self.tokens = tokens
        self.jwt_key = jwt_key

    @classmethod
    def from_settings(cls, tokens_file: str, jwt_key: str, jwt_audience: str
                      ) -> Authenticator | None:
        """None when neither is set: requests then name their tenant."""
        if not tokens_file and not jwt_key:
            return None
        return cls(TokenFile(tokens_file) if tokens_file else None,
                   JwtKey(jwt_key, jwt_audience) if jwt_key else None)

    def identify(self, metadata: Iterable[tuple[str, str | bytes]],
                 auth_context: Mapping[str, Iterable[bytes]]) -> Identity:
        header = next((v for k, v in metadata if k == "authorization"), None)
        if header is not None:
            scheme, _, token = str(header).partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token:
                raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
            identity = self._token(token)
            if identity is None:
                raise Unauthenticated(f"unknown credential (token {token_id(token)})")
            return identity
        names = list(auth_context.get("x509_common_name") or [])
        if names:
            cn = names[0].decode(errors="replace")
            identity = self.tokens.certificate(cn) if self.tokens is not None else None
            if identity is None:
                raise Unauthenticated(f"client certificate CN={cn!r} names no identity "
                                      "(no [[client_cert]] entry for it)")
            return identity
        raise Unauthenticated("this server needs a credential: authorization: Bearer <token>, "
                              "or a client certificate")

    def _token(self, token: str) -> Identity | None:
        identity = self.tokens.token(token) if self.tokens is not None else None
        if identity is None and self.jwt_key is not None and _JWT_SHAPE.match(token):
            identity = self.jwt_key.identity(token)
        return identity


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates, authorizes by role and audits every call of the ``METHOD_ROLES``
    methods; ``authenticator`` None: every caller is anonymous (audit only). A call it
    refuses never reaches the servicer: ``recorder`` (the kvtier servicer) counts it by
    method and code, as the servicer counts its own."""

    def __init__(self, authenticator: Authenticator | None, audit: AuditLog,
                 recorder: RecordsCalls | None = None) -> None:
        self.authenticator = authenticator
        self.audit = audit
        self.recorder = recorder

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        roles = METHOD_ROLES.get(details.method)
        if handler is None or roles is None:
            return handler  # health checking (and reflection, when configured) stay open
        return scoped(handler, _Guard(self, details.method, roles).call)


class _Guard:
    """One call's checks: ``enter`` before the handler runs, ``leave`` after it."""

    def __init__(self, interceptor: AuthInterceptor, method: str, roles: frozenset[str]):
        self.authenticator = interceptor.authenticator
        self.audit = interceptor.audit
        self.recorder = interceptor.recorder
        self.method = method
        self.name = method.rpartition("/")[2]
        self.roles = roles

    async def enter(self, context: grpc.aio.ServicerContext, request: object
                    ) -> Identity | None:
        _TARGET.set(target_of(request))
        if self.authenticator is None:
            return None
        try:
            identity = self.authenticator.identify(context.invocation_metadata() or (),
                                                   context.auth_context())
            if identity.role not in self.roles:
                raise PermissionDenied(f"role {identity.role!r} may not call {self.name}")
        except (Unauthenticated, PermissionDenied) as exc:
            kind = "auth_failure" if isinstance(exc, Unauthenticated) else "permission_denied"
            who = identity if isinstance(exc, PermissionDenied) else None
            self.audit.record(kind, who, self.name, client_peer(context),
                              "UNAUTHENTICATED" if who is None else "PERMISSION_DENIED",
                              str(exc), target=target_of(request))
            await abort(context, exc, self.recorder, self.name)
        _CALLER.set(identity)
        return identity

    @contextlib.asynccontextmanager
    async def call(self, request: object, context: grpc.aio.ServicerContext
                   ) -> AsyncIterator[None]:
        identity = await self.enter(context, request)
        error = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.leave(context, identity, error)

    def leave(self, context: grpc.aio.ServicerContext, identity: Identity | None,
              error: BaseException | None) -> None:
        code = context.code()
        result = code.name if code is not None else ("OK" if error is None else "CANCELLED")
        if result == "PERMISSION_DENIED":
            kind = "permission_denied"
        elif self.name == "RegisterLayout":
            return  # the servicer audits it, naming the layout (kind "layout")
        elif self.name == "Delete":
            kind = "delete"
        elif identity is not None and identity.role == ADMIN:
            kind = "admin"
        else:
            return
        self.audit.record(kind, identity, self.name, client_peer(context), result,
                          target=_TARGET.get())
