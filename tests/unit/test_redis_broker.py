"""What the Redis broker does beyond the shared contract, on a real redis-server and
without a model: leases and crash recovery (XAUTOCLAIM, replay without duplicates,
worker_lost, dead letters), hand-back, aborts from another gateway, resume on another
gateway, queue positions, that a finished request leaves nothing but expiring keys, that
a published tokenizer is read within its cap, and that Redis URLs are parsed whole and
printed without their credentials.

Engines here are broker objects driven by hand: `pull` and `publish` stand for the
worker, and an engine "dies" by no longer calling `heartbeat`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import orjson
import pytest

from wsllm.broker.base import EngineInfo
from wsllm.broker.prefix_routing import summary_key
from wsllm.broker.redis import RedisBroker
from wsllm.broker.redis_conn import cluster_settings
from wsllm.broker.redis_keys import Keys
from wsllm.broker.redis_queue import counters_key, waiting_key
from wsllm.broker.replay import History, Replay
from wsllm.config_redis import RedisConfig, redacted
from wsllm.types import GenerateRequest, SamplingParams, TokenEvent, Usage
from wsllm.wire import encode

LEASE = RedisConfig(lease_s=0.6, engine_heartbeat_s=0.1, stream_retention_s=5.0, max_deliveries=2)


@pytest.fixture
def url(any_redis: Any) -> str:
    """One redis-server, then a 3-master Redis Cluster: every test here runs on both."""
    any_redis.client().flushall()
    return str(any_redis.url)


@pytest.fixture
def brokers(url: str) -> Iterator[Any]:
    made: list[RedisBroker] = []

    def make(engine_id: str | None = None, cfg: RedisConfig = LEASE) -> RedisBroker:
        b = RedisBroker(url, model="m", cfg=cfg, engine_id=engine_id)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def req(rid: str, **params: Any) -> GenerateRequest:
    p = SamplingParams(**({"max_tokens": 8, "temperature": 0.0} | params))
    return GenerateRequest(rid, [1, 2, 3], p, model="m", arrival_time=time.time())


def tokens_event(rid: str, seq: int, toks: list[int], finish: str | None = None) -> TokenEvent:
    return TokenEvent(rid, seq, toks, finish_reason=finish, usage=Usage(3, seq + 1) if finish else None)


async def read(gw: RedisBroker, rid: str, timeout: float = 10.0) -> list[TokenEvent]:
    """Events of `rid` until it ends."""
    got: list[TokenEvent] = []

    async def go() -> None:
        async for batch in gw.events():
            got.extend(e for e in batch if e.request_id == rid)
            if got and got[-1].finish_reason is not None:
                return

    await asyncio.wait_for(go(), timeout)
    return got


def pull_until(engine: RedisBroker, n: int = 1, timeout: float = 10.0) -> list[GenerateRequest]:
    deadline = time.monotonic() + timeout
    out: list[GenerateRequest] = []
    while len(out) < n:
        assert time.monotonic() < deadline, f"pulled {len(out)} of {n}"
        out += engine.pull(n - len(out), timeout=0.1)
        engine.heartbeat(EngineInfo(engine.consumer, "m", 2048))
    return out


def pull_for(engine: RedisBroker, seconds: float) -> list[GenerateRequest]:
    """Pull as a live, idle worker would (short waits, heartbeats) for `seconds`."""
    deadline = time.monotonic() + seconds
    out: list[GenerateRequest] = []
    while time.monotonic() < deadline:
        out += engine.pull(4, timeout=0.05)
        engine.heartbeat(EngineInfo(engine.consumer, "m", 2048))
    return out


def text_of(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


# -- replay (plain Python) ------------------------------------------------------------------


def test_replay_skips_what_was_sent_and_numbers_the_rest_after_it() -> None:
    history = History.of([[tokens_event("r", 0, [5]), tokens_event("r", 1, [6, 7])]])
    replay = Replay("r", history)
    out = replay.filter([tokens_event("r", 0, [5, 6])]) + replay.filter(
        [tokens_event("r", 1, [7, 8]), tokens_event("r", 2, [9], "length")]
    )
    assert [(e.seq, e.token_ids) for e in out] == [(2, [8]), (3, [9])]
    assert out[-1].finish_reason == "length" and not replay.failed


def test_replay_that_diverges_ends_with_worker_lost() -> None:
    replay = Replay("r", History.of([[tokens_event("r", 0, [5, 6])]]))
    (err,) = replay.filter([tokens_event("r", 0, [5, 9]), tokens_event("r", 1, [10])])
    assert err.finish_reason == "error" and err.error_code == "worker_lost" and replay.failed


# -- crash recovery -------------------------------------------------------------------------


def test_a_dead_engines_greedy_request_is_finished_by_another_without_gap_or_duplicate(brokers) -> None:
    gw, a, b = brokers(), brokers("engine-a"), brokers("engine-b")
    asyncio.run(gw.submit(replace(req("r1"), queue_deadline=time.time() + 0.3)))
    (r,) = pull_until(a)
    a.publish([tokens_event("r1", 0, [11]), tokens_event("r1", 1, [12])])
    # engine-a dies here: no heartbeat, no more events. engine-b is alive and idle.
    t0 = time.monotonic()
    (again,) = pull_until(b)
    assert LEASE.lease_s <= time.monotonic() - t0 < LEASE.lease_s + 3
    assert again.request_id == "r1"
    assert again.queue_deadline == 0.0  # it started once: not a waiting request past its deadline
    # It regenerates from the start (greedy: the same tokens); the client's two are skipped.
    b.publish([tokens_event("r1", 0, [11, 12])])
    b.publish([tokens_event("r1", 1, [13]), tokens_event("r1", 2, [14], "length")])
    events = asyncio.run(read(gw, "r1"))
    assert [e.seq for e in events] == [0, 1, 2, 3] and text_of(events) == [11, 12, 13, 14]
    assert events[-1].usage is not None
    # Done: its entry is acked and deleted, and its result stream expires.
    r_ = a.r
    assert r_.xlen(a.keys.queue("m")) == 0
    assert 0 < r_.pttl(a.keys.out("m", "r1")) <= LEASE.stream_retention_s * 1000


def test_an_unseeded_sampled_request_that_streamed_ends_with_worker_lost(brokers) -> None:
    gw, a, b = brokers(), brokers("engine-a"), brokers("engine-b")
    asyncio.run(gw.submit(req("r2", temperature=0.8)))
    pull_until(a)
    a.publish([tokens_event("r2", 0, [11])])
    assert pull_for(b, LEASE.lease_s + 1.0) == []  # reclaimed, and ended there
    (got_first, err) = asyncio.run(read(gw, "r2"))
    assert got_first.token_ids == [11]
    assert err.finish_reason == "error" and err.error_code == "worker_lost" and "seeded" in (err.error or "")


def test_a_request_that_streamed_nothing_is_run_again_and_dead_lettered_after_max_deliveries(brokers) -> None:
    gw = brokers()
    asyncio.run(gw.submit(req("r3", temperature=0.8)))
    for i in range(LEASE.max_deliveries):  # each engine takes it and dies silently
        assert pull_until(brokers(f"engine-{i}"))[0].request_id == "r3"
    last = brokers("engine-last")
    assert pull_for(last, LEASE.lease_s + 1.0) == []
    (err,) = asyncio.run(read(gw, "r3"))
    assert err.error_code == "worker_lost" and "dead-letter" in (err.error or "")
    (dead,) = last.r.xrange(last.keys.dead("m"))
    assert dead[1][b"reason"].startswith(b"delivered 3 times")
    assert last.r.xlen(last.keys.queue("m")) == 0


def test_a_live_engine_keeps_its_requests_past_the_lease(brokers) -> None:
    gw, a, b = brokers(), brokers("engine-a"), brokers("engine-b")
    asyncio.run(gw.submit(req("r4")))
    pull_until(a)
    deadline = time.monotonic() + LEASE.lease_s * 3
    while time.monotonic() < deadline:
        a.heartbeat(EngineInfo("engine-a", "m", 2048))  # the lease is refreshed with it
        assert b.pull(1, timeout=0.05) == []


def test_an_engine_hands_its_requests_back_and_another_resumes_them(brokers) -> None:
    gw, a, b = brokers(), brokers("engine-a"), brokers("engine-b")
    asyncio.run(gw.submit(req("r5", temperature=0.7, seed=3)))
    pull_until(a)
    a.publish([tokens_event("r5", 0, [21])])
    assert a.release(["r5"]) == []
    a.publish([TokenEvent("r5", 1, [], finish_reason="abort")])  # the worker's abort: not sent
    t0 = time.monotonic()
    (again,) = pull_until(b)
    assert time.monotonic() - t0 < 2.0, "a hand-back needs no lease to pass"
    b.publish([tokens_event("r5", 0, [21]), tokens_event("r5", 1, [22], "stop")])
    events = asyncio.run(read(gw, "r5"))
    assert [(e.seq, e.token_ids) for e in events] == [(0, [21]), (1, [22])]


def test_a_hand_back_keeps_the_request_deliveries_and_it_is_dead_lettered_past_the_max(brokers) -> None:
    """Engines that each take a request and hand it back (a drain): its delivery count
    goes on across the new queue entries, so a request that no engine can finish ends
    after `max_deliveries` instead of going round for ever."""
    gw = brokers()
    asyncio.run(gw.submit(req("r5b", temperature=0.8)))
    for i in range(LEASE.max_deliveries):
        engine = brokers(f"engine-{i}")
        assert pull_until(engine)[0].request_id == "r5b"
        assert engine.release(["r5b"]) == []
    assert pull_for(brokers("engine-last"), 1.0) == []
    (err,) = asyncio.run(read(gw, "r5b"))
    assert err.error_code == "worker_lost" and "dead-letter" in (err.error or ""), err


def test_a_request_a_stalled_engine_handed_on_is_not_handed_on_by_a_second(brokers) -> None:
    gw, a, b, c = brokers(), brokers("engine-a"), brokers("engine-b"), brokers("engine-c")
    asyncio.run(gw.submit(req("r5c")))
    pull_until(a)
    assert a.release(["r5c"], stalled=True) == []  # the first stall hands it on, marked
    pull_until(b)
    assert b.held.get("r5c").stalls == 1
    assert b.release(["r5c"], stalled=True) == ["r5c"]  # the second keeps it: the worker ends it
    assert pull_for(c, 1.0) == []  # never a third engine


def test_requests_waiting_for_an_adapter_every_engine_unloaded_are_refused_at_once(brokers) -> None:
    """A request for adapter A waits in A's set, which only A's holders take from: once an
    unload took A from every engine that answered, nothing would ever take it (it waited
    out --queue-timeout-s): it is refused then, as the memory broker's engine refuses it."""
    import threading

    from wsllm.types import AdapterCommand, AdapterReply

    gw, engine = brokers(), brokers("engine-a")
    assert engine.pull(1, timeout=0.05) == []  # it started (and from now on is full)
    engine.heartbeat(EngineInfo("engine-a", "m", 2048, adapters=["A"]))
    asyncio.run(gw.submit(replace(req("wA"), lora="A")))
    stop = threading.Event()

    def engine_loop() -> None:  # a full engine (takes nothing) that answers commands
        while not stop.is_set():
            engine.pull(0, timeout=0.05)
            engine.aborts()
            for c in engine.commands():
                engine.reply(AdapterReply(c.command_id, "engine-a"))

    t = threading.Thread(target=engine_loop, daemon=True)
    t.start()
    try:

        async def unload_then_read() -> list[TokenEvent]:
            reader = asyncio.create_task(read(gw, "wA"))
            await gw.command("m", AdapterCommand("c1", "unload", "A"), 1, 10)
            return await reader

        t0 = time.monotonic()
        (err,) = asyncio.run(unload_then_read())
        assert time.monotonic() - t0 < 5
    finally:
        stop.set()
        t.join(5)
    assert err.error_code == "invalid_request" and "'A' was unloaded" in (err.error or ""), err
    assert asyncio.run(gw.pending()) == 0


