"""The debugger's view of a running engine: every request's state and progress, and the KV
cache opened (``core.live_view``), read between steps as the engine moves them along."""
from __future__ import annotations

import dataclasses
import pickle

from engines.runtime.core.live_view import page_ranges
from tests.runtime.demo_engine import collect, prompts, request, run_all


def test_states_move_from_waiting_through_prefill_to_decode(make_engine, demo):
    engine = make_engine(max_num_seqs=1, prefill_chunk_size=16, num_pages=64)
    first, second = prompts(demo, 2, length=40, seed=5)
    a = request("a", first, max_tokens=6, ignore_eos=True, temperature=0.7, top_p=0.9)
    a.user = "alice"
    engine.add_request(a)
    engine.add_request(request("b", second, max_tokens=6, ignore_eos=True,
                               response_format={"type": "json_object"}))
    rows = {r.request_id: r for r in engine.live_requests().requests}
    assert [rows["a"].state, rows["b"].state] == ["waiting", "waiting"]
    assert rows["a"].user == "alice" and rows["a"].client_request_id is None
    assert (rows["a"].temperature, rows["a"].top_p) == (0.7, 0.9)
    assert rows["a"].grammar is None and rows["b"].grammar == "json_object"
    assert rows["a"].left_tokens == 40 and rows["a"].max_output_tokens == 6
    engine.step()  # a's first chunk of 16: one slot only, b waits
    rows = {r.request_id: r for r in engine.live_requests().requests}
    assert rows["a"].state == "prefilling" and rows["b"].state == "waiting"
    assert (rows["a"].computed_tokens, rows["a"].left_tokens) == (16, 24)
    assert rows["a"].kv_pages == 1 and rows["b"].kv_pages == 0
    assert rows["b"].queued_s == rows["b"].age_s  # still queued: all of its age
    while engine.live_requests().requests[0].output_tokens < 3:
        engine.step()
    row = engine.live_requests().requests[0]
    assert row.state == "decoding" and row.left_tokens == 0 and row.ttft_s is not None
    assert row.tokens_per_s is not None and row.tokens_per_s > 0
    assert row.queued_s < row.age_s
    # It crosses the process boundary as it is.
    read = engine.live_requests()
    assert pickle.loads(pickle.dumps(read)) == read


def test_a_preempted_request_says_so(make_engine, demo):
    engine = make_engine(num_pages=12, enable_prefix_cache=False)
    for req in [request(f"r{i}", p, max_tokens=24, ignore_eos=True) for i, p in enumerate(prompts(demo, 6, 30, 3))]:
        engine.add_request(req)
    seen: set[str] = set()
    while engine.has_work:
        engine.step()
        seen |= {r.state for r in engine.live_requests().requests if r.preemptions}
    assert "preempted" in seen


def test_the_live_read_is_bounded(make_engine, demo):
    engine = make_engine()
    for i, p in enumerate(prompts(demo, 5, 20, 1)):
        engine.add_request(request(f"r{i}", p))
    live = engine.live_requests(limit=2)
    assert [r.request_id for r in live.requests] == ["r0", "r1"]
    assert live.total == 5 and live.truncated


def test_kv_dump_counts_pages_entries_hits_and_evictions(make_engine, demo):
    engine = make_engine(num_pages=16, page_size=16)
    shared = prompts(demo, 1, 40, 7)[0]
    run_all(engine, [request("one", shared, max_tokens=4)])
    dump = engine.dump_kv_cache()
    assert dump.total_pages == 16 and dump.used_pages + dump.cached_pages + dump.free_pages == 16
    assert dump.cached_pages == 2 and dump.requests == []  # two full pages of 40 + 4 tokens stay
    assert [(e.tokens, e.pages, e.hits, e.held_by) for e in dump.entries] == [(32, 2, 0, 0)]
    # No text unless asked (serve --capture-text): then the entry's first page as text.
    assert dump.entries[0].first_words is None
    words = engine.dump_kv_cache(with_text=True).entries[0].first_words
    assert words == engine.tokenizer.decode(list(shared[:16])) and words
    run_all(engine, [request("two", shared, max_tokens=4)])
    dump = engine.dump_kv_cache()
    assert dump.entries[0].hits == 1 and dump.entries[0].prefix_hits == 1
    assert dump.hit_tokens == 32 and dump.hit_rate == 32 / 80
    # Fill the pool with other prompts: the cached pages go, counted.
    results: dict = {}
    for i, p in enumerate(prompts(demo, 6, 60, 8)):
        engine.add_request(request(f"x{i}", p, max_tokens=2))
    while engine.has_work:
        collect(results, engine.step())
        held = engine.dump_kv_cache().requests
        assert all(bool(h.page_ids) == (h.pages > 0) for h in held)
        assert sum(h.pages for h in held) <= 16 and (not engine.has_work or any(h.pages for h in held))
    assert engine.dump_kv_cache().evictions > 0
    assert dataclasses.asdict(engine.dump_kv_cache())["evictions"] > 0
    # The metrics carry the same count (the engine page charts it as a rate; /metrics counts it).
    assert engine.metrics.as_dict()["num_kv_evictions"] == engine.dump_kv_cache().evictions
    engine.reset()
    assert engine.dump_kv_cache().evictions == 0 and engine.dump_kv_cache().entries == []
    assert engine.kv_pool._first_tokens == {}  # an evicted or dropped prefix's tokens go with it
    assert engine.metrics.as_dict()["num_kv_evictions"] == 0


def test_page_ranges() -> None:
    assert page_ranges([]) == ""
    assert page_ranges([3]) == "3"
    assert page_ranges([0, 1, 2, 7, 9, 10]) == "0-2, 7, 9-10"
