"""The scheduler side against a real server: how much of a prompt it reports held (whole
blocks, never the last token), and the load, save and spill plans it hands the worker."""

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import kvtier  # noqa: E402
from kvstore.format.chunk import StreamData  # noqa: E402
from kvtier.integrations.vllm.config import ConnectorConfig  # noqa: E402
from kvtier.integrations.vllm.layout import CacheShape, rank_layout  # noqa: E402
from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata, LoadPlan, SavePlan  # noqa: E402
from kvtier.integrations.vllm.scheduler import SchedulerSide  # noqa: E402

BS = 16
SHAPE = CacheShape(layers=2, kv_heads=2, head_size=16, block_size=BS, vocab_size=1000,
                   dtype=torch.bfloat16, tp_size=1)
SPEC = rank_layout(SHAPE, 0, "portable")  # token-major: the test spills K and V
FINGERPRINT = "sched-test-model"
TOKENS = [(7 * i) % 997 + 1 for i in range(3 * BS + 6)]  # 3 whole blocks and 6 tokens


@pytest.fixture(scope="module")
def side(kvtier_server):
    """A scheduler side whose store holds the first 3 blocks of TOKENS (a session's)."""
    config = ConnectorConfig.from_extra({"server": kvtier_server.target, "tenant": "sched",
                                         "model_fingerprint": FINGERPRINT})
    client = kvtier.Client(kvtier_server.target)
    client.register_layout(SPEC)
    g = torch.Generator().manual_seed(0)
    kv = {name: StreamData(torch.randn(2, 3 * BS, 2, 16, generator=g).to(torch.bfloat16), None)
          for name in ("k", "v")}
    client.spill("sched", "stored", SPEC, TOKENS[:3 * BS], kv, generation=1,
                 model_fingerprint=FINGERPRINT)
    yield SchedulerSide(config, SHAPE, [SPEC], client)
    client.close()


def request(req_id: str, tokens, session: str | None = None) -> Request:
    extra = {"kv_transfer_params": {"kvtier_session": session}} if session else None
    return Request(req_id, list(tokens), SamplingParams(max_tokens=8, extra_args=extra), None)


def blocks(*ids: int) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def step(new=(), cached=None, scheduled=None) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = list(new)
    if cached is not None:
        out.scheduled_cached_reqs = cached
    out.num_scheduled_tokens = dict(scheduled or {})
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    return out


def cached_step(req_id: str, computed: int, new_blocks=None) -> CachedRequestData:
    return CachedRequestData(req_ids=[req_id], resumed_req_ids=set(), new_token_ids=[[]],
                             all_token_ids={}, new_block_ids=[new_blocks],
                             num_computed_tokens=[computed], num_output_tokens=[1])


def test_held_prefix_is_whole_blocks_and_never_the_last_token(side):
    assert side.get_num_new_matched_tokens(request("a", TOKENS), 0) == (3 * BS, False)
    # beyond vLLM's own hit only
    assert side.get_num_new_matched_tokens(request("b", TOKENS), BS) == (2 * BS, False)
    # a prompt of exactly the held blocks: its last token must be computed
    assert side.get_num_new_matched_tokens(request("c", TOKENS[:3 * BS]), 0) == (2 * BS, False)
    # another prompt, or another model's fingerprint, holds nothing
    assert side.get_num_new_matched_tokens(request("d", [5] + TOKENS[1:]), 0) == (0, False)
    other = SchedulerSide(ConnectorConfig.from_extra(
        {"server": side.config.server, "tenant": "sched", "model_fingerprint": "other"}),
        SHAPE, [SPEC], side.client)
    assert other.get_num_new_matched_tokens(request("e", TOKENS), 0) == (0, False)
    stats = side.take_stats()
    assert stats.data["lookups"] == 4 and stats.data["lookup_errors"] == 0
    # KV that is not a function of the tokens alone is never matched (nor asked for)
    salted = Request("f", list(TOKENS), SamplingParams(max_tokens=8), None, cache_salt="s")
    assert side.get_num_new_matched_tokens(salted, 0) == (0, False)
    assert side.take_stats() is None


def test_a_store_that_cannot_answer_is_a_miss():
    config = ConnectorConfig.from_extra({"server": "127.0.0.1:9", "model_fingerprint": "x",
                                         "timeout_s": 1})
    client = kvtier.Client(config.server, retry=kvtier.RetryPolicy(attempts=1), timeout_s=1)
    try:
        dead = SchedulerSide(config, SHAPE, [SPEC], client)
        assert dead.get_num_new_matched_tokens(request("x", TOKENS), 0) == (0, False)
        assert dead.take_stats().data["lookup_errors"] == 1
    finally:
        client.close()


