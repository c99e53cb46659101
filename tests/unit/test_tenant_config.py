"""Tenants and the in-memory limiter, without a server: the keys file is checked at
start with a message that names the tenant and the field; the token buckets refill
continuously, refuse atomically and refund; a charge is set right after tokenizing
(taken, given back, or a debt), the coarse estimate is not far below the tokens of dense text or
prompt logprobs, an estimate over the bucket takes the whole bucket (so
concurrent ones cannot each leave a debt), and one over the whole bucket is a 429; leases end with
`release`, and a request's own lease does not count against its resume."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from wsllm.broker.limits import Limits, MemoryLimiter
from wsllm.config_gateway import GatewayConfig
from wsllm.server.errors import APIError
from wsllm.server.quota import _duration, admit, ratelimit_headers
from wsllm.server.tenants import ANONYMOUS_TENANT, DEFAULT_TENANT, Tenant, Tenants, anonymous_tenant

GOOD = """
[tenants.alice]
keys = ["sk-alice-1", "sk-alice-2"]
rpm = 60
tpm = 20000
max_concurrent = 4
max_priority = 10
models = ["*"]

[tenants.bob]
keys = ["sk-bob"]
models = ["tiny-*"]

[tenants.ops]
keys = ["sk-ops"]
roles = ["metrics"]
cache_salt = "team"
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return str(path)


def test_a_keys_file_names_tenants_by_key(tmp_path: Path) -> None:
    tenants = Tenants.from_settings(None, write(tmp_path, GOOD))
    assert tenants is not None
    alice = tenants.authenticate("sk-alice-2")
    assert alice is not None and alice.name == "alice"
    assert alice.limits == Limits(rpm=60, tpm=20000, max_concurrent=4) and alice.max_priority == 10
    bob = tenants.authenticate("sk-bob")
    assert bob is not None and bob.limits.unlimited  # every limit is optional
    assert bob.may_use("tiny-llama") and not bob.may_use("big-model")
    assert tenants.authenticate("sk-alice") is None and tenants.authenticate("") is None
    ops = tenants.authenticate("sk-ops")
    assert ops is not None and ops.operator and not alice.operator and not bob.operator
    # each tenant's prefix cache is its own; the file may give tenants one salt on purpose
    spaces = {alice.cache_namespace(), bob.cache_namespace(), ops.cache_namespace(), bob.cache_namespace("x")}
    assert len(spaces) == 4 and ops.cache_namespace() == "salt:team"


def test_api_key_alone_is_one_unlimited_tenant_and_no_key_is_none(tmp_path: Path) -> None:
    tenants = Tenants.from_settings("k", None)
    assert tenants is not None
    t = tenants.authenticate("k")
    assert t is not None and t.name == DEFAULT_TENANT and t.limits.unlimited
    assert Tenants.from_settings(None, None) is None
    both = Tenants.from_settings("k", write(tmp_path, GOOD))
    assert both is not None and {"alice", "bob", "ops", DEFAULT_TENANT} == set(both.by_name)
    assert t.operator  # the operator's own key sees every tenant on /metrics


