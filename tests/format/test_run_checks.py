"""restored_run_checks: a batch of restored chunks checked at once accepts exactly the
copies each chunk's own check (restored_chunk_check) accepts, with that check's error."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.format.checks import restored_chunk_check
from kvstore.format.chunk import encode_chunk
from kvstore.format.errors import CodecError
from kvstore.format.keys import block_keys
from kvstore.format.run_checks import restored_run_checks
from tests.support.chunks import BUNDLED, MIXED, make_streams


def session(spec, chunks, seed=0):
    """(chunk bytes, their block keys, the token ids): ``chunks`` full chunks."""
    size = spec.chunk_tokens
    ids = np.random.default_rng(seed).integers(0, 256, chunks * size).astype(np.uint32)
    bufs = [encode_chunk(spec, i * size, ids[i * size:(i + 1) * size],
                         make_streams(spec, size, seed=seed + i)) for i in range(chunks)]
    return bufs, block_keys(spec.layout_id, ids, size, bufs, scope="t"), ids


def own_verdicts(spec, ids, first, keys, values, proven):
    out = []
    for i, (key, value, sure) in enumerate(zip(keys, values, proven, strict=True)):
        check = restored_chunk_check(spec, ids, first + i, key)
        try:
            (check.proven if sure else check)(value)
            out.append(None)
        except CodecError as exc:
            out.append(type(exc))
    return out


def run_verdicts(spec, ids, first, keys, values, proven):
    checks = restored_run_checks(spec, ids, first, keys)
    run = checks[0].run
    errors = run.many([c.index for c in checks], values, proven)
    return [None if e is None else type(e) for e in errors]


@pytest.mark.parametrize("spec", [MIXED, BUNDLED])
def test_intact_copies_pass_and_each_kind_of_wrong_copy_fails(spec):
    bufs, keys, ids = session(spec, 4)
    assert run_verdicts(spec, ids, 0, keys, bufs, [True] * 4) == [None] * 4
    assert run_verdicts(spec, ids, 0, keys, bufs, [False] * 4) == [None] * 4
    # chunk 1's bytes where chunk 2 belongs: a valid chunk of other tokens
    swapped = [bufs[0], bufs[2], bufs[1], bufs[3]]
    for proven in ([True] * 4, [False] * 4):
        got = run_verdicts(spec, ids, 0, keys, swapped, proven)
        assert got[0] is None and got[3] is None and got[1] and got[2]
        assert got == own_verdicts(spec, ids, 0, keys, swapped, proven)
    # a batch that starts later in the session
    assert run_verdicts(spec, ids, 2, keys[2:], bufs[2:], [True, False]) == [None, None]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_damaged_copy_gets_the_verdict_of_its_own_check(data):
    spec = MIXED
    bufs, keys, ids = session(spec, 3, seed=1)
    values = [bytearray(b) for b in bufs]
    proven = [data.draw(st.booleans()) for _ in bufs]
    victim = data.draw(st.integers(0, 2))
    # a byte of the header or table (where the run check reads), or anywhere
    limit = data.draw(st.sampled_from([400, len(values[victim])]))
    at = data.draw(st.integers(0, min(limit, len(values[victim])) - 1))
    values[victim][at] ^= data.draw(st.integers(1, 255))
    if data.draw(st.booleans()):
        values[victim] = values[victim][:data.draw(st.integers(0, len(values[victim])))]
    views = [memoryview(bytes(v)) for v in values]
    got = run_verdicts(spec, ids, 0, keys, views, proven)
    assert got == own_verdicts(spec, ids, 0, keys, views, proven)
    assert all(g is None for i, g in enumerate(got) if i != victim)
    if not proven[victim]:
        assert got[victim] is not None  # its digest no longer matches