def test_plans_load_then_save_new_full_blocks(side):
    req = request("r1", TOKENS)
    assert side.get_num_new_matched_tokens(req, BS) == (2 * BS, False)  # vLLM holds block 0
    side.update_state_after_alloc(req, blocks(7, 8, 9, 10), 2 * BS)
    req.num_computed_tokens = 3 * BS
    meta = side.build_connector_meta(step(
        [NewRequestData.from_request(req, ([7, 8, 9, 10],))], scheduled={"r1": 6}))
    assert meta.loads == [LoadPlan("r1", tuple(TOKENS[:3 * BS]), 1, (8, 9))]
    assert meta.saves == []  # the 4th block is not full yet
    # decode until the 4th block fills: it is saved, and only it
    req.append_output_token_ids(list(range(100, 110)))
    meta = side.build_connector_meta(step(cached=cached_step("r1", 4 * BS - 1),
                                          scheduled={"r1": 1}))
    assert meta.loads == []
    assert meta.saves == [SavePlan("r1", tuple(req.all_token_ids[:4 * BS]), 3, (10,))]
    # the worker could not save it (its load failed): planned again at the next step
    side.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=KVTierWorkerMetadata({"r1": 3})))
    req.append_output_token_ids([111])
    meta = side.build_connector_meta(step(cached=cached_step("r1", 4 * BS, ([11],)),
                                          scheduled={"r1": 1}))
    assert [(s.first_chunk, s.block_ids) for s in meta.saves] == [(3, (10,))]
    # it finished with saves planned: its blocks wait for the worker
    assert side.request_finished(req, [7, 8, 9, 10, 11]) == (True, None)
    assert side.build_connector_meta(step()).delayed == ["r1"]


def test_a_session_request_spills_its_next_generation(side):
    req = request("s1", TOKENS, session="stored")  # generation 1 is stored
    assert side.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    side.update_state_after_alloc(req, blocks(1, 2, 3, 4), 3 * BS)
    req.num_computed_tokens = 3 * BS
    side.build_connector_meta(step([NewRequestData.from_request(req, ([1, 2, 3, 4],))],
                                   scheduled={"s1": 6}))
    req.num_computed_tokens = len(TOKENS)
    req.append_output_token_ids(500)  # sampled, not yet computed
    delay, params = side.request_finished(req, [1, 2, 3, 4])
    assert delay and params == {"kvtier_session": "stored", "kvtier_generation": 2}
    meta = side.build_connector_meta(step())
    (spill,) = meta.spills
    assert (spill.session_id, spill.generation) == ("stored", 2)
    assert spill.token_ids == tuple(TOKENS) and spill.block_ids == (1, 2, 3, 4)
    assert meta.delayed == ["s1"]
    # a session the store does not have starts at generation 1
    new = request("s2", TOKENS[:20], session="fresh")
    side.get_num_new_matched_tokens(new, 0)
    side.update_state_after_alloc(new, blocks(5, 6), 0)
    new.num_computed_tokens = 20
    assert side.request_finished(new, [5, 6])[1] == {"kvtier_session": "fresh",
                                                     "kvtier_generation": 1}
    # a value that is no session id is ignored, never an error in the engine
    odd = Request("s3", TOKENS[:20], SamplingParams(
        max_tokens=8, extra_args={"kv_transfer_params": {"kvtier_session": 7}}), None)
    side.get_num_new_matched_tokens(odd, 0)
    side.update_state_after_alloc(odd, blocks(8, 9), 0)
    odd.num_computed_tokens = 20
    assert side.request_finished(odd, [8, 9]) == (False, None)


def test_draft_tokens_do_not_fill_a_block(side):
    """A block is saved only once the KV of accepted tokens fills it: a step's draft
    tokens may be rejected."""
    req = request("d1", TOKENS[:3 * BS + 6])
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, blocks(20, 21, 22, 23), 3 * BS)
    req.num_computed_tokens = 3 * BS
    side.build_connector_meta(step([NewRequestData.from_request(req, ([20, 21, 22, 23],))],
                                   scheduled={"d1": 6}))
    req.append_output_token_ids(list(range(200, 210)))
    drafted = step(cached=cached_step("d1", 4 * BS - 2), scheduled={"d1": 3})
    drafted.scheduled_spec_decode_tokens = {"d1": [1, 2]}
    assert side.build_connector_meta(drafted).saves == []
    accepted = step(cached=cached_step("d1", 4 * BS - 1), scheduled={"d1": 1})
    assert [s.first_chunk for s in side.build_connector_meta(accepted).saves] == [3]
