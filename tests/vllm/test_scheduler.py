"""The scheduler side against a real server: how much of a prompt it reports held (whole
blocks, never the last token), and the load, save and spill plans it hands the worker; its
lookups never block a step (a hung server's are misses by the deadline, then at once)."""

import logging
import time

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
from kvtier.integrations.breaker import Link  # noqa: E402
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
    side = SchedulerSide(config, [SHAPE], {0: [SPEC]}, link_of(client, config), alignment=BS)
    wait_up(side.link)
    yield side
    side.shutdown()


def link_of(client, config: ConnectorConfig) -> Link:
    return Link(client, [SPEC], server=config.server, failures=config.breaker_failures,
                probe_interval_s=config.probe_interval_s, logger=logging.getLogger("test"))


def wait_up(link: Link) -> None:
    deadline = time.monotonic() + 60
    while not link.up:
        assert time.monotonic() < deadline, "the link never came up"
        time.sleep(0.01)


def matched(side: SchedulerSide, req, computed: int) -> tuple[int, bool]:
    """The scheduler's answer once it has one: it says None ("ask again") meanwhile, as
    vLLM's scheduler asks again at its next step."""
    while True:
        answer = side.get_num_new_matched_tokens(req, computed)
        if answer[0] is not None:
            return answer
        time.sleep(0.001)


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
    assert matched(side, request("a", TOKENS), 0) == (3 * BS, False)
    # beyond vLLM's own hit only
    assert matched(side, request("b", TOKENS), BS) == (2 * BS, False)
    # a prompt of exactly the held blocks: its last token must be computed
    assert matched(side, request("c", TOKENS[:3 * BS]), 0) == (2 * BS, False)
    # another prompt, or another model's fingerprint, holds nothing
    assert matched(side, request("d", [5] + TOKENS[1:]), 0) == (0, False)
    other = SchedulerSide(ConnectorConfig.from_extra(
        {"server": side.config.server, "tenant": "sched", "model_fingerprint": "other"}),
        [SHAPE], {0: [SPEC]}, side.link, alignment=BS)
    assert matched(other, request("e", TOKENS), 0) == (0, False)
    stats = side.take_stats()
    assert stats.data["lookups"] == 4 and stats.data["lookup_errors"] == 0
    # KV that is not a function of the tokens alone is never matched (nor asked for)
    salted = Request("f", list(TOKENS), SamplingParams(max_tokens=8), None, cache_salt="s")
    assert matched(side, salted, 0) == (0, False)
    assert side.take_stats() is None


def test_a_store_that_cannot_answer_is_a_miss_at_once(down_server):
    """A server that refuses connections: the link never comes up, so every lookup is a
    miss without a call, and the engine was never kept from starting."""
    config = ConnectorConfig.from_extra({"server": down_server,
                                         "model_fingerprint": "x", "timeout_s": 1})
    client = kvtier.Client(config.server, retry=kvtier.RetryPolicy(attempts=1), timeout_s=1)
    dead = SchedulerSide(config, [SHAPE], {0: [SPEC]}, link_of(client, config), alignment=BS)
    try:
        assert dead.get_num_new_matched_tokens(request("x", TOKENS), 0) == (0, False)
        stats = dead.take_stats().data
        assert (stats["lookups"], stats["lookups_down"]) == (1, 1)
    finally:
        dead.shutdown()


def test_a_hung_server_is_asked_again_then_a_miss_by_the_deadline_then_skipped(hung_server):
    """A server that accepts connections and never answers: each lookup says "ask again"
    (None) until its deadline and is then a miss; after ``breaker_failures`` of them in a
    row the breaker is open and a lookup is a miss without being asked."""
    target = hung_server
    config = ConnectorConfig.from_extra({"server": target, "model_fingerprint": FINGERPRINT,
                                         "tenant": "sched", "lookup_timeout_ms": 50,
                                         "breaker_failures": 2, "probe_interval_s": 600})
    link = link_of(kvtier.Client(target, timeout_s=5), config)
    link.breaker.succeeded()  # it was up when the server hung
    stalled = SchedulerSide(config, [SHAPE], {0: [SPEC]}, link, alignment=BS)
    try:
        answers = []
        for i in range(2):
            req = request(f"h{i}", TOKENS)
            while (answer := stalled.get_num_new_matched_tokens(req, 0))[0] is None:
                answers.append(None)
                time.sleep(0.005)
            assert answer == (0, False)
        assert answers, "a lookup in flight was not answered None"
        assert not link.up  # two timeouts in a row opened the breaker
        started = time.monotonic()
        assert stalled.get_num_new_matched_tokens(request("h9", TOKENS), 0) == (0, False)
        asked_s = time.monotonic() - started
        stats = stalled.take_stats().data
        assert (stats["lookup_timeouts"], stats["lookups_down"]) == (2, 1)
        assert asked_s < config.lookup_timeout_ms / 1000  # answered without a call
    finally:
        stalled.shutdown()


