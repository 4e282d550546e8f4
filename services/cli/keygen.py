"""``kvtier keygen PATH [--id ID]``: write a new keyring file for ``encryption_key_file``
(README "Encryption at rest"): one ``[[key]]`` of ``id``, ``material`` (base64 of 32
random bytes) and ``current = true``, created 0600 and read back with the server's own
loader. It refuses a path that exists (a keyring replaced loses every value sealed under
it) and prints no key material.

``kvtier keygen --rotate PATH [--id ID]`` adds a new key to an existing keyring and makes
it the current one; the old keys stay (values sealed under them still open) until
``kvtier rekey`` says one is no longer needed. The file is replaced atomically (a new
file, 0600, renamed over it) and only once the result reads back as the old keys plus
the new, current one."""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import secrets
import sys
import time
from pathlib import Path

from kvstore.encryption.seal import KEY_BYTES, keyring_from_file
from kvstore.format.errors import KVTierError


def keyring_text(key_id: str, material: bytes) -> str:
    return ("# kvtier encryption keyring (encryption_key_file). Keep it secret; keep every\n"
            "# key that sealed data still stored. To rotate: kvtier keygen --rotate PATH,\n"
            "# restart every server holding this file, then kvtier rekey.\n"
            f"[[key]]\nid = {json.dumps(key_id)}\n"
            f'material = "{base64.b64encode(material).decode()}"\ncurrent = true\n')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="the keyring file to create")
    parser.add_argument("--rotate", action="store_true", help="add a new current key to "
                        "the existing keyring PATH (the old keys stay, for reading)")
    parser.add_argument("--id", default="", help="the key's id (1 to 64 bytes), recorded in "
                        "the header of every value it seals (default: key-YYYYMMDD)")


def run(args: argparse.Namespace) -> int:
    key_id = args.id or time.strftime("key-%Y%m%d", time.gmtime())
    if args.rotate:
        return _rotate(Path(args.path), args.id or time.strftime("key-%Y%m%dT%H%M%S",
                                                                 time.gmtime()))
    problem = _refusal(args.path, key_id)
    if problem:
        print(f"kvtier keygen: {problem}", file=sys.stderr)
        return 2
    path = Path(args.path)
    try:
        write_keyring(path, key_id)
        keyring_from_file(path)  # what the server will read
    except OSError as exc:
        print(f"kvtier keygen: cannot write {path}: {exc.strerror}", file=sys.stderr)
        return 2
    except KVTierError as exc:
        path.unlink(missing_ok=True)
        print(f"kvtier keygen: {exc}", file=sys.stderr)
        return 2
    print(f"keyring {path} written: key {key_id!r}, current (set encryption_key_file = "
          f'"{path}")')
    return 0


def write_keyring(path: Path, key_id: str) -> None:
    """Create ``path`` (never replacing a file) 0600 from the start: the key is never
    readable by others, not even for a moment."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(keyring_text(key_id, secrets.token_bytes(KEY_BYTES)))
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(path, 0o600)  # O_CREAT's mode passes through the umask


def _refusal(path: str, key_id: str) -> str | None:
    if path.startswith("-"):
        return f"PATH {path!r} starts with '-': name a file (./{path})"
    if os.path.lexists(path):
        return (f"{path} exists: refusing to replace a keyring (values sealed under its "
                "keys could never be read again); kvtier keygen --rotate adds a key to it")
    if not key_id.isprintable():
        return f"--id {key_id!r}: printable characters only"
    if not Path(path).parent.is_dir():
        return f"{Path(path).parent} is not a directory"
    return None


_CURRENT_LINE = re.compile(r"^[ \t]*current[ \t]*=[ \t]*true[ \t]*(#.*)?$\n?", re.MULTILINE)


def _rotate(path: Path, key_id: str) -> int:
    try:
        before = keyring_from_file(path)
        if key_id in before.key_ids:
            raise KVTierError(f"{path} already holds a key {key_id!r}: pass another --id")
        if not key_id.isprintable():
            raise KVTierError(f"--id {key_id!r}: printable characters only")
        text = _CURRENT_LINE.sub("", path.read_text())
        text += (f"\n[[key]]\nid = {json.dumps(key_id)}\nmaterial = "
                 f'"{base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()}"\n'
                 "current = true\n")
        _replace(path, text, before.key_ids, key_id)
    except OSError as exc:
        print(f"kvtier keygen: cannot rotate {path}: {exc.strerror}", file=sys.stderr)
        return 2
    except KVTierError as exc:
        print(f"kvtier keygen: {exc}", file=sys.stderr)
        return 2
    print(f"keyring {path}: key {key_id!r} added and current; {before.key_ids} kept for "
          "reading. Restart every server holding it, then run kvtier rekey")
    return 0


def _replace(path: Path, text: str, old_ids: list[str], key_id: str) -> None:
    """Write ``text`` beside ``path`` (0600), check it reads as ``old_ids`` plus
    ``key_id`` current, and rename it over ``path``."""
    staged = path.with_name(f".{path.name}.rotate")
    staged.unlink(missing_ok=True)  # left by a rotation cut short
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(staged, 0o600)
        after = keyring_from_file(staged)
        if after.current != key_id or after.key_ids != sorted([*old_ids, key_id]):
            raise KVTierError(f"{path}: the rotated keyring would read as {after!r}; "
                              "left unchanged")
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)
