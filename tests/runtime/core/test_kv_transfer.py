"""Disaggregated serving on two engines: one prefills and sends its K/V, the other receives it
and generates. Greedy output must be what one engine alone gives, for every split point, and
every refusal must leave the receiver's KV pool as it was."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engines.runtime.core.disagg.transfer import KVBlock, KVSend, KVTransferError, slot_segments
from engines.runtime.core.request import EngineRequestError
from tests.runtime.demo_engine import Result, collect, prompts, request, run_all

PAGE = 16  # the engines' page size (EngineConfig's default)


def send_window(prefill, rid: str, prompt: list[int], begin: int, end: int, ticket: str) -> KVBlock:
    """Run a remote_send request on ``prefill``; the block its last output carries."""
    req = request(rid, prompt)
    req.kv_send = KVSend(begin, end, ticket)
    results: dict[str, Result] = {}
    prefill.add_request(req)
    block = None
    while prefill.has_work:
        outs = prefill.step()
        collect(results, outs)
        block = next((o.kv_block for o in outs if o.kv_block is not None), block)
    assert results[rid].usage["completion_tokens"] == 0
    assert block is not None
    return block


def disaggregated(prefill, decode, rid: str, prompt: list[int], end: int, **sampling) -> Result:
    """The three MicroServing steps between two engines, as the router runs them."""
    receipt = decode.prepare_receive(rid, prompt, end)
    if receipt.prefix_matched_length < receipt.end:
        block = send_window(prefill, rid, prompt, receipt.prefix_matched_length, end, receipt.ticket)
        decode.receive_kv(block)
    gen = request(rid, prompt, **sampling)
    gen.kv_window_begin = receipt.end
    return run_all(decode, [gen])[rid]


@pytest.mark.parametrize("end", [1, 5, 15, 16, 17, 33, 39, -1, -8])
def test_greedy_output_is_one_engines_for_every_split_point(make_engine, demo, end):
    prompt = prompts(demo, 1, length=40, seed=3)[0]
    alone = run_all(make_engine(), [request("a", prompt, max_tokens=12)])["a"]
    prefill, decode = make_engine(), make_engine()
    got = disaggregated(prefill, decode, "r", prompt, end, max_tokens=12)
    assert got.tokens == alone.tokens and got.finish_reason == alone.finish_reason
    # Both pools end as they began: nothing held (cached pages are reusable, not held).
    assert prefill.kv_pool.num_used_pages == 0 and decode.kv_pool.num_used_pages == 0
    expected_prefill = len(prompt) - (end % len(prompt))
    assert got.usage["extra"]["prefill_tokens"] == expected_prefill


def test_a_prefix_hit_on_the_decode_side_shortens_the_transfer(make_engine, demo):
    shared = prompts(demo, 1, length=48, seed=5)[0]
    first, second = shared[:40] + [400, 401, 402, 403], shared[:40] + [500, 501, 502, 503]
    prefill, decode = make_engine(), make_engine()
    disaggregated(prefill, decode, "one", first, -2, max_tokens=4)
    receipt = decode.prepare_receive("two", second, -2)
    assert receipt.prefix_matched_length == 32  # two full pages of the shared 40 tokens
    block = send_window(prefill, "two", second, receipt.prefix_matched_length, receipt.end, receipt.ticket)
    assert block.begin == 32 and block.k.shape[2] == len(second) - 2 - 32
    decode.receive_kv(block)
    gen = request("two", second, max_tokens=8)
    gen.kv_window_begin = receipt.end
    got = run_all(decode, [gen])["two"]
    alone = run_all(make_engine(), [request("x", second, max_tokens=8)])["x"]
    assert got.tokens == alone.tokens


def test_a_window_the_cache_holds_needs_no_transfer(make_engine, demo):
    prompt = prompts(demo, 1, length=40, seed=7)[0]
    decode = make_engine()
    run_all(decode, [request("warm", prompt, max_tokens=2)])
    receipt = decode.prepare_receive("r", prompt, 20)
    assert receipt.prefix_matched_length == 32 >= receipt.end and receipt.segments == ()
    gen = request("r", prompt, max_tokens=6)
    gen.kv_window_begin = 20
    got = run_all(decode, [gen])["r"]
    assert got.tokens == run_all(make_engine(), [request("x", prompt, max_tokens=6)])["x"].tokens


def test_segments_name_the_reserved_slots(make_engine, demo):
    prompt = prompts(demo, 1, length=40, seed=9)[0]
    decode = make_engine()
    receipt = decode.prepare_receive("r", prompt, 35)
    pages = decode.kv_pool.pages(("kv receive", "r"))
    assert sum(n for _, n in receipt.segments) == 35
    assert list(receipt.segments) == slot_segments(pages, PAGE, 0, 35)
    assert slot_segments((3, 1), 4, 2, 7) == [(14, 2), (4, 3)]


def pool_state(engine) -> tuple[int, int, int]:
    return engine.kv_pool.num_used_pages, engine.kv_pool.num_free_pages, engine.kv_pool.num_cached_pages


@pytest.mark.parametrize("case", ["another model", "wrong window", "bad shape", "twice", "late begin"])
def test_a_refused_block_releases_the_reservation(make_engine, demo, case):
    prompt = prompts(demo, 1, length=40, seed=11)[0]
    prefill, decode = make_engine(), make_engine()
    before = pool_state(decode)
    receipt = decode.prepare_receive("r", prompt, 30)
    assert pool_state(decode) != before
    block = send_window(prefill, "r", prompt, 0, 30, receipt.ticket)
    if case == "another model":
        block.identity = dataclasses.replace(block.identity, weights="0" * 32)
    elif case == "wrong window":
        block = send_window(prefill, "r", prompt, 0, 29, receipt.ticket)
    elif case == "bad shape":
        block.k = block.k[:, :, :-1]
    elif case == "twice":
        decode.receive_kv(dataclasses.replace(block))
    elif case == "late begin":
        block = send_window(prefill, "r", prompt, 4, 30, receipt.ticket)
    with pytest.raises(KVTransferError) as err:
        decode.receive_kv(block)
    assert {"another model": "another model", "wrong window": "ends at 29", "bad shape": "shape",
            "twice": "already received", "late begin": "starts at 4"}[case] in str(err.value)
    assert "r" not in decode.kv_receiver
    if case == "twice":  # the first block's pages are committed and cached, not held
        assert decode.kv_pool.num_used_pages == 0
    else:
        assert pool_state(decode) == before


def test_stale_or_unknown_metadata_is_refused_and_keeps_the_newer_reservation(make_engine, demo):
    prompt = prompts(demo, 1, length=40, seed=13)[0]
    prefill, decode = make_engine(), make_engine()
    old = decode.prepare_receive("r", prompt, 30)
    decode.release_receive("r")
    new = decode.prepare_receive("r", prompt, 30)
    block = send_window(prefill, "r", prompt, 0, 30, old.ticket)
    with pytest.raises(KVTransferError, match="stale"):
        decode.receive_kv(block)
    assert "r" in decode.kv_receiver
    block.ticket = new.ticket
    decode.receive_kv(block)
    with pytest.raises(KVTransferError, match="no KV reservation"):
        decode.receive_kv(dataclasses.replace(block, request_id="nobody"))


def test_window_and_id_errors_change_nothing(make_engine, demo):
    prompt = prompts(demo, 1, length=20, seed=15)[0]
    decode = make_engine()
    before = pool_state(decode)
    for end, message in [(20, "Prefill the full input"), (25, "Prefill the full input"), (0, "nothing to transfer"),
                         (-20, "nothing to transfer")]:
        with pytest.raises(KVTransferError, match=message):
            decode.prepare_receive("r", prompt, end)
    assert pool_state(decode) == before and "r" not in decode.kv_receiver
    decode.prepare_receive("r", prompt, 10)
    with pytest.raises(KVTransferError, match="already has a KV reservation"):
        decode.prepare_receive("r", prompt, 10)
    req = request("s", prompt)
    req.kv_send = KVSend(10, 10, "t")
    with pytest.raises(EngineRequestError, match='"begin >= end" is not supported'):
        decode.add_request(req)


def test_start_generation_needs_its_kv_and_the_same_prompt(make_engine, demo):
    prompt = prompts(demo, 1, length=40, seed=17)[0]
    prefill, decode = make_engine(), make_engine()
    gen = request("r", prompt)
    gen.kv_window_begin = 30
    with pytest.raises(KVTransferError, match="no KV reservation"):
        decode.add_request(gen)
    receipt = decode.prepare_receive("r", prompt, 30)
    with pytest.raises(KVTransferError, match="has not arrived"):
        decode.add_request(gen)
    decode.receive_kv(send_window(prefill, "r", prompt, 0, 30, receipt.ticket))
    other = request("r", prompt[:-1] + [prompt[-1] + 1])
    other.kv_window_begin = 30
    with pytest.raises(KVTransferError, match="prompt differs"):
        decode.add_request(other)
    early = request("r", prompt)
    early.kv_window_begin = 20
    with pytest.raises(KVTransferError, match="must be 30"):
        decode.add_request(early)
    assert "r" in decode.kv_receiver  # refused start_generations leave the reservation in place
    run_all(decode, [gen])
    assert "r" not in decode.kv_receiver and decode.kv_pool.num_used_pages == 0


def test_an_unclaimed_reservation_expires(make_engine, demo):
    prompt = prompts(demo, 1, length=40, seed=19)[0]
    decode = make_engine()
    before = pool_state(decode)
    decode.prepare_receive("r", prompt, 30, timeout_s=0.0)
    decode.expire_receives()
    assert pool_state(decode) == before and "r" not in decode.kv_receiver


def test_preemption_ends_a_disaggregated_request_with_preempt(make_engine, demo):
    # A pool of 8 pages cannot hold both (5 and 7 pages at the end): the newer one, the received
    # request, is preempted.
    long_prompt, prompt = prompts(demo, 2, length=40, seed=21)
    prefill, decode = make_engine(), make_engine(num_pages=8, max_num_seqs=2)
    receipt = decode.prepare_receive("d", prompt, 30)
    decode.receive_kv(send_window(prefill, "d", prompt, 0, 30, receipt.ticket))
    gen = request("d", prompt, max_tokens=60, ignore_eos=True)
    gen.kv_window_begin = 30
    local = request("l", long_prompt, max_tokens=30, ignore_eos=True)
    results = run_all(decode, [local, gen])
    assert results["d"].finish_reason == "preempt"
    assert results["l"].finish_reason == "length"
    assert decode.kv_pool.num_used_pages == 0


def test_kv_round_trips_through_the_storage(make_engine, demo):
    engine = make_engine()
    kv = engine.kv
    rng = np.random.default_rng(0)
    pages = (5, 2, 9)
    k = rng.standard_normal((kv.num_layers, kv.k.shape[2], 37, kv.k.shape[4])).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    kv.write_tokens(pages, 3, k, v)
    k2, v2 = kv.read_tokens(pages, 3, 40)
    assert np.array_equal(k, k2) and np.array_equal(v, v2)
    assert np.array_equal(kv.k[:, 2, :, 5], k[:, :, 16 - 3 + 5])  # position 21: page 2, slot 5


def test_device_storage_reads_and_writes_windows_as_the_host_storage_does():
    """The CUDA twin (device arrays, here the simulator's): the same window in and out, the
    untouched slots of a partly written page kept."""
    from numba import cuda

    from engines.runtime.model.kv_storage import PagedKVCache

    rng = np.random.default_rng(1)
    shape = (2, 6, 2, 4, 3)  # layers, pages, kv heads, page size, head dim
    before = rng.standard_normal(shape).astype(np.float32)
    host = PagedKVCache(before.copy(), before.copy(), 2, 6, 4, "float32", "cpu")
    device = PagedKVCache(cuda.to_device(before), cuda.to_device(before), 2, 6, 4, "float32", "cuda")
    pages = (4, 1, 3)
    k = rng.standard_normal((2, 2, 7, 3)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    for cache in (host, device):
        cache.write_tokens(pages, 3, k, v)  # positions 3..9: the end of page 4, page 1, the start of page 3
    assert np.array_equal(device.k.copy_to_host(), host.k) and np.array_equal(device.v.copy_to_host(), host.v)
    assert np.array_equal(host.k[:, 4, :, :3], before[:, 4, :, :3])  # slots before the window kept
    for a, b in zip(device.read_tokens(pages, 2, 11), host.read_tokens(pages, 2, 11), strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(host.read_tokens(pages, 3, 10)[0], k)


@pytest.fixture(scope="module")
def tiny_cuda_model(tmp_path_factory):
    """The smallest Llama on the CUDA backend (the simulator here, a GPU with ENGINES_TEST_GPU=1)."""
    from engines.runtime.model.checkpoint import load_checkpoint
    from engines.runtime.model.llama import LlamaModel
    from tests.runtime.model.test_model_parity import save_tiny_checkpoint

    ckpt = load_checkpoint(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-d2d"), "llama", vocab=32, hidden=16,
                                                layers=2, tied=True, seed=4))
    return ckpt, LlamaModel.from_checkpoint(ckpt, backend="cuda")


def test_two_cuda_engines_of_one_process_hand_the_kv_over_on_the_device(tiny_cuda_model, quick_simulator_barriers):
    """KVSend(on_device=True): the block stays device arrays from the prefill engine's pages to
    the decode engine's (no host copy), and greedy output is one engine's alone."""
    from engines.runtime.core.engine import Engine, EngineConfig

    ckpt, model = tiny_cuda_model

    def engine() -> Engine:
        return Engine(model, ckpt, EngineConfig(max_num_seqs=2, num_pages=12, page_size=4, prefill_chunk_size=16))

    prompt = [1, 5, 9, 3, 7, 2, 11, 4, 6, 8]
    alone = run_all(engine(), [request("a", prompt, max_tokens=4, ignore_eos=True)])["a"]
    decode = engine()
    receipt = decode.prepare_receive("r", prompt, 7)

    def send(on_device: bool) -> KVBlock:
        prefill = engine()
        req = request("r", prompt)
        req.kv_send = KVSend(receipt.prefix_matched_length, 7, receipt.ticket, on_device=on_device)
        prefill.add_request(req)
        found = None
        while prefill.has_work:
            found = next((o.kv_block for o in prefill.step() if o.kv_block is not None), found)
        return found

    block, through_host = send(True), send(False)
    assert not isinstance(block.k, np.ndarray) and not isinstance(block.v, np.ndarray)  # device arrays
    assert isinstance(through_host.k, np.ndarray)
    assert np.array_equal(block.k.copy_to_host(), through_host.k)
    assert np.array_equal(block.v.copy_to_host(), through_host.v)
    decode.receive_kv(block)
    gen = request("r", prompt, max_tokens=4, ignore_eos=True)
    gen.kv_window_begin = 7
    got = run_all(decode, [gen])["r"]
    assert got.tokens == alone.tokens
    assert got.usage["extra"]["prefill_tokens"] == 3
