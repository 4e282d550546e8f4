"""SGLang's own HiCacheController drives KVTierStorage: its backup thread stores pages
written from the host pool, its prefetch thread finds them by the hashes it computes from
the tokens, and its I/O thread loads them into other host slots, bit for bit. The device
pool and its allocator are stand-ins (the threads under test never touch the device),
and the process group is a one-rank gloo group."""

from __future__ import annotations

import contextlib
import queue
import threading

import pytest

pytest.importorskip("sglang.srt.managers.cache_controller")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from kvtier.integrations.sglang.storage import KVTierStorage  # noqa: E402
from testing.sglang_pools import KVTIER, fill_random, host_pool, page_indices  # noqa: E402

PAGES = 3


class DevicePool:
    """What the controller reads of a device pool outside the device transfers."""

    device = torch.device("cpu")
    layer_num = 2

    def register_layer_transfer_counter(self, counter) -> None:
        self.counter = counter


class Allocator:
    def __init__(self) -> None:
        self.pool = DevicePool()

    def get_kvcache(self) -> DevicePool:
        return self.pool


@pytest.fixture
def controller(kvtier_server, tmp_path):
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                                world_size=1)
    pool = host_pool("mha", "page_first")
    extra = {**KVTIER, "server": kvtier_server.target, "model_fingerprint": "controller@1",
             "timeout_ms": 5000}
    with contextlib.ExitStack() as stack:
        stack.enter_context(get_parallel().override(
            attn_dcp_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
            attn_cp_size=1, attn_dcp_rank=0))
        made = HiCacheController(Allocator(), pool, pool.page_size, dist.group.WORLD,
                                 threading.Event(), storage_backend="dynamic",
                                 storage_backend_extra_config=extra, model_name="controller")
        yield made, pool
        made.storage_stop_event.set()


def test_the_controllers_backup_and_prefetch_threads_round_trip_pages(controller):
    made, pool = controller
    assert isinstance(made.storage_backend, KVTierStorage)
    assert made.page_get_func == made._page_get_zero_copy  # interface_v1
    pages = fill_random(pool, PAGES, seed=7)
    tokens = list(range(1000, 1000 + PAGES * pool.page_size))
    hashes = get_storage_hash_str(tokens, None, page_size=pool.page_size)

    made.write_storage(page_indices(pool, range(PAGES)), tokens, hash_value=hashes)
    backed_up = made.ack_backup_queue.get(timeout=60)
    assert backed_up.completed_tokens == len(tokens)

    # a request for those tokens and one page more: the hit is the stored prefix
    more = tokens + list(range(5000, 5000 + pool.page_size))
    operation = made.prefetch("rid", more)
    found = made.prefetch_hit_queue.get(timeout=60)
    assert found is operation and operation.storage_hit_count == len(tokens)
    assert operation.hash_value == hashes

    # the scheduler's part: host slots for the hit, then the I/O thread loads them
    slots = [PAGES + 1 + p for p in range(PAGES)]
    operation.host_indices = page_indices(pool, slots)
    made.prefetch_buffer.put(operation)
    acks = []
    with contextlib.suppress(queue.Empty):
        while not any(ack.completed_req for ack in acks):
            acks.append(made.ack_prefetch_queue.get(timeout=60))
    assert max(ack.completed_tokens or 0 for ack in acks) == len(tokens)
    for p, slot in enumerate(slots):
        loaded = pool.get_data_page(slot * pool.page_size, flat=True)
        assert torch.equal(loaded.view(torch.uint8), pages[p].view(torch.uint8))
