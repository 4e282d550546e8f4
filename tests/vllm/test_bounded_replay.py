"""DeepSeek-V4.1's SWA bounded replay, on vLLM's real scheduler and spec objects (V4.1 has no
CPU path, so no engine runs here): the groups a V4.1 engine has (sliding-window MLA with
``bounded_replay=True``, the compressed global MLA KV, the compressor's ring), a request with
a hit from a connector, and what the scheduler does with it. ``window_loaded`` is true only
when ``get_loaded_kv_cache_group_ids(request)`` names every bounded-replay group: then the
engine replays nothing; otherwise it recomputes ``min(window, hit)`` tokens from
``replay_start``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)
from vllm.v1.request import Request  # noqa: E402

from bench.vllm import dsv41_replay  # noqa: E402
from testing import vllm_models  # noqa: E402

WINDOW = 128
GLOBAL_BLOCK = 256
PROMPT = 1000
SWA_GROUPS = (0, 1, 2)
GLOBAL_GROUP = 3


def v41_groups() -> list[KVCacheGroupSpec]:
    """A tiny V4.1's groups as its layers declare them (vllm/models/deepseek_v41): one
    bounded-replay sliding-window MLA group per layer (fp8_ds_mla records, block 32), the
    kv-source layers' compressed KV (block 256, 2 tokens per state), the compressor ring."""
    def swa() -> SlidingWindowMLASpec:
        return SlidingWindowMLASpec(block_size=32, num_kv_heads=1, head_size=512,
                                    dtype=torch.uint8, sliding_window=WINDOW,
                                    cache_dtype_str="fp8_ds_mla", bounded_replay=True)

    compressed = MLAAttentionSpec(block_size=GLOBAL_BLOCK, num_kv_heads=1, head_size=512,
                                  dtype=torch.uint8, cache_dtype_str="fp8_ds_mla",
                                  model_version="deepseek_v4", tokens_per_state=2)
    ring = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=1024, head_size_v=0,
                              dtype=torch.float32)
    return [*(KVCacheGroupSpec([f"model.layers.{i}.attn.swa_cache"], swa()) for i in range(3)),
            KVCacheGroupSpec(["model.layers.1.attn", "model.layers.2.attn"], compressed),
            KVCacheGroupSpec(["model.layers.1.attn.compressor.state_cache"], ring)]


def scheduler_with(connector: str, module: str, extra: dict | None = None):
    """vLLM's Scheduler over the V4.1 groups, its connector built by vLLM's factory."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=str(vllm_models.tiny_llama()), skip_tokenizer_init=True,
                        dtype="bfloat16", max_model_len=4096)
    config = VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=GLOBAL_BLOCK),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=8,
                                         max_model_len=4096, is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                            kv_connector_module_path=module,
                                            kv_connector_extra_config=extra or {}))
    config.cache_config.num_gpu_blocks = 400
    kv_cache_config = KVCacheConfig(num_blocks=400, kv_cache_tensors=[],
                                    kv_cache_groups=v41_groups())
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
    return Scheduler(config, kv_cache_config, StructuredOutputManager(config),
                     block_size=block_size, hash_block_size=hash_block_size)


def admit(scheduler, tokens: list[int], req_id: str = "r") -> tuple[Request, int]:
    """Adds a request and runs one step: the request and the tokens scheduled for it."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    request = Request(req_id, tokens, SamplingParams(max_tokens=4), None,
                      block_hasher=get_request_block_hasher(scheduler.hash_block_size, sha256))
    scheduler.add_request(request)
    out = scheduler.schedule()
    return request, out.num_scheduled_tokens.get(req_id, 0)


class FixedHitConnector(KVConnectorBase_V1, SupportsHMA):
    """A test double with a set hit and set loaded groups: what vLLM does with them."""

    hit_tokens = 3 * GLOBAL_BLOCK
    loaded_groups: tuple[int, ...] = (GLOBAL_GROUP,)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.hit_tokens - num_computed_tokens, False

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return self.loaded_groups

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


@pytest.fixture
def fixed(monkeypatch):
    def make(hit_tokens: int, loaded: tuple[int, ...]):
        monkeypatch.setattr(FixedHitConnector, "hit_tokens", hit_tokens)
        monkeypatch.setattr(FixedHitConnector, "loaded_groups", loaded)
        return scheduler_with("FixedHitConnector", __name__)
    return make


def test_the_v41_groups_replay_their_window_and_only_the_global_kv_is_prefix_cacheable(fixed):
    scheduler = fixed(3 * GLOBAL_BLOCK, (GLOBAL_GROUP,))
    assert scheduler.prefix_replay_tokens == WINDOW
    assert scheduler.prefix_replay_group_ids == SWA_GROUPS
    assert scheduler.kv_cache_config.prefix_cacheable_group_ids == (GLOBAL_GROUP,)


