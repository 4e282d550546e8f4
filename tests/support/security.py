"""Certificates, tokens and servers for the security tests: a development set written by
``services.server.devcerts`` into a temporary directory (plus a second, foreign CA), and a
real loopback server that serves TLS and checks the set's tokens."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from kvtier import AsyncClient, RetryPolicy
from services.server.devcerts import DEV_CLIENT_CN, issue, make_ca, write_dev_set
from services.server.server import KVTierServer
from tests.support.service import LAYOUT, running_server, streams_for, tokens_for

NO_RETRY = RetryPolicy(attempts=1)
JWT_SECRET = "a-shared-secret-of-the-tests-32-bytes!"
TOKENS = LAYOUT.chunk_tokens + 20


@dataclass(frozen=True)
class DevSet:
    root: Path
    tokens: dict[str, str]  # name (admin, acme, beta, replay) -> token

    def path(self, name: str) -> str:
        return str(self.root / name)

    @property
    def ca(self) -> str:
        return self.path("ca.pem")

    def server_tls(self, **extra) -> dict[str, str]:
        return {"tls_cert": self.path("server.pem"), "tls_key": self.path("server-key.pem"),
                **extra}

    def secured(self, **extra) -> dict[str, str]:
        """Server overrides: TLS, the tokens file, an audit log."""
        return self.server_tls(auth_tokens_file=self.path("tokens.toml"),
                               audit_log=self.path("audit.jsonl"), **extra)

    def client(self, target: str, name: str | None = None, **options) -> AsyncClient:
        options.setdefault("token", self.tokens[name] if name else None)
        return AsyncClient(target, tls_ca=self.ca, retry=NO_RETRY, **options)

    def audit_lines(self) -> list[str]:
        path = self.root / "audit.jsonl"
        return path.read_text().splitlines() if path.exists() else []


def dev_set(tmp_path: Path) -> DevSet:
    root = tmp_path / "certs"
    tokens = write_dev_set(root)
    foreign = make_ca("someone else's CA")
    stranger = issue(foreign, DEV_CLIENT_CN)  # the mapped CN, from the wrong CA
    (root / "stranger.pem").write_bytes(stranger.cert_pem)
    (root / "stranger-key.pem").write_bytes(stranger.key_pem)
    return DevSet(root, tokens)


def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir(exist_ok=True)
    return path


@contextlib.asynccontextmanager
async def secured_server(tmp_path: Path, certs: DevSet, **extra
                         ) -> AsyncIterator[tuple[KVTierServer, str]]:
    async with running_server(data_dir(tmp_path), **certs.secured(**extra)) as running:
        yield running


async def spill_one(kv: AsyncClient, tenant: str, session_id: str, seed: int = 0):
    tokens = tokens_for(TOKENS, seed)
    return await kv.spill(tenant, session_id, LAYOUT.name, tokens,
                          streams_for(LAYOUT, TOKENS, seed=seed), generation=1)


def jwt_for(claims: dict, key: str = JWT_SECRET, algorithm: str = "HS256",
            lifetime_s: float = 300) -> str:
    import jwt

    return jwt.encode({"exp": int(time.time() + lifetime_s), **claims}, key,
                      algorithm=algorithm)
