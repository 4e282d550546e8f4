"""Encryption at rest: master keys, per-domain data keys, and the sealed value format.

A KV cache holds what a user said (a prompt can be recovered from its KV), so every
value that leaves the process (the redis, disk and object tiers; manifests in the disk
MetaStore) is sealed with AES-256-GCM:

    sealed = MAGIC "KVTE" | u8 version | u8 len(key id) | u16 len(domain) | u64 layout hash
             | key id | domain | 96-bit nonce | ciphertext + 128-bit tag

- The data key of a dedupe domain (``tenant:<id>``, or ``shared:<name>`` for a shared
  domain, whose chunks belong to no single tenant) is HKDF-SHA256 of a master key over
  the domain, so one tenant's values never open under another's key.
- The nonce is fresh random bytes on every write (never a counter: two processes share
  a data directory's history).
- The associated data is the header (key id, domain, layout) and the storage key, so a
  value moved to another key, domain or layout fails authentication: it reads as a
  corrupt copy (``ChunkCorrupt``), never as another chunk's bytes.
- The key id names the master key that sealed a value: a key file may hold several
  (rotation), new writes use the current one, older ones stay readable.

The domain and layout hash stand in clear in the header (metadata, like the storage
key itself): they are what a value moved between tiers without session context is
resealed under. Key material is never logged: ``MasterKey`` has no repr of it.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import struct
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvstore.format.errors import ChunkCorrupt, InvalidRequest
from kvstore.tiers.base import Buffer

MAGIC = b"KVTE"
VERSION = 1
KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12
TAG_BYTES = 16
MAX_KEY_ID_BYTES = 64
_HEAD = struct.Struct("<4sBBHQ")
_HKDF_SALT = b"kvtier-at-rest-v1"
# The most a sealed value adds to its plaintext (a domain is "shared:" + 64 characters).
OVERHEAD_BYTES = _HEAD.size + MAX_KEY_ID_BYTES + 80 + NONCE_BYTES + TAG_BYTES
_TOML_POSITION = re.compile(r"\(at (line \d+, column \d+)\)")  # tomllib's error position


@dataclass(frozen=True)
class MasterKey:
    key_id: str
    material: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not self.key_id or len(self.key_id.encode()) > MAX_KEY_ID_BYTES:
            raise InvalidRequest(f"an encryption key id is 1 to {MAX_KEY_ID_BYTES} bytes, "
                                 f"got {self.key_id!r}")
        if len(self.material) != KEY_BYTES:
            raise InvalidRequest(f"encryption key {self.key_id!r} must be {KEY_BYTES} bytes "
                                 f"(base64 of 32 random bytes), got {len(self.material)}")


@dataclass(frozen=True)
class SealedHeader:
    key_id: str
    domain: str
    layout_hash: int


class Keyring:
    """The master keys a process may open values with; ``current`` seals new ones."""

    def __init__(self, keys: Sequence[MasterKey], current: str | None = None) -> None:
        if not keys:
            raise InvalidRequest("an encryption keyring needs at least one key")
        self._keys = {key.key_id: key for key in keys}
        if len(self._keys) != len(keys):
            raise InvalidRequest("encryption key ids must be unique")
        self.current = current or keys[0].key_id
        if self.current not in self._keys:
            raise InvalidRequest(f"the current encryption key {self.current!r} is not listed")
        self._ciphers: dict[tuple[str, str], AESGCM] = {}

    def __repr__(self) -> str:
        return f"Keyring(key_ids={sorted(self._keys)}, current={self.current!r})"

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def adopt(self, other: Keyring) -> None:
        """Take ``other``'s keys and current key in place (a reload of the key file):
        every tier and record sealer holding this keyring uses them from the next call."""
        self._ciphers = {}
        self._keys, self.current = other._keys, other.current

    def _cipher(self, key_id: str, domain: str) -> AESGCM:
        cipher = self._ciphers.get((key_id, domain))
        if cipher is None:
            master = self._keys.get(key_id)
            if master is None:
                raise ChunkCorrupt(f"sealed under encryption key {key_id!r}, which this "
                                   f"server does not hold (it holds {self.key_ids})")
            data_key = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=_HKDF_SALT,
                            info=b"kvtier-data-key\0" + domain.encode()).derive(master.material)
            cipher = self._ciphers[(key_id, domain)] = AESGCM(data_key)
        return cipher

    def seal(self, storage_key: str, domain: str, plaintext: Buffer,
             layout_hash: int = 0) -> bytes:
        """``plaintext`` sealed for ``domain`` under the current key, bound to
        ``storage_key`` and ``layout_hash``."""
        current = self.current  # read once: a reload (adopt) may change it meanwhile
        key_id, raw_domain = current.encode(), domain.encode()
        header = (_HEAD.pack(MAGIC, VERSION, len(key_id), len(raw_domain), layout_hash)
                  + key_id + raw_domain)
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._cipher(current, domain).encrypt(
            nonce, plaintext, _associated(header, storage_key))
        return header + nonce + sealed

    def open(self, storage_key: str, sealed: Buffer) -> tuple[SealedHeader, bytes]:
        """(header, plaintext) of a value sealed under ``storage_key``; ``ChunkCorrupt``
        when it is not a sealed value, was moved, altered, or its key is not held."""
        view = memoryview(sealed).cast("B")
        header = read_header(view)
        start = _HEAD.size + len(header.key_id.encode()) + len(header.domain.encode())
        nonce = view[start : start + NONCE_BYTES]
        try:
            plaintext = self._cipher(header.key_id, header.domain).decrypt(
                nonce, view[start + NONCE_BYTES :], _associated(view[:start], storage_key))
        except InvalidTag:
            raise ChunkCorrupt(f"sealed value under {storage_key!r} fails authentication "
                               "(altered, or moved from another key or domain)") from None
        return header, plaintext


def read_header(sealed: Buffer) -> SealedHeader:
    view = memoryview(sealed).cast("B")
    if len(view) < _HEAD.size + NONCE_BYTES + TAG_BYTES:
        raise ChunkCorrupt(f"a sealed value of {len(view)} bytes is too short")
    magic, version, id_len, domain_len, layout_hash = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise ChunkCorrupt(f"not a sealed value (magic {bytes(magic)!r}, expected {MAGIC!r}):"
                           " written before encryption at rest was turned on, or forged")
    if version != VERSION:
        raise ChunkCorrupt(f"sealed format version {version}; this build reads {VERSION}")
    end = _HEAD.size + id_len + domain_len
    if len(view) < end + NONCE_BYTES + TAG_BYTES:
        raise ChunkCorrupt("a sealed value ends inside its header")
    try:
        key_id = bytes(view[_HEAD.size : _HEAD.size + id_len]).decode()
        domain = bytes(view[_HEAD.size + id_len : end]).decode()
    except UnicodeDecodeError:
        raise ChunkCorrupt("a sealed value's header is not utf-8") from None
    return SealedHeader(key_id, domain, layout_hash)


def _associated(header: Buffer, storage_key: str) -> bytes:
    raw_key = storage_key.encode()
    return bytes(header) + len(raw_key).to_bytes(4, "little") + raw_key


def _material(text: object, where: str) -> bytes:
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}: key material must be a base64 string")
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: key material is not valid base64") from None


def keyring_from_base64(text: str, key_id: str = "env") -> Keyring:
    """One key, as ``KVTIER_ENCRYPTION_KEY`` gives it (base64 of 32 bytes)."""
    return Keyring([MasterKey(key_id, _material(text, "encryption_key"))])


def keyring_from_file(path: str | os.PathLike) -> Keyring:
    """A TOML key file: ``[[key]]`` tables of ``id`` and ``material`` (base64 of 32
    bytes); the one marked ``current = true``, else the first, seals new values."""
    try:
        with open(path, "rb") as handle:
            doc = tomllib.load(handle)
    except FileNotFoundError:
        raise InvalidRequest(f"encryption_key_file {path} does not exist (kvtier keygen "
                             "PATH writes one)") from None
    except OSError as exc:
        raise InvalidRequest(f"encryption_key_file {path}: cannot read it: "
                             f"{exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        # Only the position: the parser's message may quote a character of key material.
        where = _TOML_POSITION.search(str(exc))
        raise InvalidRequest(f"encryption_key_file {path}: not valid TOML at "
                             f"{where.group(1) if where else 'an unknown position'}") from None
    entries = doc.get("key")
    if not isinstance(entries, list) or not entries:
        raise InvalidRequest(f"encryption_key_file {path}: no [[key]] tables")
    keys, current = [], []
    for entry in entries:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("id"), str):
            raise InvalidRequest(f"encryption_key_file {path}: every [[key]] needs an id")
        keys.append(MasterKey(entry["id"], _material(entry.get("material"),
                                                     f"{path} key {entry['id']!r}")))
        if entry.get("current") is True:
            current.append(entry["id"])
    if len(current) > 1:
        raise InvalidRequest(f"encryption_key_file {path}: {len(current)} keys are marked "
                             "current; mark one")
    return Keyring(keys, current[0] if current else None)


def load_keyring(key_file: str | Path, key_base64: str) -> Keyring | None:
    """The configured keyring: from the key file or one base64 key; None when neither."""
    if key_file and key_base64:
        raise InvalidRequest("set encryption_key_file or encryption_key "
                             "(KVTIER_ENCRYPTION_KEY), not both")
    if key_file:
        return keyring_from_file(key_file)
    return keyring_from_base64(key_base64) if key_base64 else None