def test_plans_load_then_save_new_full_blocks(side):
    req = request("r1", TOKENS)
    assert matched(side, req, BS) == (2 * BS, False)  # vLLM holds block 0
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
        kv_connector_worker_meta=KVTierWorkerMetadata({"r1": 3 * BS})))
    req.append_output_token_ids([111])
    meta = side.build_connector_meta(step(cached=cached_step("r1", 4 * BS, ([11],)),
                                          scheduled={"r1": 1}))
    assert [(s.first_chunk, s.block_ids) for s in meta.saves] == [(3, (10,))]
    # it finished: its saves work on copies the worker took, so no block waits for them
    assert side.request_finished(req, ([7, 8, 9, 10, 11],)) == (False, None)
    assert side.build_connector_meta(step()).delayed == []


def test_a_session_request_spills_its_next_generation(side):
    req = request("s1", TOKENS, session="stored")  # generation 1 is stored
    assert matched(side, req, 0) == (3 * BS, False)
    side.update_state_after_alloc(req, blocks(1, 2, 3, 4), 3 * BS)
    req.num_computed_tokens = 3 * BS
    side.build_connector_meta(step([NewRequestData.from_request(req, ([1, 2, 3, 4],))],
                                   scheduled={"s1": 6}))
    req.num_computed_tokens = len(TOKENS)
    req.append_output_token_ids(500)  # sampled, not yet computed
    delay, params = side.request_finished(req, ([1, 2, 3, 4],))
    assert delay and params == {"kvtier_session": "stored", "kvtier_generation": 2}
    meta = side.build_connector_meta(step())
    (spill,) = meta.spills
    assert (spill.session_id, spill.generation) == ("stored", 2)
    assert spill.token_ids == tuple(TOKENS) and spill.block_ids == (1, 2, 3, 4)
    assert meta.delayed == ["s1"]
    # a session the store does not have starts at generation 1
    new = request("s2", TOKENS[:20], session="fresh")
    matched(side, new, 0)
    side.update_state_after_alloc(new, blocks(5, 6), 0)
    new.num_computed_tokens = 20
    assert side.request_finished(new, ([5, 6],))[1] == {"kvtier_session": "fresh",
                                                     "kvtier_generation": 1}
    # a value that is no session id is ignored, never an error in the engine
    odd = Request("s3", TOKENS[:20], SamplingParams(
        max_tokens=8, extra_args={"kv_transfer_params": {"kvtier_session": 7}}), None)
    matched(side, odd, 0)
    side.update_state_after_alloc(odd, blocks(8, 9), 0)
    odd.num_computed_tokens = 20
    assert side.request_finished(odd, ([8, 9],)) == (False, None)


def test_draft_tokens_do_not_fill_a_block(side):
    """A block is saved only once the KV of accepted tokens fills it: a step's draft
    tokens may be rejected."""
    req = request("d1", TOKENS[:3 * BS + 6])
    matched(side, req, 0)
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


def test_kv_role_a_producer_never_loads_and_a_consumer_never_saves(side):
    producer = SchedulerSide(side.config, [SHAPE], {0: [SPEC]}, side.link, alignment=BS,
                             loads=False)
    assert producer.get_num_new_matched_tokens(request("p1", TOKENS), 0) == (0, False)
    assert producer.take_stats() is None  # not even asked
    consumer = SchedulerSide(side.config, [SHAPE], {0: [SPEC]}, side.link, alignment=BS,
                             saves=False)
    req = request("c1", TOKENS, session="stored")
    assert matched(consumer, req, 0) == (3 * BS, False)  # it loads
    consumer.update_state_after_alloc(req, blocks(1, 2, 3, 4), 3 * BS)
    req.num_computed_tokens = 3 * BS
    req.append_output_token_ids(list(range(100, 110)))
    consumer.build_connector_meta(step([NewRequestData.from_request(req, ([1, 2, 3, 4],))],
                                       scheduled={"c1": 6}))
    meta = consumer.build_connector_meta(step(cached=cached_step("c1", 4 * BS - 1),
                                              scheduled={"c1": 1}))
    assert meta.saves == []  # a full block, never saved
    req.num_computed_tokens = 4 * BS
    assert consumer.request_finished(req, ([1, 2, 3, 4],)) == (False, None)  # nor spilled
    assert consumer.build_connector_meta(step()).spills == []


class InstantStore:
    """A client whose every lookup answers at once, every token held."""

    def lookup(self, tenant, spec, tokens, **_) -> int:
        return len(tokens)

    def register_layout(self, spec) -> str:
        return spec.layout_id

    def close(self) -> None:
        pass


def test_a_lookup_that_answers_at_once_is_used_by_the_step_that_asked():
    config = ConnectorConfig.from_extra({"server": "127.0.0.1:1", "tenant": "sched",
                                         "model_fingerprint": FINGERPRINT,
                                         "probe_interval_s": 600})
    link = link_of(InstantStore(), config)
    link.breaker.succeeded()
    side = SchedulerSide(config, [SHAPE], {0: [SPEC]}, link, alignment=BS)
    try:
        # without the wait the asking call rarely sees the answer (4 of 20 here: the
        # lookup thread runs after it); a loaded machine may delay a few past the wait
        answers = [side.get_num_new_matched_tokens(request(f"now{i}", TOKENS), 0)
                   for i in range(20)]
        assert answers.count((3 * BS, False)) > 10
    finally:
        side.shutdown()