@pytest.mark.parametrize("hit, loaded, replayed", [
    (3 * GLOBAL_BLOCK, (GLOBAL_GROUP,), WINDOW),  # global KV only: the window is replayed
    (3 * GLOBAL_BLOCK, (*SWA_GROUPS, GLOBAL_GROUP), 0),  # the window came with the load
    (3 * GLOBAL_BLOCK, (0, 1, GLOBAL_GROUP), WINDOW),  # one window missing: replayed
    (GLOBAL_BLOCK, (GLOBAL_GROUP,), WINDOW),  # min(window, hit)
])
def test_window_loaded_only_when_every_bounded_replay_group_was_loaded(fixed, hit, loaded,
                                                                        replayed):
    scheduler = fixed(hit, loaded)
    marks = dsv41_replay._watch_replay(scheduler)
    request, scheduled = admit(scheduler, list(range(1, PROMPT + 1)))
    # the replay starts at the hit's last window; a load that carried it replays nothing
    assert request.replay_start == (hit - replayed if replayed else 0)
    assert scheduled == PROMPT - hit + replayed
    (mark,) = marks
    assert mark == {"request": "r", "hit_tokens": hit, "window_loaded": replayed == 0,
                    "replay_tokens": replayed}
    # the GPU script's judge accepts what the scheduler did
    report = {"prefix_replay_tokens": WINDOW, "hits": [
        {"num_cached_tokens": hit, "tokens_agree": True, "max_logprob_diff": 0.0,
         "replay": mark}]}
    assert dsv41_replay.judge(report, 0.05) == "ok"


# KVTierConnector's scheduler side in the same scheduler, against a real server holding the
# global group's chunks of a prompt.

FINGERPRINT = "tiny-dsv41-replay-test"


@pytest.fixture
def kvtier_scheduler(kvtier_server):
    extra = {"server": kvtier_server.target, "tenant": "dsv41", "timeout_s": 60,
             "model_fingerprint": FINGERPRINT, "lookup_timeout_ms": 10000}
    from kvtier.integrations.vllm.layout import worker_pages
    from kvtier.integrations.vllm.metadata import KVTierHandshake

    scheduler = scheduler_with("KVTierConnector", "kvtier.integrations.vllm", extra)
    # what vLLM's engine core hands over once its workers registered their caches: the
    # global group's page sizes (its layers share one spec here, so the scheduler's own)
    scheduler.connector.set_xfer_handshake_metadata(
        {0: KVTierHandshake(worker_pages(cache_groups_of(scheduler)))})
    yield scheduler
    scheduler.connector.shutdown()


def store_global_kv(kvtier_server, scheduler, tokens: list[int]) -> None:
    """The V4.1 global group's pages of ``tokens`` (whole blocks) stored under the layout the
    connector registered for it, as a session spill (its chunks are chain chunks)."""
    from kvstore.format.chunk import StreamData
    from kvtier import Client
    from kvtier.integrations.vllm.layout import rank_layout

    (group,) = scheduler.connector.groups  # the only group it stores
    assert group.group == GLOBAL_GROUP
    spec = rank_layout(group, 0, "auto")
    g = torch.Generator().manual_seed(0)
    streams = {}
    for stream in spec.streams:
        entries = len(tokens) // stream.tokens_per_entry
        codes = torch.randint(0, 256, (stream.layers, entries, *stream.entry_shape),
                              generator=g, dtype=torch.uint8)
        streams[stream.name] = StreamData(codes, None)
    with Client(kvtier_server.target) as client:
        client.register_layout(spec)
        client.spill("dsv41", "stored", spec, tokens, streams, generation=1,
                     model_fingerprint=FINGERPRINT)


def admit_when_looked_up(scheduler, tokens: list[int]) -> tuple[Request, int]:
    """``admit``, then steps until the connector's lookup answered and the request ran."""
    import time

    request, scheduled = admit(scheduler, tokens)
    deadline = time.monotonic() + 60
    while not scheduled:
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.01)
        scheduled = scheduler.schedule().num_scheduled_tokens.get(request.request_id, 0)
    return request, scheduled


def test_kvtier_keeps_only_the_global_kv_of_v41(kvtier_scheduler):
    from kvtier.integrations.vllm.layout import FULL, REBUILT

    kinds = [(g.group, g.kind) for g in cache_groups_of(kvtier_scheduler)]
    # the windows (bounded replay) and the compressor ring are the engine's to rebuild
    assert kinds == [(0, REBUILT), (1, REBUILT), (2, REBUILT), (3, FULL), (4, REBUILT)]


def cache_groups_of(scheduler):
    from kvtier.integrations.vllm.layout import cache_groups

    return cache_groups(scheduler.vllm_config, scheduler.kv_cache_config)


def test_a_hit_of_the_global_kv_from_kvtier_makes_the_engine_replay_its_window(
        kvtier_server, kvtier_scheduler):
    prompt = [(7 * i) % 997 + 1 for i in range(PROMPT)]
    hit = 3 * GLOBAL_BLOCK
    store_global_kv(kvtier_server, kvtier_scheduler, prompt[:hit])
    marks = dsv41_replay._watch_replay(kvtier_scheduler)
    request, scheduled = admit_when_looked_up(kvtier_scheduler, prompt)
    # kvtier reports the global group loaded, never a window: the scheduler replays
    # min(window, hit) tokens from the hit's last window
    assert kvtier_scheduler.connector.get_loaded_kv_cache_group_ids(request) == (GLOBAL_GROUP,)
    assert marks == [{"request": "r", "hit_tokens": hit, "window_loaded": False,
                      "replay_tokens": WINDOW}]
    assert request.replay_start == hit - WINDOW
    assert scheduled == PROMPT - hit + WINDOW
    # and its counters say so: a hit whose window the engine replays, none it loaded
    stats = kvtier_scheduler.connector.get_kv_connector_stats().data
    assert (stats["hits"], stats["hit_tokens"]) == (1, hit)
    assert (stats["window_replays"], stats["window_loads"]) == (1, 0)
