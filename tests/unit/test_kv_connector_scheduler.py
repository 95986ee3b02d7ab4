"""The connector's scheduler side with fake requests, block lists and scheduler outputs (as vLLM's
tests/v1/kv_connector/unit do): block arithmetic at block boundaries, chunked prefills, prefix reuse,
preemption re-asks, partial tail blocks, write-behind, exports and lookups that fail."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from llmesh.engine.kv_connector import ConnectorScheduler, MeshConnectorMetadata
from llmesh.wire.errors import InvalidRequest, ServiceUnavailable
from llmesh.wire.kvkeys import block_hashes, tail_hash
from llmesh.wire.messages import DurableTail

from .test_kv_connector_worker import config

SIZE = 16
FP = "00" * 16  # the fingerprint (the chain's seed: no salt, no adapter)
LAYOUT = {"num_layers": 2, "num_kv_heads": 4, "kv_heads_per_chunk": 4}
BLOCK_BYTES = 1000


@dataclass
class FakeRequest:
    """What the scheduler side reads of vLLM's `Request`."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None
    num_preemptions: int = 0
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    lora_request: Any = None
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool = False  # (vLLM sets it for prompt logprobs)
    sampling_params: Any = None
    structured_output_request: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class FakeLookup:
    """The store's answer to `stored_run` (a test double): the hashes it holds, or failing."""

    def __init__(self, held: set[str] = frozenset(), failing: bool = False):
        self.held, self.failing, self.asked = set(held), failing, 0

    def stored_run(self, hashes: list[str], layout: dict) -> int:
        self.asked += 1
        if self.failing:
            raise ServiceUnavailable("no kv-store shard is announcing itself")
        return next((i for i, h in enumerate(hashes) if h not in self.held), len(hashes))


def side(*, producer=False, consumer=False, lookup=None, **settings) -> ConnectorScheduler:
    return ConnectorScheduler(
        config(**settings),
        layout=LAYOUT,
        fingerprint=FP,
        block_size=SIZE,
        block_bytes=BLOCK_BYTES,
        producer=producer,
        consumer=consumer,
        lookup=lookup,
    )


def blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def new(request: FakeRequest, ids: list[int], computed: int = 0) -> Any:
    params = {"kv_transfer_params": request.kv_transfer_params} if request.kv_transfer_params else {}
    return SimpleNamespace(
        req_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=SimpleNamespace(extra_args=params),
        block_ids=(ids,),
        num_computed_tokens=computed,
    )


