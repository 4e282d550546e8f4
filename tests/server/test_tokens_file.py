"""The tokens file while serving, over real gRPC with TLS: it fails closed when deleted or
unreadable (no token of it is accepted), a malformed edit keeps the last good version in
force (the server logs why, naming no token), and any edit is seen within the reload
interval, whatever it does to the file's size and modification time."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from kvtier import Unauthenticated
from services.server.devcerts import token_digest
from services.serving import auth
from tests.support.security import DevSet, dev_set, secured_server

INTERVAL_S = auth.RELOAD_CHECK_S * 1.2  # past the reload interval, with a margin


async def _accepted(certs: DevSet, target: str, name: str | None = None,
                    token: str | None = None) -> bool:
    async with certs.client(target, name, **({"token": token} if token else {})) as kv:
        try:
            await kv.list()
        except Unauthenticated:
            return False
    return True


def _no_secret_logged(caplog, certs: DevSet, *tokens: str) -> None:
    for token in (*certs.tokens.values(), *tokens):
        assert token not in caplog.text
        assert token_digest(token) not in caplog.text


async def test_a_deleted_tokens_file_revokes_every_token(tmp_path, caplog):
    certs = dev_set(tmp_path)
    tokens_file = certs.root / "tokens.toml"
    kept = tokens_file.read_bytes()
    async with secured_server(tmp_path, certs) as (_, target):
        assert await _accepted(certs, target, "acme")
        assert await _accepted(certs, target, "admin")
        with caplog.at_level(logging.WARNING, logger=auth.__name__):
            tokens_file.unlink()
            await asyncio.sleep(INTERVAL_S)
            for name in ("acme", "admin", "beta"):
                assert not await _accepted(certs, target, name), name
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                    and r.name == auth.__name__]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once, not per call
        assert "cannot be read" in warnings[0].getMessage()
        assert "refused" in warnings[0].getMessage()
        # Back again: the table it holds is served again.
        tokens_file.write_bytes(kept)
        await asyncio.sleep(INTERVAL_S)
        assert await _accepted(certs, target, "acme")
    _no_secret_logged(caplog, certs)


async def test_an_edit_of_the_same_size_and_mtime_is_seen(tmp_path):
    certs = dev_set(tmp_path)
    tokens_file = certs.root / "tokens.toml"
    newcomer = "n" * len(certs.tokens["acme"])  # a digest is as long whatever the token
    async with secured_server(tmp_path, certs) as (_, target):
        assert await _accepted(certs, target, "acme")
        assert not await _accepted(certs, target, token=newcomer)
        before = tokens_file.stat()
        text = tokens_file.read_text()
        edited = text.replace(token_digest(certs.tokens["acme"]), token_digest(newcomer))
        assert edited != text and len(edited) == len(text)
        with open(tokens_file, "r+", encoding="utf-8") as handle:  # in place: same inode
            handle.write(edited)
        os.utime(tokens_file, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = tokens_file.stat()
        assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
            before.st_size, before.st_mtime_ns, before.st_ino)
        await asyncio.sleep(INTERVAL_S)
        assert not await _accepted(certs, target, "acme")  # revoked by the edit
        assert await _accepted(certs, target, token=newcomer)
        assert await _accepted(certs, target, "admin")  # the rest of the table stays


@pytest.mark.parametrize("content", ["[[token]\nbroken", '[[token]]\nsha256 = "abc"\n',
                                     "[[tokens]]\n", "\xff\xfe"])
async def test_a_malformed_edit_keeps_the_last_good_tokens(tmp_path, caplog, content):
    certs = dev_set(tmp_path)
    tokens_file = certs.root / "tokens.toml"
    good = tokens_file.read_text()
    async with secured_server(tmp_path, certs) as (_, target):
        assert await _accepted(certs, target, "acme")
        with caplog.at_level(logging.WARNING, logger=auth.__name__):
            Path(tokens_file).write_bytes(content.encode("latin-1"))
            await asyncio.sleep(INTERVAL_S)
            assert await _accepted(certs, target, "acme")  # one typo locks no one out
            assert await _accepted(certs, target, "admin")
        assert "does not parse" in caplog.text and "last good version" in caplog.text
        # fixed, and beta revoked by the fix: the good edit is taken
        tokens_file.write_text(good.replace(token_digest(certs.tokens["beta"]), "0" * 64))
        await asyncio.sleep(INTERVAL_S)
        assert await _accepted(certs, target, "acme")
        assert not await _accepted(certs, target, "beta")
    _no_secret_logged(caplog, certs)


async def test_a_client_certificate_is_refused_while_the_file_is_gone(tmp_path):
    certs = dev_set(tmp_path)
    tokens_file = certs.root / "tokens.toml"
    async with secured_server(tmp_path, certs, tls_client_ca=certs.ca) as (_, target):
        mtls = {"tls_cert": certs.path("client.pem"), "tls_key": certs.path("client-key.pem")}
        async with certs.client(target, **mtls) as kv:
            assert await kv.list() == []
            tokens_file.rename(tokens_file.with_suffix(".moved"))
            await asyncio.sleep(INTERVAL_S)
            with pytest.raises(Unauthenticated):
                await kv.list()
