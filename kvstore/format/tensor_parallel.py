"""One layout per tensor-parallel rank (docs/wire-format.md "Tensor parallelism").

An engine that shards attention heads over ``tp_size`` ranks spills each rank's own
heads under the rank's own layout, ``<name>-tp<size>r<rank>``: its sharded streams hold
``kv_heads // tp_size`` heads (or, when ``tp_size`` is a multiple of ``kv_heads``, the
one head the rank holds, replicated on ``tp_size // kv_heads`` ranks), the others (an
MLA latent, which every rank holds whole) are unchanged. The name and shape are in the
layout id, and chunk keys and chunk headers bind the id, so the ranks' chunks never
collide and a rank of another TP size (or another rank) never reads them. ``tp_size``
1 is the unsharded layout itself.
"""

from __future__ import annotations

from dataclasses import replace

from kvstore.format.errors import InvalidRequest
from kvstore.format.layout import LayoutSpec


def _check_rank(tp_size: int, rank: int) -> None:
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise InvalidRequest(f"rank {rank} is not one of tp_size {tp_size} ranks")


def shard_heads(kv_heads: int, tp_size: int, rank: int) -> range:
    """The global KV heads rank ``rank`` of ``tp_size`` holds."""
    _check_rank(tp_size, rank)
    if kv_heads % tp_size == 0:
        per = kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    if tp_size % kv_heads == 0:
        head = rank // (tp_size // kv_heads)
        return range(head, head + 1)
    raise InvalidRequest(f"{kv_heads} KV heads do not shard over {tp_size} ranks: one must "
                         "divide the other")


def tp_shard_layout(spec: LayoutSpec, tp_size: int, rank: int,
                    sharded: tuple[str, ...] | None = None) -> LayoutSpec:
    """Rank ``rank``'s layout of ``spec`` over ``tp_size`` ranks. ``sharded`` names the
    streams whose entry's first axis is the KV heads (default: every stream with a
    multi-axis entry, e.g. (kv_heads, head_dim)); the baseline's kv_heads shard alike."""
    _check_rank(tp_size, rank)
    names = {s.name for s in spec.streams}
    chosen = {s.name for s in spec.streams if len(s.entry_shape) > 1} if sharded is None \
        else set(sharded)
    if chosen - names:
        raise InvalidRequest(f"layout {spec.name} has no streams {sorted(chosen - names)}")
    if any(len(spec.stream(n).entry_shape) < 2 for n in chosen):
        raise InvalidRequest("a sharded stream's entry must be (kv_heads, ...)")
    if tp_size == 1:
        return spec

    def heads(n: int) -> int:
        return len(shard_heads(n, tp_size, rank))

    streams = tuple(replace(s, entry_shape=(heads(s.entry_shape[0]), *s.entry_shape[1:]))
                    if s.name in chosen else s for s in spec.streams)
    baseline = spec.baseline and replace(spec.baseline, kv_heads=heads(spec.baseline.kv_heads))
    return replace(spec, name=f"{spec.name}-tp{tp_size}r{rank}", streams=streams,
                   baseline=baseline)
