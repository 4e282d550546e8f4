"""The bridge between a model ``KVState`` and the bytes kvstore keeps.

    chunks, tail, window = state_to_chunks(spec, state)
    state = state_from_chunks(cfg, token_ids, [c for _, c in chunks], tail, window, spec=spec)

Tensor layouts on the model side are those of ``model.state`` (per stream: codes
(layers, entries, ...), scales (layers, entries, ...) fp16); on the store side those of
``kvstore.format.chunk`` (codes (layers, entries, *codes_shape), scales (layers, entries, groups)).
The only reshaping is the window scales: (L, S, Hkv, Dh/gw) <-> (L, S, Hkv * Dh/gw).

Bytes:
  chunks  one encoded persistent chunk per full ``spec.chunk_tokens`` tokens, keyed by
          ``kvstore.format.keys.block_keys`` (chain key and digest) under the scope and model
          fingerprint given (for ``TierManager.spill``: ``dedupe_scope(tenant)``)
  tail    the persistent streams of the partial last chunk (b"" when chunks cover all)
  window  one or more ephemeral chunks back to back: the window K/V (S tokens) and, when
          n % m > 0, the pending rows of the unfinished block (n % m tokens); None when the
          state has no window
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.format.chunk import (
    Buffer,
    StreamData,
    decode_chunk,
    encode_chunk,
    read_header,
    split_chunks,
)
from kvstore.format.chunk_run import decode_chunks
from kvstore.format.errors import ChunkCorrupt, InvalidRequest, LayoutMismatch
from kvstore.format.keys import block_keys, token_bytes
from kvstore.format.layout import LayoutSpec, cache_difference
from model.config import ModelConfig, layout_spec
from model.state import PERSISTENT, KVState

WINDOW_KV = ("enc.window.k", "enc.window.v")
PENDING = ("enc.tail", "dec.tail")


def check_spec(cfg: ModelConfig, spec: LayoutSpec) -> None:
    """Raise LayoutMismatch unless ``spec`` describes this model's cache exactly
    (``kvstore.format.layout.cache_difference``: streams, chunk size, vocabulary, window and
    layer modes; the layout's name and the pending marks may differ)."""
    differs = cache_difference(spec, layout_spec(cfg, name=spec.name))
    if differs is not None:
        raise LayoutMismatch(f"layout {spec.layout_id} does not describe this model's cache "
                             f"(width {cfg.width}, W={cfg.window}, m={cfg.block}, vocabulary "
                             f"{cfg.vocab}): {differs}")


def as_token_array(token_ids) -> np.ndarray:
    """(n,) little-endian uint32 from a sequence, numpy array or 1-D tensor of token ids."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    return np.frombuffer(token_bytes(np.asarray(token_ids)), dtype="<u4")


def state_to_chunks(spec: LayoutSpec, state: KVState, *, scope: str = "",
                    model_fingerprint: str = ""
                    ) -> tuple[list[tuple[str, bytes]], bytes, bytes | None]:
    """Encode a state: (chunks [(block key, bytes)], tail bytes, window bytes or None)."""
    check_spec(state.cfg, spec)
    state.validate()
    ids = as_token_array(state.token_ids)
    n, size = len(ids), spec.chunk_tokens
    persistent = {name: _store_q(q) for name, q in state.persistent_tensors().items()}
    datas = [encode_chunk(spec, i * size, ids[i * size:(i + 1) * size],
                          _token_slice(spec, persistent, i * size, (i + 1) * size))
             for i in range(n // size)]
    keys = block_keys(spec.layout_id, ids, size, datas, scope=scope,
                      model_fingerprint=model_fingerprint)
    chunks = list(zip(keys, datas, strict=True))
    covered = len(keys) * size
    tail = b""
    if covered < n:
        tail = encode_chunk(spec, covered, ids[covered:],
                            _token_slice(spec, persistent, covered, n))
    return chunks, tail, encode_window(spec, state) if state.has_window else None


def encode_window(spec: LayoutSpec, state: KVState) -> bytes:
    """The window blob of a state that has one: window K/V chunk [+ pending rows chunk]."""
    if not state.has_window:
        raise InvalidRequest("the state has no window to encode")
    ids = as_token_array(state.token_ids)
    n, s, t = len(ids), state.window_len, state.n_tokens % state.cfg.block
    eph = state.ephemeral_tensors()
    blob = encode_chunk(spec, n - s, ids[n - s:],
                        {name: _store_q(eph[name]) for name in WINDOW_KV}, ephemeral=True)
    if t:
        blob += encode_chunk(spec, n - t, ids[n - t:],
                             {name: StreamData(eph[name][0], None) for name in PENDING},
                             ephemeral=True)
    return blob


def state_from_chunks(cfg: ModelConfig, token_ids, chunks: Sequence[Buffer], tail: Buffer,
                      window: Buffer | None, *, spec: LayoutSpec | None = None) -> KVState:
    """Decode (and verify) the bytes of a session into a state; ``window`` None gives a
    state without window (run ``model.infer.replay`` on it). ``spec`` defaults to the
    layout derived from ``cfg``; the chunks must have been encoded with the same one."""
    spec = layout_spec(cfg) if spec is None else spec
    check_spec(cfg, spec)
    ids = as_token_array(token_ids)
    persistent = decode_persistent(spec, ids, chunks, tail)
    model_persistent = {name: _model_q(cfg, name, persistent[name]) for name in PERSISTENT}
    ephemeral: dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None = None
    if window is not None:
        streams = decode_window(spec, ids, window, cfg.block)
        ephemeral = {name: _model_q(cfg, name, streams[name]) for name in WINDOW_KV}
        for name in PENDING:
            ephemeral[name] = (streams[name].codes, None)
    try:
        return KVState.from_tensors(cfg, torch.from_numpy(ids.astype(np.int64)),
                                    model_persistent, ephemeral)
    except ValueError as exc:
        raise LayoutMismatch(f"decoded tensors do not form a state: {exc}") from exc


def decode_persistent(spec: LayoutSpec, ids: np.ndarray, chunks: Sequence[Buffer],
                      tail: Buffer) -> dict[str, StreamData]:
    """Every persistent stream over all n tokens: codes (layers, n // m, ...), verified
    against the token ids each chunk was encoded with."""
    n, size = len(ids), spec.chunk_tokens
    if len(chunks) != n // size:
        raise InvalidRequest(f"{n} tokens need {n // size} full chunks, got {len(chunks)}")
    bufs, counts = list(chunks), [size] * len(chunks)
    covered = len(chunks) * size
    # The tail must hold every complete entry after the chunks; the rows of an unfinished
    # block may or may not be counted in it (they carry no entry).
    m = max(s.tokens_per_entry for s in spec.persistent_streams)
    if len(tail):
        count = read_header(tail).num_tokens
        if not n // m * m - covered <= count <= n - covered:
            raise InvalidRequest(f"the tail covers {count} tokens; the {n - covered} tokens "
                                 f"after the full chunks need {n // m * m - covered} to "
                                 f"{n - covered}")
        bufs.append(tail)
        counts.append(count)
    elif n // m * m > covered:
        raise InvalidRequest(f"tokens {covered}..{n - 1} need a tail chunk; none given")
    return decode_chunks(bufs, spec, ids, counts)


def decode_window(spec: LayoutSpec, ids: np.ndarray, window: Buffer, block: int  # noqa: C901 - one check per kind of window stream
                  ) -> dict[str, StreamData]:
    """The ephemeral streams of a window blob, each checked to end at the last token (the
    window K/V) or to hold exactly the n % m pending rows (the tails)."""
    n, streams = len(ids), {}
    for part in split_chunks(window):
        header = read_header(part)
        if not header.ephemeral:
            raise ChunkCorrupt("a window blob part holds persistent streams")
        start, count = header.start_token, header.num_tokens
        if start + count != n:
            raise InvalidRequest(f"a window part covers tokens {start}..{start + count - 1}, "
                                 f"not the last ones of {n}")
        decoded = decode_chunk(part, spec, token_ids=ids[start:n]).streams
        for name, data in decoded.items():
            if name in streams:
                raise ChunkCorrupt(f"the window blob holds stream {name} twice")
            if name in PENDING and count != n % block:
                raise InvalidRequest(f"{name} covers {count} tokens, the unfinished block "
                                     f"holds {n % block}")
            streams[name] = data
    missing = set(WINDOW_KV) - set(streams)
    if missing:
        raise InvalidRequest(f"the window blob lacks streams {sorted(missing)}")
    for name in PENDING:
        if name not in streams:
            if n % block:
                raise InvalidRequest(f"the window blob lacks the {n % block} pending rows "
                                     f"of {name}")
            stream = spec.stream(name)  # no pending rows: an empty tail
            streams[name] = StreamData(
                torch.zeros(stream.layers, 0, *stream.entry_shape, dtype=torch.bfloat16), None)
    return streams


def _token_slice(spec: LayoutSpec, streams: dict[str, StreamData], start: int, stop: int
                 ) -> dict[str, StreamData]:
    """The entries of tokens start..stop-1 (start a multiple of every stream's m)."""
    out = {}
    for s in spec.persistent_streams:
        a, b = start // s.tokens_per_entry, s.entries_for(stop)
        data = streams[s.name]
        out[s.name] = StreamData(data.codes[:, a:b],
                                 None if data.scales is None else data.scales[:, a:b])
    return out


def _store_q(q: tuple[torch.Tensor, torch.Tensor | None]) -> StreamData:
    """Model (codes, scales (layers, rows, ..., groups)) -> store scales (layers, rows, all)."""
    codes, scales = q
    assert scales is not None  # a quantized stream's
    groups = math.prod(scales.shape[2:])
    return StreamData(codes, scales.reshape(*scales.shape[:2], groups))


def _model_q(cfg: ModelConfig, name: str, data: StreamData) -> tuple[torch.Tensor, torch.Tensor]:
    """Store scales -> the model's: window scales regain their (Hkv, Dh/gw) axes."""
    scales = data.scales
    assert scales is not None  # a quantized stream's
    if name in WINDOW_KV:
        scales = scales.reshape(*scales.shape[:2], cfg.kv_heads,
                                cfg.head_dim // cfg.window_group_size)
    return data.codes, scales
