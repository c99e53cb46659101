"""`/v1/models` says what each model reads (`input_modalities`, wsllm/server/models.py):
`["text", "image"]` for a model whose tokenizer's directory holds an Idefics3 image
processor, `["text"]` for a text model, on its own card, its aliases' and its adapters'.
The chat UI warns before it sends an image to a model that cannot see."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from wsllm.broker.base import TOKENIZER_FILES
from wsllm.broker.memory import MemoryBroker
from wsllm.server.metrics import Metrics
from wsllm.server.models import ServedModel, ServedModels
from wsllm.server.tenants import ANONYMOUS
from wsllm.server.text import TextCodec
from wsllm.types import EngineInfo


@pytest.fixture(scope="module")
def vlm_tokenizer(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """SmolLM2's tokenizer with an Idefics3 image processor beside it: a model that sees."""
    out = tmp_path_factory.mktemp("vlm-tok")
    for name in TOKENIZER_FILES:
        if (smollm_dir / name).exists():
            shutil.copy(smollm_dir / name, out / name)
    pre = {"image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": 64}}
    (out / "preprocessor_config.json").write_text(json.dumps(pre | {"max_image_size": {"longest_edge": 32}}))
    (out / "processor_config.json").write_text(json.dumps({"image_seq_len": 4}))
    return out


def test_each_card_says_whether_its_model_sees_images(smollm_dir: Path, vlm_tokenizer: Path) -> None:
    def services(codec: Any, metrics: Metrics) -> Any:  # the cards read only the metrics
        return SimpleNamespace(metrics=metrics)

    broker = MemoryBroker()
    text = ServedModel("text", TextCodec(str(smollm_dir)), services(None, Metrics("text")))
    models = ServedModels(broker, text, services, {"vlm": vlm_tokenizer})
    broker.heartbeat(EngineInfo("e1", "text", 2048, aliases=["prose"]))
    broker.heartbeat(EngineInfo("e2", "vlm", 1024, adapters=["vlm-lora"]))
    broker.heartbeat(EngineInfo("e3", "unpublished", 512))  # no tokenizer anywhere yet
    try:
        cards = {c["id"]: c for c in asyncio.run(models.cards(ANONYMOUS))}
    finally:
        broker.close()
    seen = {k: c.get("input_modalities") for k, c in cards.items()}
    assert seen == {
        "text": ["text"],
        "prose": ["text"],
        "vlm": ["text", "image"],
        "vlm-lora": ["text", "image"],
        "unpublished": None,  # left out, not guessed; the card is still listed
    }
    assert cards["unpublished"]["max_model_len"] == 512
