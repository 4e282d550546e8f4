"""Text the bundled model never saw: prose and source code found on this machine outside
its training corpus (``model.data``: the interpreter's standard library).

    stretches("code", length=4353, count=16)   # [(where, bytes)], deterministic

Prose comes from the documentation installed here (``/usr/share/doc``: READMEs, NEWS,
changelogs; the manual pages, rendered by groff; the docs and package descriptions in
site-packages), source code from the installed packages' sources (site-packages, not the
standard library) and the C headers in ``/usr/include``. ``roots`` replaces these with
other directories (a check that holds out other text). Each stretch comes from another
file, taken in turn from each source (a package, a header directory, a manual section),
so no one package dominates, at an offset drawn from ``seed``.

A stretch is kept only if no 48-byte piece of it, at every 48th byte, occurs anywhere in
the standard library's sources (training and held-out splits alike): a passage of 95
bytes or more shared with the corpus (a vendored copy of a stdlib module, a license
header) rejects it.
"""

from __future__ import annotations

import functools
import gzip
import random
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from model.data import corpus

KINDS = ("prose", "code")
PROBE = 48  # bytes of each piece looked up in the corpus, one every PROBE bytes
MAX_FILE_BYTES = 4 << 20
CODE_SUFFIXES = {".py", ".pyi", ".h", ".hpp", ".c", ".cc", ".cpp", ".pl", ".sh", ".js", ".rs"}
PROSE_SUFFIXES = {".md", ".rst", ".txt"}
# files without a suffix that are prose (any case): READMEs, NEWS, changelogs
PROSE_STEMS = ("readme", "news", "change", "history", "authors", "thanks", "todo")


def default_roots(kind: str) -> list[Path]:
    site = Path(sysconfig.get_paths()["purelib"])
    if kind == "prose":
        return [Path("/usr/share/doc"), Path("/usr/share/man"), site]
    return [site, Path("/usr/include")]


def stretches(kind: str, length: int, count: int, *, seed: int = 0,
              roots: list[Path] | None = None) -> list[tuple[str, bytes]]:
    """``count`` stretches of ``length`` bytes of ``kind`` text (``KINDS``), each from
    another file, none sharing a passage with the corpus; ValueError when too few exist."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    rng = random.Random(f"{kind}/{length}/{seed}")
    out = []
    for path in _in_turn(_sources(kind, tuple(roots or default_roots(kind))), rng):
        text = _read(path)
        if text is None or len(text) < length:
            continue
        start = rng.randrange(len(text) - length + 1)
        piece = text[start:start + length]
        if _is_text(piece) and not shares_with_corpus(piece):
            out.append((str(path), piece))
            if len(out) == count:
                return out
    raise ValueError(f"found {len(out)} {kind} stretches of {length} bytes outside the "
                     f"corpus, {count} were asked for")


def shares_with_corpus(text: bytes) -> bool:
    """Whether a piece of ``text`` (``PROBE`` bytes at every ``PROBE``-th) occurs in the
    standard library's sources."""
    stdlib = _stdlib()
    return any(text[i:i + PROBE] in stdlib for i in range(0, len(text) - PROBE + 1, PROBE))


@functools.cache
def _stdlib() -> bytes:
    return corpus(held_out=False) + corpus(held_out=True)


@functools.cache  # a walk of site-packages takes seconds; each context asks again
def _sources(kind: str, roots: tuple[Path, ...]) -> list[dict[str, list[Path]]]:
    """Per root, its candidate files by source (the root's subdirectory), sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    out = []
    for root in roots:
        by_source: dict[str, list[Path]] = {}
        for path in sorted(root.rglob("*")) if root.is_dir() else []:
            if _wanted(kind, path) and not path.resolve().is_relative_to(stdlib):
                by_source.setdefault(path.relative_to(root).parts[0], []).append(path)
        out.append(by_source)
    return out


def _wanted(kind: str, path: Path) -> bool:
    if not path.is_file() or "__pycache__" in path.parts:
        return False
    name = path.name.removesuffix(".gz")
    suffix = Path(name).suffix
    if kind == "code":
        return suffix in CODE_SUFFIXES and not path.name.endswith(".gz")
    if _is_manual(path):
        return True
    if path.parent.name.endswith(".dist-info"):  # its package's description alone
        return name == "METADATA"
    return suffix in PROSE_SUFFIXES or (not suffix and name.lower().startswith(PROSE_STEMS))


def _is_manual(path: Path) -> bool:
    return path.parent.name.startswith("man") and "man" in path.parts[:-2]


def _in_turn(roots: list[dict[str, list[Path]]], rng: random.Random) -> Iterator[Path]:
    """A file of each root in turn, of its next source (sources and files in a seeded
    order), so a root of many sources does not crowd out one of few."""
    turns = [_one_source_at_a_time(by_source, rng) for by_source in roots]
    while turns:
        for turn in list(turns):
            path = next(turn, None)
            if path is None:
                turns.remove(turn)
            else:
                yield path


def _one_source_at_a_time(by_source: dict[str, list[Path]], rng: random.Random
                          ) -> Iterator[Path]:
    queues = []
    for name in sorted(by_source):
        files = list(by_source[name])
        rng.shuffle(files)
        queues.append(files)
    rng.shuffle(queues)
    while queues:
        queues = [q for q in queues if q]
        for q in queues:
            yield q.pop()


def _read(path: Path) -> bytes | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        raw = path.read_bytes()
        if path.name.endswith(".gz"):
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if _is_manual(path):
        return _rendered(raw)
    return raw


def _rendered(troff: bytes) -> bytes | None:
    """A manual page as a reader sees it (groff's plain-text output), None without groff."""
    groff = shutil.which("groff")
    if groff is None:
        return None
    done = subprocess.run([groff, "-man", "-Tutf8", "-P-cbou"], input=troff,
                          capture_output=True, timeout=30, check=False)
    return done.stdout if done.returncode == 0 else None


def _is_text(piece: bytes) -> bool:
    """No NUL, and at least 95% printable ASCII, whitespace or UTF-8 bytes."""
    if b"\0" in piece:
        return False
    plain = sum(1 for b in piece if 32 <= b < 127 or b in (9, 10, 13) or b >= 128)
    return plain >= 0.95 * len(piece)