def test_the_anonymous_tenant_is_limited_by_default_and_settable() -> None:
    cfg = GatewayConfig()
    anon = anonymous_tenant(cfg.anonymous_rpm, cfg.anonymous_tpm, cfg.anonymous_max_concurrent)
    assert anon.name == ANONYMOUS_TENANT and not anon.limits.unlimited
    assert None not in (anon.limits.rpm, anon.limits.tpm, anon.limits.max_concurrent)
    assert anonymous_tenant(0, 0, 0).limits.unlimited  # 0: no limit
    assert anonymous_tenant(5, 0, 2).limits == Limits(rpm=5, max_concurrent=2)
    with pytest.raises(ValueError, match="anonymous_rpm"):
        GatewayConfig(anonymous_rpm=-1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tenants.alice]\nrpm = 3\n", "tenant 'alice': keys: required"),
        ('[tenants.alice]\nkeys = ["a"]\nrpm = 0\n', "tenant 'alice': rpm: must be an integer >= 1, got 0"),
        ('[tenants.alice]\nkeys = ["a"]\ntpm = "lots"\n', "tenant 'alice': tpm: must be an integer"),
        ('[tenants.alice]\nkeys = ["a"]\nmax_concurrent = true\n', "tenant 'alice': max_concurrent"),
        ('[tenants.alice]\nkeys = ["a"]\nrmp = 3\n', "tenant 'alice': unknown field(s) ['rmp']"),
        ('[tenants.alice]\nkeys = ["a"]\nmodels = []\n', "tenant 'alice': models:"),
        ('[tenants.alice]\nkeys = ["a"]\nroles = ["admin"]\n', "tenant 'alice': roles: a list of 'metrics'"),
        ('[tenants.alice]\nkeys = ["a"]\ncache_salt = ""\n', "tenant 'alice': cache_salt: 1 to 256"),
        ('[tenants.alice]\nkeys = ["a"]\ncache_salt = "a\\u001fb"\n', "tenant 'alice': cache_salt:"),
        ('[tenants.a]\nkeys = ["x"]\n[tenants.b]\nkeys = ["x"]\n', "tenant 'b': a key of its keys is also"),
        ('[tenants."a b"]\nkeys = ["x"]\n', "tenant 'a b': a name is"),
        ("[tenants]\n", "no tenants"),
        ('[tenant.alice]\nkeys = ["a"]\n', "unknown top-level key(s) ['tenant']"),
        ("[tenants.alice\n", "not valid TOML"),
    ],
)
def test_a_bad_keys_file_fails_with_a_message_naming_the_tenant_and_field(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as e:
        Tenants.from_settings(None, path)
    assert message in str(e.value) and path in str(e.value)


def test_the_api_key_may_not_clash_with_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="also a key of a tenant"):
        Tenants.from_settings("sk-bob", write(tmp_path, GOOD))
    with pytest.raises(ValueError, match="cannot read it"):
        Tenants.from_settings(None, str(tmp_path / "missing.toml"))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_buckets_refill_continuously_and_refuse_atomically() -> None:
    clock = Clock()
    lim = MemoryLimiter(clock)
    limits = Limits(rpm=2, tpm=100)

    async def go() -> None:
        a = await lim.acquire("t", limits, "r1", 60)
        assert a.allowed and a.charged == 60 and a.remaining_requests == 1 and a.remaining_tokens == 40
        assert a.reset_tokens_s == pytest.approx(36.0)  # 60 tokens at 100 per minute
        b = await lim.acquire("t", limits, "r2", 60)  # the tokens are short: nothing is taken
        assert not b.allowed and b.reason == "tokens" and b.retry_after_s == pytest.approx(12.0)
        assert b.remaining_requests == 1 and b.remaining_tokens == 40
        clock.t += 12.0  # 20 tokens and 0.4 requests later
        assert (await lim.acquire("t", limits, "r3", 60)).allowed
        c = await lim.acquire("t", limits, "r4", 1)
        assert not c.allowed and c.reason == "requests" and c.retry_after_s == pytest.approx(30 - 0.4 * 30)

    asyncio.run(go())


def test_a_charge_is_refined_after_tokenizing_and_one_over_the_bucket_is_refused() -> None:
    clock = Clock()
    lim = MemoryLimiter(clock)
    tenant = Tenant("t", Limits(tpm=100))

    async def left() -> int | None:
        return (await lim.usage("t", tenant.limits)).remaining_tokens

    async def go() -> None:
        with pytest.raises(APIError) as e:  # more than the whole bucket: it could never pass
            await admit(lim, tenant, "r0", 500)
        assert e.value.status == 429 and "500 tokens" in e.value.message and "never pass" in e.value.message
        assert await left() == 100  # nothing taken
        coarse = await admit(lim, tenant, "r1", 40)  # the estimate, before tokenizing
        await coarse.refine(70)  # the exact charge: 30 more
        assert await left() == 30
        await coarse.refine(20)  # or less: given back
        assert await left() == 80
        await coarse.release(10)  # used 10 of its 20
        assert await left() == 90
        ticket = await admit(lim, tenant, "r2", 90)
        await ticket.refine(100)  # the estimate was short: the bucket owes 10
        assert await left() == -10
        waits = await lim.acquire("t", tenant.limits, "r3", 1)  # the next one waits the debt out
        assert not waits.allowed and waits.retry_after_s == pytest.approx(11 * 60 / 100)
        with pytest.raises(APIError, match="never pass"):
            await ticket.refine(101)
        await ticket.release(0)
        assert await left() == 90  # all of it back, and never past the capacity
        await lim.release("t", tenant.limits, "r9", refund=1000)
        assert await left() == 100
        # An estimate over the bucket is not "never": only what the charge is at least.
        with pytest.raises(APIError, match="never pass"):
            await admit(lim, tenant, "r4", 1200, least=101)
        guess = await admit(lim, tenant, "r4", 1200, least=10)  # takes the whole bucket for now
        assert await left() == 0
        await guess.refine(63)  # the prompt was a run of "=": few tokens for its bytes
        assert await left() == 37

    asyncio.run(go())


