"""vLLM's paged KV blocks <-> kvtier's token-major K and V: copies only, no arithmetic, so a
block goes out and comes back bit for bit.

kvtier's side, per layer: ``k``, ``v`` (blocks * block_size, H, D), token t of block i at
row i * block_size + t.

vLLM's side, one tensor per attention layer (``LAYOUTS``):
  "cpu" (CPU_ATTN): (num_blocks, H, block_size, 2 * D), contiguous. Within a block and
      head, the first block_size * D values are K transposed, (D, block_size), the next
      block_size * D are V, (block_size, D): what ``CpuPlatform.pack_kv_cache`` writes.
  "split" (vLLM's GPU attention backends): the logical (num_blocks, H, block_size, 2 * D)
      view vLLM hands connectors, any strides: [..., :D] is K and [..., D:] is V of token n
      at [block, :, n].
  "nhd": (2, num_blocks, block_size, H, D), [0] K and [1] V (FlashAttention's cache
      before vLLM's per-layer [B, H, N, C] views).

  "raw": a latent (MLA) layer's cache: any view whose first axis is the blocks, any
      strides (DeepSeek-V4's layers are strided views of one shared allocation); a
      block is opaque bytes, only ever kept as a page.

Or, for an engine-page layout (``pages``), no repack at all: a block's page is its bytes
as the layer holds them, (H, block_size, 2 * D) values (cpu, split; the layer's own
arrangement within them: vec, amx, ...), or its K block then its V block,
(2, block_size, H, D) (nhd); saved by one gather and loaded by one scatter per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.format.errors import UnsupportedModel

LAYOUTS = ("cpu", "split", "nhd", "raw")


def layout_kind(is_cpu: bool, layer: torch.Tensor, arrangement: str = "") -> str:
    """The layout of a layer's cache: raw for a latent group's (``arrangement`` "raw"),
    CPU_ATTN's on the CPU platform, else by its rank."""
    if arrangement == "raw":
        return "raw"
    if is_cpu:
        return "cpu"
    return "nhd" if layer.dim() == 5 else "split"