# -- aborts, resume, queue --------------------------------------------------------------------


def test_an_abort_from_another_gateway_reaches_the_engine_holding_the_request(brokers) -> None:
    gw1, gw2, engine = brokers(), brokers(), brokers("engine-a")
    asyncio.run(gw1.submit(req("r6")))
    pull_until(engine)
    asyncio.run(gw2.abort("r6"))
    # its taken entry leaves the request stream at once: were its engine gone, nothing stays
    assert engine.r.xlen(engine.keys.queue("m")) == 0
    assert engine.aborts() == ["r6"]
    assert engine.aborts() == []


def test_a_request_resumes_on_another_gateway_by_its_id(brokers) -> None:
    gw1, gw2, engine = brokers(), brokers(), brokers("engine-a")
    ctx = {"api": "ws_chat", "stops": ["\n"], "prompt_len": 3, "token_sha256": "ab"}
    asyncio.run(gw1.submit(req("r7"), context=ctx))
    pull_until(engine)
    engine.publish([tokens_event("r7", 0, [31])])
    found = asyncio.run(gw2.lookup("r7"))
    assert found is not None and found.request_id == "r7" and found.context == ctx
    assert asyncio.run(gw2.lookup("nobody")) is None

    async def resume() -> tuple[int, list[TokenEvent]]:
        attach = await gw2.follow("r7")
        reader = asyncio.create_task(read(gw2, "r7"))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(engine.publish, [tokens_event("r7", 1, [32], "stop")])
        return attach, await reader

    attach, events = asyncio.run(resume())
    assert [(e.seq, e.token_ids) for e in events] == [(0, [31]), (1, [32])]
    # The resumed request is no longer aborted when its first client's grace time ends...
    assert attach == 1 and asyncio.run(gw1.abort_unless_resumed("r7", 0)) is False
    # ...and, ended, its resume count expires with its history (it stayed for --request-ttl-s:
    # a key per resumed request left behind for an hour, bench/soak.py found)
    att = engine.keys.attached("m", "r7")
    assert 0 < engine.r.pttl(att) <= LEASE.stream_retention_s * 1000


