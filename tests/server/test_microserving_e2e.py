"""MicroServing across two ``manage.py serve`` processes on loopback: the prefill server streams
the K/V over HTTP to the decode engine's own K/V listener. The decode server's engine runs in its own process, the
prefill server's on a thread, so both engine modes send and receive. Both take one API key."""
from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from engines.protocol.microserving import KVAppendMetadata
from engines.runtime.core.disagg.kv_http import KV_TRANSFER_PATH
from tests.processes import Server, start_server

pytestmark = pytest.mark.slow

KEY = "cluster-key"
PROMPT = list(range(300, 352))  # 52 plain tokens
SERVE = ["--model", "demo", "--enable-debug", "--enable-tracing", "--backend", "cpu", "--max-num-seqs", "4",
         "--max-total-tokens", "1024", "--prefill-chunk-size", "64"]
_ids = itertools.count()


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[tuple[Server, Server]]:
    decode = start_server(SERVE, tmp_path_factory.mktemp("decode"), api_key=KEY)
    prefill = start_server([*SERVE, "--engine-mode", "thread"], tmp_path_factory.mktemp("prefill"), api_key=KEY)
    yield prefill, decode
    prefill.stop()
    decode.stop()


@pytest.fixture(scope="module")
def router(servers, tmp_path_factory) -> Iterator[Server]:
    prefill, decode = servers
    srv = start_server(["--router", "disagg", "--prefill-url", prefill.base, "--decode-url", decode.base],
                       tmp_path_factory.mktemp("router"), api_key=KEY)
    yield srv
    srv.stop()


def body(user: str, **extra) -> dict:
    return {"model": "demo", "prompt": PROMPT, "user": user, "max_tokens": 12, "temperature": 0, **extra}


def run_disaggregated(prefill: Server, decode: Server, end: int, stream: bool = False) -> dict | str:
    user = f"e2e-{next(_ids)}"
    prep = decode.http.post("/microserving/prep_recv", json=body(user, end=end))
    assert prep.status_code == 200, prep.text
    matched = prep.json()["prefix_matched_length"]
    if matched < end % len(PROMPT):
        send = prefill.http.post("/microserving/remote_send", json=body(
            user, begin=matched, end=end, kv_addr_info=prep.json()["kv_append_metadata"], recv_rank=0))
        assert send.status_code == 200 and send.json() == {}, send.text
    reply = decode.http.post("/microserving/start_generate", json=body(user, begin=end % len(PROMPT), stream=stream))
    assert reply.status_code == 200, reply.text
    return reply.text if stream else reply.json()


def kv_pages_used(server: Server) -> float:
    return server.http.post("/debug/dump_engine_metrics", json={"model": "demo"}).json()["metrics"]["kv_pages_used"]


@pytest.mark.parametrize("end", [1, 16, 31, 51, -1, -20])
def test_output_across_processes_is_one_engines(servers, end):
    prefill, decode = servers
    decode.http.post("/debug/reset_engine", json={"model": "demo"})
    alone = prefill.http.post("/v1/completions", json=body(f"alone-{next(_ids)}")).json()["choices"][0]["text"]
    got = run_disaggregated(prefill, decode, end)
    assert got["choices"][0]["text"] == alone
    assert kv_pages_used(decode) == 0 and kv_pages_used(prefill) == 0


def test_a_refused_transfer_frees_the_receivers_pages(servers):
    prefill, decode = servers
    decode.http.post("/debug/reset_engine", json={"model": "demo"})
    user = f"e2e-{next(_ids)}"
    prep = decode.http.post("/microserving/prep_recv", json=body(user, end=40))
    assert kv_pages_used(decode) > 0
    # A window the prefill engine refuses: the receiver is told to let its pages go.
    send = prefill.http.post("/microserving/remote_send", json=body(
        user, begin=40, end=40, kv_addr_info=prep.json()["kv_append_metadata"]))
    assert send.status_code == 400 and "begin >= end" in send.json()["message"]
    assert kv_pages_used(decode) == 0
    # Sent with the wrong key: the receiving engine's listener refuses the transfer itself.
    kv_url = KVAppendMetadata.decode(prep.json()["kv_append_metadata"]).receiver.kv_url
    wrong = httpx.post(kv_url + KV_TRANSFER_PATH, content=b"KVXFER",
                       headers={"Authorization": "Bearer nope", "Content-Type": "application/octet-stream"})
    assert wrong.status_code == 401 and "API key" in wrong.json()["message"]


