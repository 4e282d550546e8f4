"""The repack between vLLM's paged blocks and kvtier's token-major K/V is exact: every
layout round-trips bit for bit, the CPU one agrees with vLLM's own packer, and values of
a bf16 stream are stored as they are."""

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from kvstore.format.chunk import decode_chunk, encode_chunk  # noqa: E402
from kvstore.format.errors import LayoutMismatch  # noqa: E402
from kvtier.integrations.vllm import values  # noqa: E402
from kvtier.integrations.vllm.layout import CacheShape, rank_layout  # noqa: E402
from kvtier.integrations.vllm.repack import PagedLayout, layout_kind  # noqa: E402

H, D, BS, N = 2, 32, 16, 6


def kv(n_tokens: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_tokens, H, D, generator=g).to(dtype),
            torch.randn(n_tokens, H, D, generator=g).to(dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_layout_is_what_vllm_packs(dtype):
    """Plain K|V written into blocks and packed by CpuPlatform.pack_kv_cache read back as
    that K and V; blocks the packer was not asked to touch are left alone by put."""
    from vllm.platforms.cpu import CpuPlatform

    paged = PagedLayout("cpu", H, D, BS)
    ids = torch.tensor([4, 1, 3])
    k, v = kv(len(ids) * BS, seed=1, dtype=dtype)
    plain = torch.cat([k.view(-1, BS, H, D), v.view(-1, BS, H, D)], dim=-1)  # (n, bs, H, 2D)
    cache = torch.zeros(N, H, BS, 2 * D, dtype=dtype)
    cache[ids] = plain.permute(0, 2, 1, 3)
    CpuPlatform.pack_kv_cache(cache, ids)
    got_k, got_v = paged.split(paged.take(cache, ids))
    assert same_bits(got_k, k) and same_bits(got_v, v)
    # and put writes exactly the bytes the packer wrote
    ours = torch.zeros_like(cache)
    paged.put(ours, ids, k, v)
    assert same_bits(ours[ids], cache[ids])
    assert not ours[[0, 2, 5]].any()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("kind,device", [("cpu", "cpu"), ("split", "cpu"), ("nhd", "cpu"),
                                         pytest.param("split", "cuda", marks=CUDA),
                                         pytest.param("nhd", "cuda", marks=CUDA)])
def test_round_trip_is_exact(kind, device):
    paged = PagedLayout(kind, H, D, BS)
    cache = (torch.randn(2, N, BS, H, D) if kind == "nhd"
             else torch.randn(N, H, BS, 2 * D)).to(torch.bfloat16).to(device)
    before = cache.clone()
    ids = torch.tensor([5, 0, 2], device=device)
    k, v = kv(len(ids) * BS, seed=2)  # on the CPU, as decoded chunks are
    paged.put(cache, ids, k, v)
    got_k, got_v = paged.split(paged.take(cache, ids).cpu())
    assert same_bits(got_k, k) and same_bits(got_v, v)
    others = torch.tensor([1, 3, 4], device=device)
    dim = 1 if kind == "nhd" else 0
    assert same_bits(cache.index_select(dim, others).cpu(), before.index_select(dim, others).cpu())


@pytest.mark.parametrize("kind,device", [("cpu", "cpu"), ("split", "cpu"), ("nhd", "cpu"),
                                         pytest.param("split", "cuda", marks=CUDA),
                                         pytest.param("nhd", "cuda", marks=CUDA)])
@pytest.mark.parametrize("ids", [[4, 1, 2], [1, 2, 3]], ids=["scattered", "one run"])
def test_blocks_written_from_strided_views_are_what_put_writes(kind, device, ids):
    """put_blocks takes each chunk's K and V where they lie (views with a chunk stride, as
    in a reply segment) and writes what put writes, touching no other block."""
    paged = PagedLayout(kind, H, D, BS)
    cache = (torch.randn(2, N, BS, H, D) if kind == "nhd"
             else torch.randn(N, H, BS, 2 * D)).to(torch.bfloat16).to(device)
    other = cache.clone()
    k, v = kv(len(ids) * BS, seed=3)
    index = torch.tensor(ids, device=device)
    paged.put(cache, index, k, v)
    # chunks of (K, V) rows back to back with a gap after each: strided (n, BS, H, D) views
    rows = torch.zeros(len(ids), 2 * BS * H * D + 8, dtype=torch.bfloat16)
    rows[:, :BS * H * D] = k.reshape(len(ids), -1)
    rows[:, BS * H * D:2 * BS * H * D] = v.reshape(len(ids), -1)
    k_view = rows[:, :BS * H * D].view(len(ids), BS, H, D)
    v_view = rows[:, BS * H * D:2 * BS * H * D].view(len(ids), BS, H, D)
    assert not k_view.is_contiguous()
    paged.put_blocks(other, index, k_view, v_view)
    assert same_bits(other.cpu(), cache.cpu())
    with pytest.raises(ValueError, match="must both be"):
        paged.put_blocks(other, index, k_view[:, :BS - 1], v_view[:, :BS - 1])


def test_split_layout_reads_vllms_view_of_any_strides():
    """vLLM's GPU backends hand connectors a logical (B, H, N, 2D) view over memory laid
    out (B, N, H, 2D): K is [..., :D], V [..., D:] of token n at [b, :, n]."""
    physical = torch.randn(N, BS, H, 2 * D).to(torch.bfloat16)
    view = physical.permute(0, 2, 1, 3)
    assert not view.is_contiguous()
    paged = PagedLayout("split", H, D, BS)
    paged.check(view)
    ids = torch.tensor([3, 4])
    k, v = paged.split(paged.take(view, ids))
    assert same_bits(k, physical[ids][..., :D].reshape(-1, H, D))
    assert same_bits(v, physical[ids][..., D:].reshape(-1, H, D))
    k2, v2 = kv(len(ids) * BS, seed=3)
    paged.put(view, ids, k2, v2)  # through the view, into the physical memory
    assert same_bits(physical[ids][..., :D].reshape(-1, H, D), k2)
    assert same_bits(physical[ids][..., D:].reshape(-1, H, D), v2)


def test_layouts_are_told_apart_and_checked():
    from kvstore.format.errors import UnsupportedModel

    assert layout_kind(True, torch.zeros(N, H, BS, 2 * D)) == "cpu"
    assert layout_kind(False, torch.zeros(N, H, BS, 2 * D)) == "split"
    assert layout_kind(False, torch.zeros(2, N, BS, H, D)) == "nhd"
    with pytest.raises(UnsupportedModel):
        PagedLayout("cpu", H, D, BS).check(torch.zeros(N, H + 1, BS, 2 * D))
    with pytest.raises(UnsupportedModel):
        PagedLayout("nhd", H, D, BS).check(torch.zeros(2, N, BS + 1, H, D))
    with pytest.raises(ValueError):
        PagedLayout("cpu", H, D, BS).join(*kv(BS + 1, seed=0))


def test_bf16_values_are_stored_as_they_are():
    shape = CacheShape(layers=3, kv_heads=H, head_size=D, block_size=BS, vocab_size=100,
                       dtype=torch.bfloat16, tp_size=1)
    spec = rank_layout(shape, 0, "portable")
    k = torch.randn(3, BS, H, D).to(torch.bfloat16)
    v = torch.randn(3, BS, H, D).to(torch.bfloat16)
    streams = {"k": values.encode(spec.stream("k"), k), "v": values.encode(spec.stream("v"), v)}
    tokens = list(range(BS))
    decoded = decode_chunk(encode_chunk(spec, 0, tokens, streams), spec, token_ids=tokens)
    assert same_bits(values.decode(spec.stream("k"), decoded.streams["k"], torch.bfloat16), k)
    assert same_bits(values.decode(spec.stream("v"), decoded.streams["v"], torch.bfloat16), v)


def test_fp16_values_are_stored_as_they_are_and_other_dtypes_refused():
    shape = CacheShape(layers=2, kv_heads=H, head_size=D, block_size=BS, vocab_size=100,
                       dtype=torch.float16, tp_size=1)
    stream = rank_layout(shape, 0, "portable").stream("k")
    x = torch.randn(2, BS, H, D).to(torch.float16)
    assert same_bits(values.decode(stream, values.encode(stream, x), torch.float16), x)
    with pytest.raises(LayoutMismatch):
        values.encode(stream, x.to(torch.bfloat16))  # never rounded silently


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_lossy_values_are_close(fmt):
    shape = CacheShape(layers=2, kv_heads=H, head_size=D, block_size=BS, vocab_size=100,
                       dtype=torch.bfloat16, tp_size=1)
    stream = rank_layout(shape, 0, fmt).stream("k")
    x = torch.randn(2, BS, H, D).to(torch.bfloat16)
    back = values.decode(stream, values.encode(stream, x), torch.bfloat16)
    assert back.dtype == torch.bfloat16 and back.shape == x.shape
    # int8: half a step of its per-(token, head) scale; e4m3: 3 mantissa bits (2^-4
    # relative) or, near zero, the smallest subnormal step of its per-layer scale
    err = (back.float() - x.float()).abs()
    bound = (x.float().abs().amax(-1, keepdim=True) / 127 * 0.5 if fmt == "int8"
             else x.float().abs() / 16 + x.float().abs().amax() / 448 * 2 ** -9)
    assert (err <= bound + 1e-2).all()


@pytest.mark.parametrize("kind,device", [("cpu", "cpu"), ("split", "cpu"), ("nhd", "cpu"),
                                         pytest.param("split", "cuda", marks=CUDA),
                                         pytest.param("nhd", "cuda", marks=CUDA)])
@pytest.mark.parametrize("ids", [[4, 1, 2], [1, 2, 3]], ids=["scattered", "one run"])
def test_pages_go_back_as_the_bytes_they_were(kind, device, ids):
    """Engine pages: each block's bytes as the layer holds them (nhd: its K block, then
    its V block), put back from strided views (a chunk stride, as in a reply segment)
    into other blocks bit for bit, touching no other block, with no repack."""
    paged = PagedLayout(kind, H, D, BS, pages=True)
    shape = (2, N, BS, H, D) if kind == "nhd" else (N, H, BS, 2 * D)
    g = torch.Generator().manual_seed(5)
    source = torch.randn(*shape, generator=g).to(torch.bfloat16).to(device)
    index = torch.tensor([0, 3, 5], device=device)
    pages = paged.as_pages(paged.take(source, index))  # (3, page bytes)
    page_bytes = H * BS * 2 * D * 2
    assert pages.dtype == torch.uint8 and pages.shape == (3, page_bytes)
    dim = 1 if kind == "nhd" else 0
    for n, block in enumerate(index.tolist()):  # a page is the block's own bytes
        own = source.select(dim, block).cpu().contiguous().view(torch.uint8).reshape(-1)
        assert torch.equal(pages[n], own)
    pad = 40  # each page lies in a chunk with other bytes around it
    segment = torch.zeros(3, pad + page_bytes + 8, dtype=torch.uint8)
    segment[:, pad:pad + page_bytes] = pages
    target = torch.zeros(*shape, dtype=torch.bfloat16, device=device)
    paged.put_pages(target, torch.tensor(ids, device=device),
                    segment[:, pad:pad + page_bytes].view(3, 1, H, -1))
    assert same_bits(target.index_select(dim, torch.tensor(ids, device=device)).cpu(),
                     source.index_select(dim, index).cpu())
    others = [b for b in range(N) if b not in ids]
    assert not target.index_select(dim, torch.tensor(others, device=device)).any()
    with pytest.raises(ValueError, match="pages must be"):
        paged.put_pages(target, torch.tensor(ids, device=device), pages[:-1])


def test_page_streams_hold_whole_blocks_only():
    """A page stream's codes are whole pages, one entry per block: a partial block (a
    spill's tail) is given none; decoding gives the pages back, never values."""
    from kvstore.format.errors import InvalidRequest
    from kvstore.format.hf.quant import decode_values

    shape = CacheShape(layers=2, kv_heads=H, head_size=D, block_size=BS, vocab_size=100,
                       dtype=torch.bfloat16, tp_size=1, arrangement="cpu_attn.vec")
    spec = rank_layout(shape, 0, "auto")
    stream = spec.stream("page")
    pages = torch.randint(0, 256, (2, 1, H * BS * 2 * D * 2), dtype=torch.uint8)
    data = values.encode(stream, pages)
    assert data.codes.shape == (2, 1, H, BS * 2 * D * 2) and data.scales is None
    chunk = encode_chunk(spec, 0, list(range(BS)), {"page": data})
    got = decode_chunk(chunk, spec, token_ids=list(range(BS))).streams["page"]
    assert torch.equal(values.decode(stream, got, torch.bfloat16), pages)
    assert values.encode(stream, pages[:, :0]).codes.shape == (2, 0, H, BS * 2 * D * 2)
    with pytest.raises(LayoutMismatch):
        values.encode(stream, pages.view(torch.bfloat16))
    with pytest.raises(LayoutMismatch):  # a share of a page is no page
        values.encode(stream, pages[:, :, 1:])
    with pytest.raises(InvalidRequest, match="page bytes"):
        decode_values(stream, got)