def test_a_resume_on_the_same_gateway_gets_each_event_once_in_order(brokers) -> None:
    """Events read for the old client but not yet routed when its owner resumes on the
    same gateway do not reach the new client: it reads them, in order, from the start."""
    gw, engine = brokers(), brokers("engine-a")
    asyncio.run(gw.submit(req("r8"), context={"api": "ws_chat"}))
    pull_until(engine)

    async def go() -> list[TokenEvent]:
        events = gw.events()
        await asyncio.to_thread(engine.publish, [tokens_event("r8", 0, [31])])
        got = list(await asyncio.wait_for(anext(events), 10))  # the old client's first event
        await asyncio.to_thread(engine.publish, [tokens_event("r8", 1, [32])])
        deadline = time.monotonic() + 10
        while not gw._out.qsize():  # read for the old client, not routed yet
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await gw.follow("r8")  # the resume replaces the old client's follow
        resumed: list[TokenEvent] = []
        await asyncio.to_thread(engine.publish, [tokens_event("r8", 2, [33], "stop")])
        while not resumed or resumed[-1].finish_reason is None:
            resumed += await asyncio.wait_for(anext(events), 10)
        await events.aclose()
        return got + resumed

    events = asyncio.run(go())
    assert [(e.seq, e.token_ids) for e in events] == [(0, [31]), (0, [31]), (1, [32]), (2, [33])]


