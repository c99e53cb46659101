"""The served models: which models this gateway routes to, by name or alias, each
with its tokenizer and the services its Generations use, and what `/v1/models` lists.
A LoRA adapter a live engine holds is a name too: it resolves to its base model, with
the adapter (`ServedModel.lora`) for the request to run under (docs/lora.md).

A gateway serves every model a live engine serves (`broker.engines()`), by its name
or one of its aliases. Each model gets its tokenizer (`ServedModel`) on first sight:
from a directory this process was given, else from the files its engines published
through the broker (Redis), written to a private temporary directory."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wsllm.broker.base import TOKENIZER_FILES, BrokerUnavailable, EngineInfo, GatewayBroker
from wsllm.server.errors import APIError
from wsllm.server.generation import Services
from wsllm.server.metrics import Metrics
from wsllm.server.tenants import ANONYMOUS, Tenant
from wsllm.server.text import TextCodec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServedModel:
    """A model this gateway routes to: its canonical name, tokenizer and the services
    its Generations use (metrics labelled with its name)."""

    name: str
    codec: TextCodec
    svc: Services
    lora: str = ""  # the LoRA adapter a request names (`name` is then its base model)
    #: whether it reads images (a vision family, docs/vision.md); a text model does not.
    #: Set from its tokenizer's directory: an image processor there (`TextCodec.tiling`).
    sees_images: bool = False

    def __post_init__(self) -> None:
        self.sees_images = self.sees_images or getattr(self.codec, "tiling", None) is not None

    @property
    def served_as(self) -> str:
        """The name the client asked for: the adapter's, or the model's."""
        return self.lora or self.name


def _by_alias(live: dict[str, list[EngineInfo]], alias: str) -> str | None:
    return next((m for m, engines in live.items() if any(alias in e.aliases for e in engines)), None)


def _by_adapter(live: dict[str, list[EngineInfo]], adapter: str) -> str | None:
    """The base model of the live engines that hold LoRA adapter `adapter`."""
    return next((m for m, engines in live.items() if any(adapter in e.adapters for e in engines)), None)


@dataclass
class ServedModels:
    broker: GatewayBroker
    #: the default model: requests that name none go to it
    default: ServedModel
    #: the services of a model's Generations, given its tokenizer and metrics
    services: Callable[[TextCodec, Metrics], Services]
    #: tokenizer directories of models served from this process (`serve --model A --model B`)
    tokenizer_dirs: dict[str, Path] = field(default_factory=dict)
    _models: dict[str, ServedModel] = field(init=False, default_factory=dict)
    _loading: dict[str, asyncio.Future[ServedModel]] = field(init=False, default_factory=dict)
    _tok_root: Path | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._models[self.default.name] = self.default

    @property
    def metrics(self) -> Metrics:
        return self.default.svc.metrics

    async def engines(self, model: str | None = None, strict: bool = False) -> list[EngineInfo]:
        """Live engines (of `model` only, when given); none while the broker is
        unreachable, or (`strict`) BrokerUnavailable, so that a request is told why."""
        try:
            infos = await self.broker.engines()
        except BrokerUnavailable:
            if strict:
                raise
            return []
        return infos if model is None else [e for e in infos if (e.model or self.default.name) == model]

    async def live(self, strict: bool = False) -> dict[str, list[EngineInfo]]:
        """Each model a live engine serves, with its engines, the default model first."""
        out: dict[str, list[EngineInfo]] = {}
        first = self.default.name
        for e in sorted(await self.engines(strict=strict), key=lambda e: (e.model != first, e.model)):
            out.setdefault(e.model or first, []).append(e)
        return out

    async def max_model_len(self, model: str | None = None) -> int | None:
        lens = [e.max_model_len for e in await self.engines(model or self.default.name) if e.max_model_len]
        return min(lens) if lens else None

    async def refresh_gauges(self) -> None:
        live = await self.live()
        pending = await self.broker.pending()
        for name in set(live) | set(self._models):
            stats = [e.stats for e in live.get(name, [])]
            self.metrics.for_model(name).set_engine_stats(stats, pending if name == self.default.name else 0)

    async def cards(self, tenant: Tenant) -> list[dict[str, Any]]:
        """`/v1/models`: every model a live engine serves (and `tenant` may use), the
        default first, each with the context length its engines allow. An alias is a
        card of its own (`parent`: the model it names), as vLLM lists served names;
        `root` (vLLM's) names the weights a card serves: the model's, or the adapter's.
        `input_modalities` (OpenRouter's name) says what it reads: `["text", "image"]` for a
        model that sees, `["text"]` else; left out while its tokenizer cannot be had."""
        data: list[dict[str, Any]] = []
        for name, engines in (await self.live()).items():
            card: dict[str, Any] = {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "wsllm",
                "root": name,
                "max_model_len": min(e.max_model_len for e in engines),
            } | await self._modalities(name)
            if tenant.may_use(name):
                data.append(card)
                aliases = sorted({a for e in engines for a in e.aliases} - {name})
                data += [card | {"id": a, "parent": name} for a in aliases]
            # an adapter's card: for a key that may use it (it may, and not its base)
            adapters = sorted({a for e in engines for a in e.adapters} - {name})
            data += [
                card | {"id": a, "root": a, "parent": name, "lora": True}
                for a in adapters
                if tenant.may_use(a)
            ]
        return data

    async def _modalities(self, name: str) -> dict[str, Any]:
        """`{"input_modalities": [...]}` from the model's tokenizer (loaded here on first
        sight, as its first request would); `{}` while no tokenizer has been published."""
        try:
            model = await self.served(name)
        except APIError:
            return {}
        return {"input_modalities": ["text", "image"] if model.sees_images else ["text"]}

    async def resolve(self, requested: str | None, tenant: Tenant = ANONYMOUS) -> tuple[ServedModel, int]:
        """The model a request names (its name or an alias; none: the default model)
        and the context length its live engines allow. 404 `model_not_found` for a
        model nobody serves or this tenant may not use, 503 `model_not_ready` for a
        known model whose engines are all gone; BrokerUnavailable (a 503 that says so) while
        the broker does not answer."""
        live = await self.live(strict=True)
        want = requested or self.default.name
        name = want if want in live else _by_alias(live, want)
        base = _by_adapter(live, want) if name is None else None
        if base is not None and tenant.may_use(want):  # an adapter: its base, on the engines that hold it
            holders = [e.max_model_len for e in live[base] if want in e.adapters]
            return dataclasses.replace(await self.served(base), lora=want), min(holders)
        if name is None or not tenant.may_use(name):
            usable = [m for m in live if tenant.may_use(m)]
            known = want in self._models or want in self.tokenizer_dirs
            if name is None and known and tenant.may_use(want):
                raise APIError(503, "model_not_ready", f"no engine is serving {want!r} now", retry_after=1)
            hint = f"; served here: {', '.join(usable)}" if usable else ""
            what = "is not served here" if name is None else "is not available to this key"
            raise APIError(404, "model_not_found", f"model {want!r} {what}{hint}", param="model")
        return await self.served(name), min(e.max_model_len for e in live[name])

    async def served(self, name: str) -> ServedModel:
        """A model's tokenizer and services by its canonical name (loaded on first use)."""
        return self._models.get(name) or await self._load(name)

    async def _load(self, name: str) -> ServedModel:
        """Load `name`'s tokenizer once, however many requests ask at the same time."""
        fut = self._loading.get(name)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = self._loading[name] = asyncio.get_running_loop().create_future()
        try:
            directory = self.tokenizer_dirs.get(name) or await self._fetch_tokenizer(name)
            codec = await asyncio.to_thread(TextCodec, str(directory))
            served = ServedModel(name, codec, self.services(codec, self.metrics.for_model(name)))
            self._models[name] = served
            fut.set_result(served)
            log.info("model %s: tokenizer loaded from %s", name, directory)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: callers that are gone do not warn
            raise
        finally:
            del self._loading[name]
        return served

    async def _fetch_tokenizer(self, name: str) -> Path:
        try:
            files = await self.broker.tokenizer_files(name)
        except BrokerUnavailable:
            files = None
        if not files or "tokenizer.json" not in files:
            raise APIError(
                503, "model_not_ready", f"no tokenizer for {name!r} has been published yet", retry_after=1
            )
        if self._tok_root is None:
            self._tok_root = Path(tempfile.mkdtemp(prefix="wsllm-tokenizers-"))
        directory = self._tok_root / hashlib.sha256(name.encode()).hexdigest()[:16]
        directory.mkdir(exist_ok=True)
        for fname, data in files.items():
            if fname in TOKENIZER_FILES:  # names from Redis: never a path
                (directory / fname).write_bytes(data)
        return directory

    def close(self) -> None:
        """Remove the tokenizers fetched from the broker (the app is stopping)."""
        if self._tok_root is not None:
            shutil.rmtree(self._tok_root, ignore_errors=True)