def test_estimates_over_the_tpm_cannot_drive_the_bucket_into_debt_once_per_request() -> None:
    """tpm 1,000, 8 requests at once whose estimate is over it and whose least is 1
    (no max_tokens): each came in on 1 token, and their exact charges (832 each) left the
    bucket at -5,656. The first takes the whole bucket; the others wait for it."""
    lim = MemoryLimiter(Clock())
    tenant = Tenant("t", Limits(tpm=1000))

    async def go() -> list[int]:
        admitted, refused = [], 0
        for i in range(8):
            try:
                admitted.append(await admit(lim, tenant, f"r{i}", 1500, least=1))
            except APIError as e:
                assert e.status == 429 and e.code == "rate_limited"
                refused += 1
        for ticket in admitted:
            await ticket.refine(832)
        level = (await lim.usage("t", tenant.limits)).remaining_tokens
        return [len(admitted), refused, level or 0]

    assert asyncio.run(go()) == [1, 7, 1000 - 832]


def test_a_requests_own_lease_does_not_count_against_its_resume() -> None:
    lim = MemoryLimiter(Clock())
    limits = Limits(max_concurrent=1)

    async def go() -> None:
        assert (await lim.acquire("t", limits, "a", 0)).allowed
        assert not (await lim.acquire("t", limits, "b", 0)).allowed
        assert (await lim.acquire("t", limits, "a", 0)).allowed  # a resume of "a"
        assert lim.in_flight("t") == 1

    asyncio.run(go())


def test_concurrency_leases_end_with_release() -> None:
    lim = MemoryLimiter(Clock())
    limits = Limits(max_concurrent=2)

    async def go() -> None:
        assert (await lim.acquire("t", limits, "a", 1)).allowed
        assert (await lim.acquire("t", limits, "b", 1)).allowed
        refused = await lim.acquire("t", limits, "c", 1)
        assert not refused.allowed and refused.reason == "concurrent" and refused.retry_after_s >= 1
        assert (await lim.acquire("other", limits, "c", 1)).allowed  # tenants do not share
        await lim.release("t", limits, "a", 0)
        await lim.release("t", limits, "a", 0)  # twice is harmless
        assert (await lim.acquire("t", limits, "c", 1)).allowed
        assert lim.in_flight("t") == 2

    asyncio.run(go())


def test_headers_follow_openai() -> None:
    assert [_duration(x) for x in (0.2491, 1.0, 12.2, 90.0)] == ["250ms", "1s", "13s", "1m30s"]
    lim = MemoryLimiter(Clock())
    tenant = Tenant("t", Limits(rpm=10, tpm=1000))
    d = asyncio.run(lim.acquire("t", tenant.limits, "r", 100))
    assert ratelimit_headers(tenant, d) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "6s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "900",
        "x-ratelimit-reset-tokens": "6s",
    }
    assert ratelimit_headers(Tenant("u"), d) == {}


@pytest.mark.parametrize(
    "text",
    [
        "the quick brown fox jumps over the lazy dog " * 40,
        "31415926535897932384626433" * 60,
        "数据库的设计" * 80,
    ],
)
def test_the_coarse_charge_is_not_below_what_the_text_tokenizes_to(smollm_dir: Path, text: str) -> None:
    """Before tokenizing, a prompt is charged from its text: dense text (digits, which the
    usual tokenizers split one by one; CJK) is not charged a quarter of its tokens, and
    prompt logprobs (a second pass over the prompt, the exact charge's too) count twice."""
    from tokenizers import Tokenizer

    from wsllm.server.quota import coarse_charge, exact_charge
    from wsllm.server.schemas import CompletionRequest
    from wsllm.types import SamplingParams

    tokens = len(Tokenizer.from_file(str(smollm_dir / "tokenizer.json")).encode(text).ids)
    plain = coarse_charge(CompletionRequest(prompt=text, max_tokens=1), 16).estimate
    assert tokens + 1 <= plain <= 2 * tokens + 1, (tokens, plain)
    with_plp = coarse_charge(CompletionRequest(prompt=text, max_tokens=1, prompt_logprobs=1), 16).estimate
    exact = exact_charge(tokens, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert exact <= with_plp, (exact, with_plp)