def test_a_resumed_request_is_aborted_after_its_new_client_leaves_too(brokers) -> None:
    """One resume must not turn the grace abort off for good: the client that resumed
    it leaves as well, and its own grace abort goes ahead."""
    gw1, gw2, engine = brokers(), brokers(), brokers("engine-a")
    asyncio.run(gw1.submit(req("r9"), context={"api": "ws_chat"}))
    pull_until(engine)
    attach = asyncio.run(gw2.follow("r9"))
    assert asyncio.run(gw1.abort_unless_resumed("r9", 0)) is False  # the first client's: resumed since
    assert asyncio.run(gw2.abort_unless_resumed("r9", attach)) is True  # the second client's
    assert engine.aborts() == ["r9"]


def test_queued_requests_know_their_place(brokers) -> None:
    gw, engine = brokers(), brokers("engine-a")

    async def go() -> list[int | None]:
        for i in range(3):
            await gw.submit(req(f"q{i}"))
        return [await gw.position(f"q{i}") for i in range(3)]

    assert asyncio.run(go()) == [1, 2, 3]
    pull_until(engine)
    gw.positions._read_at = 0.0  # no cached answer

    async def after() -> list[int | None]:
        return [await gw.position(f"q{i}") for i in range(1, 3)]

    assert asyncio.run(after()) == [1, 2]