def output(
    scheduled: dict[str, int],
    new_reqs=(),
    cached: list[tuple[str, int, list[int] | None]] = (),
    resumed: set[str] = frozenset(),
) -> Any:
    """A SchedulerOutput: `scheduled` tokens by request id; `cached`: (id, computed tokens, new block ids)."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new_reqs),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            num_computed_tokens=[c[1] for c in cached],
            new_block_ids=[(c[2],) if c[2] is not None else None for c in cached],
            resumed_req_ids=set(resumed),
        ),
    )


def prompt(n: int) -> list[int]:
    return [(i * 7 + 3) % 1000 for i in range(n)]


def prefilled(n: int) -> dict[str, Any]:
    """A prefill of an `n`-token prompt on a producer, in one step: the handle it returns."""
    producer = side(producer=True, lookup=FakeLookup())
    request = FakeRequest("p", prompt(n), kv_transfer_params={"do_remote_decode": True})
    assert producer.get_num_new_matched_tokens(request, 0) == (0, False)
    ids = list(range(10, 10 + -(-n // SIZE)))
    producer.update_state_after_alloc(request, blocks(ids), 0)
    meta = producer.build_connector_meta(output({"p": n}, [new(request, ids)]))
    assert [(s.block_ids, s.wait) for s in meta.saves] == [(ids, True)]
    request.num_computed_tokens = n
    delay, handle = producer.request_finished(request, ids)
    assert not delay
    return handle


@pytest.mark.parametrize("length", [15, 16, 17, 32, 33, 47])
def test_a_decode_loads_all_but_its_last_token_at_and_around_block_boundaries(length):
    handle = prefilled(length)
    assert handle["block_hashes"] == block_hashes(FP, prompt(length), SIZE, partial=True)
    decode = side(consumer=True, lookup=FakeLookup())
    request = FakeRequest("d", prompt(length), [42], kv_transfer_params=handle)
    assert decode.get_num_new_matched_tokens(request, 0) == (length, False)  # the prompt; the new token computed
    ids = list(range(100, 100 + -(-(length + 1) // SIZE)))
    decode.update_state_after_alloc(request, blocks(ids), length)
    (load,) = decode.build_connector_meta(output({"d": 1}, [new(request, ids, length)])).loads
    loaded = -(-length // SIZE)
    assert load.block_ids == ids[:loaded] and load.hashes == handle["block_hashes"][:loaded]
    assert load.last_block_tokens == length % SIZE


def test_a_resumed_requests_grammar_accepts_its_earlier_output_once_before_its_first_step():
    from vllm import SamplingParams
    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

    from llmesh.engine.resumed import earlier_output_args

    class Grammar(StructuredOutputGrammar):  # a test double: what it was given
        def __init__(self):
            self.accepted: list[list[int]] = []

        def accept_tokens(self, request_id, tokens):
            self.accepted.append(list(tokens))
            return True

        validate_tokens = rollback = fill_bitmask = is_terminated = reset = lambda *args: None

    handle = prefilled(40)
    for earlier, grammar in ((3, Grammar()), (0, Grammar())):
        request = FakeRequest(
            f"d{earlier}",
            prompt(40 + earlier),
            kv_transfer_params=handle,
            sampling_params=SamplingParams(extra_args=earlier_output_args(earlier)),
            structured_output_request=SimpleNamespace(grammar=grammar),
        )
        decode = side(consumer=True)
        for _ in range(2):  # vLLM may ask again before it schedules the request
            decode.get_num_new_matched_tokens(request, 0)
        assert grammar.accepted == ([prompt(40 + earlier)[-earlier:]] if earlier else [])


def test_a_chunked_prefill_saves_each_full_block_as_it_is_computed_and_the_partial_tail_last():
    producer = side(producer=True, lookup=FakeLookup())
    request = FakeRequest("p", prompt(40), kv_transfer_params={"do_remote_decode": True})
    producer.get_num_new_matched_tokens(request, 0)
    ids = [7, 3, 9]
    producer.update_state_after_alloc(request, blocks(ids), 0)
    hashes = block_hashes(FP, prompt(40), SIZE, partial=True)
    steps = [
        producer.build_connector_meta(output({"p": 20}, [new(request, ids)])),
        producer.build_connector_meta(output({"p": 12}, cached=[("p", 20, None)])),
        producer.build_connector_meta(output({"p": 8}, cached=[("p", 32, None)])),
    ]
    assert [[(s.block_ids, s.hashes) for s in m.saves] for m in steps] == [
        [([7], hashes[:1])],
        [([3], hashes[1:2])],
        [([9], hashes[2:])],
    ]
    assert producer.request_finished(request, ids)[1]["block_hashes"] == hashes


def test_a_prefill_loads_the_leading_blocks_another_instance_stored_and_does_not_save_them_again():
    hashes = block_hashes(FP, prompt(40), SIZE, partial=True)
    lookup = FakeLookup(held=set(hashes[:2]))
    producer = side(producer=True, lookup=lookup)
    request = FakeRequest("p", prompt(40), kv_transfer_params={"do_remote_decode": True})
    assert producer.get_num_new_matched_tokens(request, 0) == (32, False)
    producer.update_state_after_alloc(request, blocks([4, 5, 6]), 32)
    meta = producer.build_connector_meta(output({"p": 8}, [new(request, [4, 5, 6], 32)]))
    assert [(t.block_ids, t.hashes, t.last_block_tokens) for t in meta.loads] == [([4, 5], hashes[:2], 0)]
    assert [(s.block_ids, s.hashes) for s in meta.saves] == [([6], hashes[2:])]


def test_a_prefill_asking_for_prompt_logprobs_loads_nothing_but_still_saves_its_blocks():
    """vLLM computes such a prompt whole (its logprobs need every position's logits)."""
    hashes = block_hashes(FP, prompt(40), SIZE, partial=True)
    producer = side(producer=True, lookup=FakeLookup(held=set(hashes)))
    request = FakeRequest(
        "p", prompt(40), kv_transfer_params={"do_remote_decode": True}, skip_reading_prefix_cache=True
    )
    assert producer.get_num_new_matched_tokens(request, 0) == (0, False)
    producer.update_state_after_alloc(request, blocks([4, 5, 6]), 0)
    meta = producer.build_connector_meta(output({"p": 40}, [new(request, [4, 5, 6])]))
    assert not meta.loads and [(s.block_ids, s.hashes) for s in meta.saves] == [([4, 5, 6], hashes)]


def test_a_prompt_of_whole_blocks_never_asks_to_load_its_last_token():
    """The last prompt token is always computed (vLLM needs its logits): 32 tokens find 1 block, not 2."""
    lookup = FakeLookup(held=set(block_hashes(FP, prompt(32), SIZE)))
    producer = side(producer=True, lookup=lookup)
    request = FakeRequest("p", prompt(32), kv_transfer_params={"do_remote_decode": True})
    assert producer.get_num_new_matched_tokens(request, 0) == (16, False)


def test_a_lookup_that_fails_means_computing_not_failing():
    producer = side(producer=True, lookup=FakeLookup(failing=True))
    request = FakeRequest("p", prompt(40), kv_transfer_params={"do_remote_decode": True})
    assert producer.get_num_new_matched_tokens(request, 0) == (0, False)
    # a decode without a handle asks the store for the rest: failing, it computes the prompt
    decode = side(consumer=True, lookup=FakeLookup(failing=True))
    assert decode.get_num_new_matched_tokens(FakeRequest("d", prompt(40), [1]), 0) == (0, False)


def test_a_handle_of_another_kv_layout_is_recomputed():
    handle = prefilled(33) | {"fingerprint": "ff" * 16}
    decode = side(consumer=True, lookup=FakeLookup())
    assert decode.get_num_new_matched_tokens(FakeRequest("d", prompt(33), [1], kv_transfer_params=handle), 0) == (
        0,
        False,
    )


def test_a_decode_finds_in_the_store_the_blocks_its_handle_does_not_list():
    hashes = block_hashes(FP, prompt(40), SIZE, partial=True)
    decode = side(consumer=True, lookup=FakeLookup(held=set(hashes[1:])))
    handle = {"fingerprint": FP, "block_hashes": hashes[:1]}
    assert decode.get_num_new_matched_tokens(FakeRequest("d", prompt(40), [1], kv_transfer_params=handle), 0) == (
        40,
        False,
    )


@pytest.mark.parametrize("choice, matched", [("swap", (33, False)), ("recompute", (0, False))])
def test_a_preempted_decode_resumes_by_its_choice_counted_once_however_often_vllm_asks(choice, matched):
    handle = prefilled(33)
    decode = side(consumer=True, lookup=FakeLookup(), preemption=choice)
    request = FakeRequest("d", prompt(33), [5], kv_transfer_params=handle, num_preemptions=1)
    for _ in range(3):  # vLLM asks again each step the request waits for blocks
        assert decode.get_num_new_matched_tokens(request, 0) == matched
    request.num_preemptions = 2
    decode.get_num_new_matched_tokens(request, 0)
    assert decode.request_finished(request, [])[1] == {"preemptions": {choice: 2}}


def test_auto_preemption_picks_recompute_when_loading_is_measured_slower():
    handle = prefilled(33)
    decode = side(consumer=True, lookup=FakeLookup(), load_bytes_per_s=1.0, prefill_tokens_per_s=1e6)
    request = FakeRequest("d", prompt(33), [5], kv_transfer_params=handle, num_preemptions=1)
    assert decode.get_num_new_matched_tokens(request, 0) == (0, False)
    decode.update_state_after_alloc(request, blocks([1, 2, 3]), 0)
    assert decode.build_connector_meta(output({"d": 34}, [new(request, [1, 2, 3])])).loads == []


def test_a_migrated_request_loads_its_partial_last_block_under_the_name_its_source_exported_it_by():
    tokens = prompt(40)
    hashes = block_hashes(FP, tokens[:-1], SIZE)  # the full blocks of all but the last token: 2
    tail = tail_hash("src/req/7/abcd", 2)
    decode = side(consumer=True, lookup=FakeLookup())
    request = FakeRequest(
        "d", tokens[:30], tokens[30:], kv_transfer_params={"fingerprint": FP, "block_hashes": hashes, "tail_hash": tail}
    )
    assert decode.get_num_new_matched_tokens(request, 0) == (39, False)
    decode.update_state_after_alloc(request, blocks([8, 9, 10]), 39)
    (load,) = decode.build_connector_meta(output({"d": 1}, [new(request, [8, 9, 10], 39)])).loads
    assert load.hashes == [*hashes, tail] and load.last_block_tokens == 39 % SIZE


def test_a_decode_writes_blocks_behind_as_they_fill_and_with_a_durable_tail_its_partial_block_every_step():
    decode = side(consumer=True, lookup=FakeLookup())
    handle = prefilled(20)
    request = FakeRequest("d", prompt(20), [1], kv_transfer_params=handle | {"tail_id": "t"})
    decode.get_num_new_matched_tokens(request, 0)
    decode.update_state_after_alloc(request, blocks([1, 2]), 20)
    assert decode.build_connector_meta(output({"d": 1}, [new(request, [1, 2], 20)])).saves == []  # block 1 not full

    def decode_step(token: int, new_blocks: list[int] | None = None) -> MeshConnectorMetadata:
        request.output_token_ids.append(token)
        computed = len(request.all_token_ids) - 1
        return decode.build_connector_meta(output({"d": 1}, cached=[("d", computed, new_blocks)]))

    for token in range(2, 12):
        assert decode_step(token).saves == []  # up to 31 tokens: block 1 is still partial
    (full,) = decode_step(12).saves  # 32 tokens known: block 1 is full
    assert (full.block_ids, full.wait) == ([2], False)
    assert full.hashes == block_hashes(FP, request.all_token_ids[:32], SIZE)[1:]

    asyncio.run(decode.on_control(DurableTail(tail_id="t"), memoryview(b"")))
    (tail,) = decode_step(13, new_blocks=[3]).saves  # 33 tokens: block 2's one token, under its partial hash
    assert tail.block_ids == [3]
    assert tail.hashes == block_hashes(full.hashes[0], request.all_token_ids[32:33], SIZE, partial=True)
    asyncio.run(decode.on_control(DurableTail(tail_id="t", on=False), memoryview(b"")))
    assert decode_step(14).saves == []


def test_durable_tail_for_a_request_not_decoding_here_is_refused():
    with pytest.raises(InvalidRequest, match="no request with tail id"):
        asyncio.run(side(consumer=True).on_control(DurableTail(tail_id="nobody"), memoryview(b"")))


def test_a_request_stopped_for_a_migration_exports_its_unsaved_blocks_and_its_last_two_as_tails():
    decode = side(consumer=True, write_behind=False, lookup=FakeLookup())
    tokens = prompt(50)
    request = FakeRequest(
        "d",
        tokens[:20],
        tokens[20:],
        kv_transfer_params={"tail_id": "src/d/30/x"},
        num_computed_tokens=49,
        status=RequestStatus.FINISHED_ABORTED,
    )
    delay, _ = decode.request_finished(request, [4, 5, 6, 7])
    assert delay  # its blocks stay until the export is done (`get_finished` reports it sent)
    (export,) = decode.build_connector_meta(output({})).exports
    full = block_hashes(FP, tokens[:48], SIZE)  # 3 full blocks; decode found 1 stored (all but its last prompt token)
    assert export.block_ids == [5, 6, 6, 7]
    assert export.hashes == [*full[1:], tail_hash("src/d/30/x", 2), tail_hash("src/d/30/x", 3)]


def test_a_request_that_simply_finishes_exports_nothing():
    decode = side(consumer=True, lookup=FakeLookup())
    request = FakeRequest("d", prompt(20), [1, 2], num_computed_tokens=21, status=RequestStatus.FINISHED_STOPPED)
    assert decode.request_finished(request, [1, 2]) == (False, None)
    assert decode.build_connector_meta(output({})).exports == []