def test_the_traces_show_the_hand_off(servers):
    prefill, decode = servers
    for server in servers:
        server.http.post("/debug/reset_engine", json={"model": "demo", "clear_trace": True})
    run_disaggregated(prefill, decode, -1)
    names = {}
    for side, server in (("prefill", prefill), ("decode", decode)):
        events = server.http.post("/debug/dump_event_trace", json={"model": "demo"}).json()
        events = events["traceEvents"] if isinstance(events, dict) else events
        names[side] = {re.sub(r" \(\d+\)$", "", e.get("name", "")) for e in events}  # "prefill (0)": a span
    # Chrome trace spans are named without their start/finish words.
    assert {"prefill", "kv send", "kv transfer"} <= names["prefill"], names["prefill"]
    assert {"prepare receive", "receive kv", "adopt received kv", "prefill"} <= names["decode"], names["decode"]


def test_the_router_serves_the_openai_client_unchanged(servers, router):
    prefill, decode = servers
    decode.http.post("/debug/reset_engine", json={"model": "demo", "clear_trace": True})
    assert [m.id for m in router.openai.models.list()] == ["demo"]
    params = dict(model="demo", max_tokens=12, temperature=0)
    alone = prefill.openai.completions.create(prompt=PROMPT, **params).choices[0].text
    got = router.openai.completions.create(prompt=PROMPT, **params)
    assert got.choices[0].text == alone and got.usage.completion_tokens == 12
    stream = router.openai.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True},
                                              **params)
    assert "".join(c.choices[0].text for c in stream if c.choices) == alone
    messages = [{"role": "user", "content": "Tell me about lighthouses."}]
    chat_alone = prefill.openai.chat.completions.create(messages=messages, **params).choices[0].message.content
    chat = router.openai.chat.completions.create(messages=messages, **params)
    assert chat.choices[0].message.content == chat_alone
    chunks = router.openai.chat.completions.create(messages=messages, stream=True, **params)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_alone
    assert kv_pages_used(decode) == 0 and kv_pages_used(prefill) == 0
    # All four went through MicroServing: the decode engine adopted received K/V for each.
    events = decode.http.post("/debug/dump_event_trace", json={"model": "demo"}).json()
    adopted = [e for e in events["traceEvents"] if e.get("name") == "adopt received kv"]
    assert len(adopted) == 4


def test_the_router_passes_errors_through(router):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        router.openai.completions.create(model="demo", prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="is not served"):
        router.openai.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{router.base}/v1", api_key="wrong", max_retries=0).models.list()



def test_one_request_id_names_the_request_on_the_router_and_both_servers(servers, router):
    prefill, decode = servers
    for server in servers:
        server.http.post("/debug/reset_engine", json={"model": "demo", "clear_trace": True})
    raw = router.openai.completions.with_raw_response.create(model="demo", prompt=PROMPT, max_tokens=4,
                                                             extra_headers={"X-Request-Id": "e2e-rid-7"})
    assert raw.headers["x-request-id"] == "e2e-rid-7" and raw.parse().usage.completion_tokens == 4
    for server in servers:  # without a user, each engine's lane is named after it (plus the router's suffixes)
        trace = server.http.post("/debug/dump_event_trace", json={"model": "demo"}).text
        assert '"e2e-rid-7-' in trace, server.base
    minted = router.http.post("/v1/completions", json={"model": "demo", "prompt": PROMPT, "max_tokens": 2})
    assert minted.status_code == 200 and minted.headers["x-request-id"].startswith("disagg-")


def test_the_router_relays_tokenize_and_detokenize(servers, router):
    _, decode = servers
    prompt = {"model": "demo", "prompt": "Tell me about lighthouses."}
    direct = decode.http.post("/tokenize", json=prompt).json()
    routed = router.http.post("/tokenize", json=prompt, headers={"X-Request-Id": "e2e-tok"})
    assert routed.status_code == 200 and routed.json() == direct and routed.headers["x-request-id"] == "e2e-tok"
    back = router.http.post("/detokenize", json={"model": "demo", "tokens": direct["tokens"]})
    assert back.status_code == 200
    assert back.json() == decode.http.post("/detokenize", json={"model": "demo", "tokens": direct["tokens"]}).json()
    refused = router.http.post("/detokenize", json={"model": "demo", "tokens": [10**9]})
    assert refused.status_code == 400 and refused.json()["param"] == "tokens"
    unknown = router.http.post("/tokenize", json={"model": "nope", "prompt": "hi"})
    assert unknown.status_code == 404 and unknown.json()["object"] == "error"
