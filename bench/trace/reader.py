"""Reading request traces in the Mooncake format (one JSON object per line).

Each line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [block ids]}``; ``hash_ids`` name the prompt's 512-token prefix blocks (a
block id stands for the whole prefix up to and including that block). Extra keys are
ignored. Every line is checked; the first bad one raises ``InvalidRequest`` naming the
file and line number, and nothing is returned.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvstore.format.errors import InvalidRequest

BLOCK_TOKENS = 512  # the Mooncake traces hash prompts in blocks of 512 tokens


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def full_blocks(self) -> int:
        """Blocks completely covered by the prompt (the last one is usually partial)."""
        return min(len(self.hash_ids), self.input_length // BLOCK_TOKENS)


def _count(obj: dict, field: str, where: str) -> int:
    value = obj.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"{where}: {field!r} must be an integer >= 0, got {value!r}")
    return value


def parse_request(line: str, where: str) -> TraceRequest:
    """One trace line; ``where`` (file:line) prefixes every error message."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids")
               if k not in obj]
    if missing:
        raise InvalidRequest(f"{where}: missing field(s) {missing}")
    stamp = obj["timestamp"]
    if (isinstance(stamp, bool) or not isinstance(stamp, int | float)
            or not math.isfinite(stamp) or stamp < 0):
        raise InvalidRequest(f"{where}: 'timestamp' must be a finite number >= 0 (ms), "
                             f"got {stamp!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise InvalidRequest(f"{where}: 'hash_ids' must be a list, got {type(ids).__name__}")
    for i, block in enumerate(ids):
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise InvalidRequest(f"{where}: hash_ids[{i}] must be an integer >= 0, "
                                 f"got {block!r}")
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"{where}: 'hash_ids' names a block twice; a prefix cannot")
    return TraceRequest(
        timestamp_ms=float(stamp),
        input_length=_count(obj, "input_length", where),
        output_length=_count(obj, "output_length", where),
        hash_ids=tuple(ids),
    )


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests (all when None) of a trace, in file order.

    Blank lines are skipped; timestamps must not decrease (the format is in arrival order).
    """
    if limit is not None and limit < 1:
        raise InvalidRequest(f"limit must be >= 1, got {limit}")
    path = Path(path)
    requests: list[TraceRequest] = []
    last_stamp = 0.0
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise InvalidRequest(f"cannot read trace {path}: {exc.strerror}") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            if limit is not None and len(requests) >= limit:
                break
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidRequest(f"{where}: not UTF-8 text") from None
            if not line.strip():
                continue
            request = parse_request(line, where)
            if request.timestamp_ms < last_stamp:
                raise InvalidRequest(f"{where}: timestamp {request.timestamp_ms:g} ms is "
                                     f"earlier than the previous line's {last_stamp:g} ms")
            last_stamp = request.timestamp_ms
            requests.append(request)
    if not requests:
        raise InvalidRequest(f"trace {path} holds no requests")
    return requests