def test_a_full_engine_expires_the_waiting_requests_past_their_deadline_and_only_those(brokers) -> None:
    gw, engine = brokers(), brokers("engine-a")
    now = time.time()
    asyncio.run(gw.submit(req("taken", max_tokens=1)))
    (taken,) = pull_until(engine)  # an engine runs it: past its deadline or not, it stays
    asyncio.run(gw.submit(replace(req("late"), queue_deadline=now + 0.3)))
    asyncio.run(gw.submit(req("patient")))  # no deadline
    assert asyncio.run(gw.pending()) == 2
    t0 = time.monotonic()
    while asyncio.run(gw.pending()) > 1:  # the engine is full: it pulls nothing, and sweeps
        assert time.monotonic() - t0 < 5, "the late request stayed queued"
        assert engine.pull(0, timeout=0.0) == []
        time.sleep(0.02)
    assert time.time() >= now + 0.3  # not before its deadline (the setup above may take a while)
    (ev,) = asyncio.run(read(gw, "late"))
    assert (ev.seq, ev.finish_reason, ev.error_code) == (0, "error", "queue_timeout")
    (rest,) = pull_until(engine)
    assert rest.request_id == "patient"  # the next engine with room gets the one that waits


def test_a_gap_in_a_stream_ends_the_request_instead_of_skipping_text(brokers) -> None:
    gw, engine = brokers(), brokers("engine-a")
    asyncio.run(gw.submit(req("r8")))
    pull_until(engine)
    engine.publish([tokens_event("r8", 0, [1])])
    engine.publish([tokens_event("r8", 0, [1])])  # a retried publish: dropped
    engine.publish([tokens_event("r8", 2, [3])])  # seq 1 never came
    first, err = asyncio.run(read(gw, "r8"))
    assert first.token_ids == [1] and err.error_code == "worker_lost"


def test_a_duplicated_publish_in_the_history_does_not_double_the_sent_tokens() -> None:
    """A retried publish writes one step twice; the client got it once, so a replay
    must skip it once (else it sees a mismatch and ends the request)."""
    history = History.of(
        [[tokens_event("r", 0, [5])], [tokens_event("r", 0, [5])], [tokens_event("r", 1, [6])]]
    )
    assert history.sent == {0: [5, 6]} and history.next_seq == {0: 2}
    replay = Replay("r", history)
    out = replay.filter([tokens_event("r", 0, [5, 6, 7], "length")])
    assert [(e.seq, e.token_ids, e.finish_reason) for e in out] == [(2, [7], "length")] and not replay.failed


# -- malformed entries ------------------------------------------------------------------------


def test_invalid_queue_entries_go_to_the_dead_letters_with_the_reason(brokers) -> None:
    gw, engine = brokers(), brokers("engine-a")
    r = engine.r
    q = engine.keys.queue("m")
    asyncio.run(gw.submit(req("named", max_tokens=4)))  # a gateway waits for this one
    assert r.zpopmin(waiting_key(q))  # out of the waiting set, as if taken
    r.delete(counters_key(q))  # it was the only waiting request
    good = orjson.loads(encode(req("named", max_tokens=4)))
    bad = orjson.loads(orjson.dumps(good))
    bad["item"]["params"]["top_k"] = 2**64 - 1
    r.xadd(q, {"r": orjson.dumps(bad)})  # names its request: its client is told
    for fields in ({"r": b"garbage"}, {"x": b"1"}, {"r": orjson.dumps(good | {"v": 9})}):
        r.xadd(q, fields)
    asyncio.run(gw.submit(req("fine")))
    pulled = pull_until(engine, 1)
    assert [p.request_id for p in pulled] == ["fine"]
    dead = r.xrange(engine.keys.dead("m"))
    reasons = [d[1][b"reason"].decode() for d in dead]
    assert len(dead) == 4 and all(x.startswith("invalid request entry") for x in reasons), reasons
    assert "top_k" in reasons[0] and "v" in reasons[3]
    assert r.xlen(q) == 1  # only the good request, held by the engine
    (err,) = asyncio.run(read(gw, "named"))
    assert err.error_code == "invalid_request" and "top_k" in (err.error or "")