@dataclass(frozen=True)
class PagedLayout:
    kind: str  # LAYOUTS
    kv_heads: int
    head_size: int
    block_size: int
    pages: bool = False  # the store keeps blocks as engine pages, not token-major K and V

    @property
    def block_dim(self) -> int:
        return 1 if self.kind == "nhd" else 0

    def check(self, layer: torch.Tensor, page_bytes: int = 0) -> None:
        """``layer`` must be one layer's cache of this layout (``UnsupportedModel``); a
        raw layer's block must be ``page_bytes``."""
        h, d, b = self.kv_heads, self.head_size, self.block_size
        if self.kind == "raw":
            got = block_bytes(layer)
            ok, want = got == page_bytes, f"(num_blocks, ...) of {page_bytes} B a block"
        elif self.kind == "nhd":
            ok, want = (layer.dim() == 5 and layer.shape[0] == 2
                        and tuple(layer.shape[2:]) == (b, h, d)), f"(2, num_blocks, {b}, {h}, {d})"
        else:
            ok = layer.dim() == 4 and tuple(layer.shape[1:]) == (h, b, 2 * d) and (
                self.kind == "split" or layer.is_contiguous())
            want = f"(num_blocks, {h}, {b}, {2 * d})" + (" contiguous" if self.kind == "cpu"
                                                         else "")
        if not ok:
            raise UnsupportedModel(f"kvtier connector: a {self.kind} KV cache layer must be "
                                   f"{want}, got {tuple(layer.shape)}")

    def take(self, layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """A copy of the blocks ``block_ids`` (int64, on the layer's device) of ``layer``,
        still in vLLM's layout: (n, H, block_size, 2D), or (2, n, block_size, H, D) for
        nhd."""
        return layer.index_select(self.block_dim, block_ids)

    def as_pages(self, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks ``take`` returned as their pages, byte for byte, on the CPU: (n, page
        bytes) uint8, one row per block (a page is opaque: no row of it is a token's)."""
        if self.kind == "nhd":
            blocks = blocks.transpose(0, 1)  # (n, 2, b, H, D)
        return blocks.cpu().contiguous().view(torch.uint8).reshape(blocks.shape[0], -1)

    def put_pages(self, layer: torch.Tensor, block_ids: torch.Tensor,
                  pages: torch.Tensor) -> None:
        """Write whole pages (n, ...) uint8 of n * page bytes, rows of any stride (e.g.
        views of chunks lying in a reply segment), into the blocks ``block_ids`` (n int64,
        on the layer's device) of ``layer``, no repack: on a GPU one scatter; on the CPU one
        copy per run of consecutive blocks (a plain memcpy of whole pages: index_copy_
        measured 2-3x slower than these copies even with every block its own run)."""
        h, d, b = self.kv_heads, self.head_size, self.block_size
        n = block_ids.shape[0]
        page_bytes = h * b * 2 * d * layer.element_size() if self.kind == "nhd" \
            else block_bytes(layer)
        if pages.dtype != torch.uint8 or pages.numel() != n * page_bytes:
            raise ValueError(f"pages must be {n} x {page_bytes} B (uint8), got "
                             f"{tuple(pages.shape)} {pages.dtype}")
        values = pages.to(layer.device).reshape(n, page_bytes).view(layer.dtype)
        if self.kind == "nhd":
            layer.index_copy_(1, block_ids, values.view(n, 2, b, h, d).transpose(0, 1))
            return
        block = tuple(layer.shape[1:])  # (H, b, 2D) for cpu and split; any for raw
        if layer.is_cuda:
            layer.index_copy_(0, block_ids, values.view(n, *block))
        else:
            at = 0
            for start, count in runs(block_ids.tolist()):
                layer[start:start + count].copy_(values[at:at + count].view(count, *block))
                at += count

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V, each (n * block_size, H, D), of blocks ``take`` returned."""
        h, d, b = self.kv_heads, self.head_size, self.block_size
        n = blocks.shape[self.block_dim]
        if self.kind == "nhd":
            return blocks[0].reshape(n * b, h, d), blocks[1].reshape(n * b, h, d)
        if self.kind == "split":
            k = blocks[..., :d].permute(0, 2, 1, 3)  # (n, b, H, D)
            v = blocks[..., d:].permute(0, 2, 1, 3)
        else:
            halves = blocks.contiguous().view(n, h, 2, b * d)
            k = halves[:, :, 0].reshape(n, h, d, b).permute(0, 3, 1, 2)  # (n, b, H, D)
            v = halves[:, :, 1].reshape(n, h, b, d).permute(0, 2, 1, 3)  # (n, b, H, D)
        return k.reshape(n * b, h, d), v.reshape(n * b, h, d)

    def join(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Blocks in vLLM's layout (as ``take`` returns them) of K and V, each
        (n * block_size, H, D)."""
        h, d, b = self.kv_heads, self.head_size, self.block_size
        if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (h, d) \
                or k.shape[0] % b:
            raise ValueError(f"K and V must both be (n * {b}, {h}, {d}), got "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        n = k.shape[0] // b
        k, v = k.reshape(n, b, h, d), v.reshape(n, b, h, d)
        if self.kind == "nhd":
            return torch.stack((k, v))
        if self.kind == "split":
            return torch.cat((k, v), dim=-1).permute(0, 2, 1, 3)  # (n, H, b, 2D)
        blocks = torch.empty((n, h, 2, b * d), dtype=k.dtype, device=k.device)
        blocks[:, :, 0] = k.permute(0, 2, 3, 1).reshape(n, h, d * b)
        blocks[:, :, 1] = v.permute(0, 2, 1, 3).reshape(n, h, b * d)
        return blocks.view(n, h, b, 2 * d)

    def put(self, layer: torch.Tensor, block_ids: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> None:
        """Write K and V (n * block_size, H, D each) into the blocks ``block_ids`` of
        ``layer``."""
        blocks = self.join(k.to(layer.device), v.to(layer.device))
        layer.index_copy_(self.block_dim, block_ids, blocks)

    def put_blocks(self, layer: torch.Tensor, block_ids: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """Write K and V (n, block_size, H, D each, any strides, e.g. views of chunks lying
        in a reply segment) into the blocks ``block_ids`` (n int64, on the layer's device)
        of ``layer`` in place, no staging blocks: on a GPU layout one scatter of K and one
        of V; on the CPU one copy of K and one of V per run of consecutive blocks, written
        where they lie (K is transposed on the way: a single index_copy_ would need the
        blocks packed first, one more pass over every byte, which measured slower in
        bench.vllm.load_path even with every block its own run)."""
        h, d, b = self.kv_heads, self.head_size, self.block_size
        n = block_ids.shape[0]
        if k.shape != (n, b, h, d) or v.shape != (n, b, h, d):
            raise ValueError(f"K and V must both be ({n}, {b}, {h}, {d}), got "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        k, v = k.to(layer.device), v.to(layer.device)
        if self.kind == "nhd":
            layer[0].index_copy_(0, block_ids, k)
            layer[1].index_copy_(0, block_ids, v)
        elif self.kind == "split":
            layer[block_ids, :, :, :d] = k.permute(0, 2, 1, 3)  # (n, H, b, D)
            layer[block_ids, :, :, d:] = v.permute(0, 2, 1, 3)
        else:
            at = 0
            for start, count in runs(block_ids.tolist()):
                # contiguous: per block and head K^T (D, b), then V (b, D)
                halves = layer[start:start + count].view(count, h, 2, b * d)
                kt, vt = k[at:at + count].permute(0, 2, 3, 1), v[at:at + count].permute(0, 2, 1, 3)
                halves[:, :, 0].view(count, h, d, b).copy_(kt)
                halves[:, :, 1].view(count, h, b, d).copy_(vt)
                at += count


def block_bytes(layer: torch.Tensor) -> int:
    """The bytes of one block of a layer's cache (blocks on its first axis)."""
    return layer[0].numel() * layer.element_size()


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive ascending ids, in order."""
    out: list[tuple[int, int]] = []
    for i in ids:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out
