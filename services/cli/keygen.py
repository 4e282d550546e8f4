"""``kvtier keygen PATH [--id ID]``: write a new keyring file for ``encryption_key_file``
(README "Encryption at rest"): one ``[[key]]`` of ``id``, ``material`` (base64 of 32
random bytes) and ``current = true``, created 0600 and read back with the server's own
loader. It refuses a path that exists (a keyring replaced loses every value sealed under
it) and prints no key material."""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import sys
import time
from pathlib import Path

from kvstore.encryption.seal import KEY_BYTES, keyring_from_file
from kvstore.format.errors import KVTierError


def keyring_text(key_id: str, material: bytes) -> str:
    return ("# kvtier encryption keyring (encryption_key_file). Keep it secret; keep every\n"
            "# key that sealed data still stored. To rotate, add a [[key]], move\n"
            "# `current = true` to it, and restart every server holding this file.\n"
            f"[[key]]\nid = {json.dumps(key_id)}\n"
            f'material = "{base64.b64encode(material).decode()}"\ncurrent = true\n')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="the keyring file to create")
    parser.add_argument("--id", default="", help="the key's id (1 to 64 bytes), recorded in "
                        "the header of every value it seals (default: key-YYYYMMDD)")


def run(args: argparse.Namespace) -> int:
    key_id = args.id or time.strftime("key-%Y%m%d", time.gmtime())
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
                "keys could never be read again); add a [[key]] to it by hand to rotate")
    if not key_id.isprintable():
        return f"--id {key_id!r}: printable characters only"
    if not Path(path).parent.is_dir():
        return f"{Path(path).parent} is not a directory"
    return None