def test_malformed_abort_entries_are_dead_lettered_once_and_aborts_go_on(brokers) -> None:
    # a lease no loaded machine outlasts here: with the 0.6 s one, a CI run once let engine b
    # reclaim r10 (idle past its lease) during this test, and b then held an abort of its own
    held = replace(LEASE, lease_s=30.0)
    gw, a, b = brokers(), brokers("engine-a", held), brokers("engine-b", held)
    r = a.r
    asyncio.run(gw.submit(req("r10")))
    pull_until(a)
    pull_for(b, 0.1)  # both engines have started reading the abort stream
    r.xadd(a.keys.aborts("m"), {"x": b"1"})
    r.xadd(a.keys.aborts("m"), {"r": b"\xff\xfe"})
    r.xadd(a.keys.aborts("m"), {"r": b"r10", "extra": b"1"})
    asyncio.run(gw.abort("r10"))
    assert a.aborts() == ["r10"] and b.aborts() == []
    dead = r.xrange(a.keys.dead("m"))
    assert len(dead) == 3 and all(d[1][b"reason"].startswith(b"invalid abort entry") for d in dead)
    assert r.xlen(a.keys.aborts("m")) == 1  # the good one stays for every engine


def test_an_unreadable_results_entry_ends_only_the_requests_it_held(brokers) -> None:
    gw, engine = brokers(), brokers("engine-a")
    asyncio.run(gw.submit(req("hurt")))
    asyncio.run(gw.submit(req("fine")))
    pull_until(engine, 2)

    async def go() -> list[TokenEvent]:
        got: list[TokenEvent] = []

        async def reader() -> None:
            async for batch in gw.events():
                got.extend(batch)
                if any(e.request_id == "fine" and e.finish_reason for e in got):
                    return

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.2)
        # Unreadable entries of the gateway's results stream (the first killed the reader
        # once): whose events they held is unknown, so they are skipped, and "hurt",
        # whose seq 0 was in them, sees the gap at its next event.
        results = engine.keys.results("m", gw.gateway_id)
        engine.r.xadd(results, {"m": b"not json"})
        engine.r.xadd(results, {"e": b'{"v":1,"kind":"events","items":[{"seq":"x"}]}'})
        await asyncio.to_thread(engine.publish, [tokens_event("fine", 0, [1]), tokens_event("hurt", 1, [2])])
        await asyncio.to_thread(engine.publish, [tokens_event("fine", 1, [3], "length")])
        await asyncio.wait_for(task, 10)
        return got

    got = asyncio.run(go())
    hurt = [e for e in got if e.request_id == "hurt"]
    assert [(e.error_code, e.finish_reason) for e in hurt] == [("worker_lost", "error")]
    assert text_of([e for e in got if e.request_id == "fine"]) == [1, 3]


def test_a_models_keys_share_one_cluster_slot_and_tenants_and_the_registry_their_own() -> None:
    from redis.crc import key_slot

    k = Keys("wsllm")
    q = k.queue("m")  # routing's keys (redis_queue, prefix_routing) are suffixes of it
    model = [q, k.out("m", "r1"), k.results("m", "gw"), k.attached("m", "r1"), k.wake("m", "gw"),
             k.dead("m"), k.tokenizer("m"), waiting_key(q), waiting_key(q, "e1"), summary_key(q, "e1"),
             k.aborts("m"), *(q + s for s in (":ze", ":n", ":nt", ":seen", ":tk", ":pfxv"))]  # fmt: skip
    slots = {key_slot(key.encode()) for key in model}
    assert len(slots) == 1
    assert len({key_slot(k.tenant("acme", w).encode()) for w in ("rpm", "tpm", "live")}) == 1
    assert len({key_slot(x.encode()) for x in (k.engines, k.engine("e1"))}) == 1
    stored = [k.response("acme", "resp_1"), k.response("acme", "resp_2"), k.responses("acme", "resps")]
    assert len({key_slot(x.encode()) for x in [*stored, k.responses("acme", "rsizes")]}) == 1
    assert key_slot(k.queue("m").encode()) != key_slot(k.queue("other").encode())  # models spread


def test_a_published_tokenizer_over_the_cap_is_not_read(brokers, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway read whatever sat in a model's tokenizer hash, whatever its size."""
    from wsllm.broker import redis_registry

    monkeypatch.setattr(redis_registry, "MAX_TOKENIZER_BYTES", 1000)
    engine, gateway = brokers("e1"), brokers()
    engine.publish_tokenizer("m", {"tokenizer.json": b"{" + bytes(500) + b"}", "notes.txt": b"x"})
    assert asyncio.run(gateway.tokenizer_files("m")) == {"tokenizer.json": b"{" + bytes(500) + b"}"}
    engine.publish_tokenizer("m", {"tokenizer.json": bytes(2000)})
    assert asyncio.run(gateway.tokenizer_files("m")) is None


def test_an_engine_that_starts_again_does_not_write_the_same_tokenizer_again(brokers, any_redis: Any) -> None:
    """A tokenizer is megabytes (SmolLM2's: 3.4 MB): written again at every engine restart,
    Redis's resident memory jumped with each; the same files are only touched."""
    files = {"tokenizer.json": b"{" + bytes(5000) + b"}", "tokenizer_config.json": b"{}"}
    brokers("e1").publish_tokenizer("m", files)
    r = any_redis.client()
    before = command_stats(r).get("cmdstat_hset", 0)
    brokers("e2").publish_tokenizer("m", files)  # a restart: the same files
    assert command_stats(r).get("cmdstat_hset", 0) == before
    assert asyncio.run(brokers().tokenizer_files("m")) == files
    brokers("e3").publish_tokenizer("m", files | {"tokenizer.json": b"{}"})  # new files: written
    assert asyncio.run(brokers().tokenizer_files("m")) == files | {"tokenizer.json": b"{}"}


def test_a_cluster_url_names_its_nodes_and_credentials() -> None:
    nodes, opts = cluster_settings("rediss+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2:7001/0")
    assert nodes == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert opts == {"username": "u", "password": "p@ss", "ssl": True}
    with pytest.raises(ValueError, match="database 0"):
        cluster_settings("redis+cluster://h:7000/2")
    with pytest.raises(ValueError, match="host:port"):
        cluster_settings("redis+cluster://h")


def test_a_cluster_urls_options_are_used_or_refused_never_dropped() -> None:
    """`?ssl_ca_certs=` was ignored: the cluster client dropped options it did not know."""
    url = "rediss+cluster://h:7000?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required&ssl_check_hostname=false"
    nodes, opts = cluster_settings(url)
    assert nodes == [("h", 7000)]
    assert opts == {
        "ssl": True,
        "ssl_ca_certs": "/etc/ca.pem",
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": False,
    }
    with pytest.raises(ValueError, match="'max_connections' is not one"):
        cluster_settings("redis+cluster://h:7000?max_connections=3")
    with pytest.raises(ValueError, match="needs TLS"):
        cluster_settings("redis+cluster://h:7000?ssl_ca_certs=/etc/ca.pem")
    with pytest.raises(ValueError, match="ssl_cert_reqs: one of none, optional, required"):
        cluster_settings("rediss+cluster://h:7000?ssl_cert_reqs=maybe")


def test_no_message_names_the_redis_password() -> None:
    secret = "hunter2"
    for bad in (f"redis+cluster://u:{secret}@h", f"rediss+cluster://{secret}@h:7000?bogus=1"):
        with pytest.raises(ValueError) as e:
            cluster_settings(bad)
        assert secret not in str(e.value), e.value
    with pytest.raises(ValueError) as e:
        RedisConfig(broker=f"redis//u:{secret}@h:6379")  # a typo: not a Redis URL
    assert secret not in str(e.value)
    url = f"rediss://u:{secret}@h:6379/0?password={secret}&ssl_ca_certs=/ca.pem"
    assert redacted(url) == "rediss://***@h:6379/0?password=***&ssl_ca_certs=/ca.pem"
    assert redacted("redis://h:6379/0") == "redis://h:6379/0"


def command_stats(r: Any) -> dict[str, int]:
    """Calls per command Redis ran, summed over every primary of a cluster."""
    nodes = r.get_primaries() if hasattr(r, "get_primaries") else [None]
    out: dict[str, int] = {}
    for node in nodes:
        stats = r.info("commandstats", **({"target_nodes": node} if node is not None else {}))
        for k, v in stats.items():
            out[k] = out.get(k, 0) + int(v["calls"])
    return out


def test_a_step_of_many_requests_costs_a_few_commands(brokers, any_redis: Any) -> None:
    """One XADD per gateway per step, whatever the number of requests in it; a request's
    own stream gets its events only every history_flush_s (and they still reach a resume).
    On a cluster the client finds an XREAD's keys itself (no COMMAND GETKEYS)."""
    gw, engine = brokers(), brokers("engine-a")
    for i in range(16):
        asyncio.run(gw.submit(req(f"s{i}")))
    pull_until(engine, 16)
    r = any_redis.client()

    def calls() -> tuple[int, int]:
        """Commands Redis ran, INFO and the cluster's own (CLUSTER, HELLO) aside; and the
        routing look-ups of a cluster client (COMMAND GETKEYS)."""
        stats = command_stats(r)
        own = ("cmdstat_info", "cmdstat_command", "cmdstat_hello", "cmdstat_cluster")
        getkeys = sum(n for k, n in stats.items() if k.startswith("cmdstat_command|getkeys"))
        return sum(n for k, n in stats.items() if not k.startswith(own)), getkeys

    engine.publish([tokens_event(f"s{i}", 0, [5]) for i in range(16)])  # the results stream's TTL
    before, getkeys = calls()
    for seq in (1, 2, 3):
        engine.publish([tokens_event(f"s{i}", seq, [5 + seq]) for i in range(16)])
    after, getkeys_after = calls()
    assert after - before <= 3 + 1  # per step: the results XADD (the aborts are read by the pull)
    assert getkeys_after == getkeys
    engine.publish([tokens_event(f"s{i}", 4, [9], "length") for i in range(16)])
    gw2 = brokers()
    assert asyncio.run(gw2.lookup("s3")) is not None
    asyncio.run(gw2.follow("s3"))
    assert text_of(asyncio.run(read(gw2, "s3"))) == [5, 6, 7, 8, 9]  # nothing in its history yet


def test_submit_and_take_cost_a_few_commands_whatever_the_queue_holds(brokers, any_redis: Any) -> None:
    """A submit reads and writes the queue's counters instead of counting its entries,
    so it costs the same with 40 requests of 20 tenants waiting as with none; one take
    pops a whole batch (a few commands, and one XADD per request into the request
    stream)."""
    gw, engine = brokers(), brokers("engine-a")
    r = any_redis.client()
    pull_for(engine, 0.05)  # started: its group and cursors exist

    def calls() -> int:
        own = ("cmdstat_info", "cmdstat_command", "cmdstat_hello", "cmdstat_cluster")
        return sum(n for k, n in command_stats(r).items() if not k.startswith(own))

    def submit_cost(rid: str, tenant: str) -> int:
        before = calls()
        asyncio.run(gw.submit(replace(req(rid), tenant=tenant)))
        return calls() - before

    first = submit_cost("first", "t0")
    for i in range(40):
        asyncio.run(gw.submit(replace(req(f"w{i}"), tenant=f"t{i % 20}")))
    late = submit_cost("late", "t7")
    assert first <= 8 and late <= first, (first, late)  # the routing read, the script and its 6
    before = calls()
    got = engine.pull(42, timeout=1.0)
    took = calls() - before
    assert len(got) == 42 and took <= 42 + 16, took
    assert [g.request_id for g in got][:3] == ["first", "w1", "w2"]  # one turn per tenant


def test_concurrent_callers_share_one_registry_read(brokers, any_redis: Any) -> None:
    """Requests admitted while the registry read is in flight wait for it instead of
    each starting one (a slow Redis would get more reads the slower it answers)."""
    gw, engine = brokers(), brokers("engine-a")
    engine.heartbeat(EngineInfo(engine_id="engine-a", model="m", max_model_len=64))
    r = any_redis.client()

    def scripts() -> int:
        stats = command_stats(r)
        return sum(n for k, n in stats.items() if k.startswith(("cmdstat_eval", "cmdstat_evalsha")))

    async def many() -> list[list[EngineInfo]]:
        gw.invalidate_engines()
        return await asyncio.gather(*(gw.engines() for _ in range(20)))

    before = scripts()
    got = asyncio.run(many())
    assert scripts() - before == 1
    assert all([i.engine_id for i in g] == ["engine-a"] for g in got)
