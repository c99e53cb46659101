"""A tiny random-weight SmolVLM for the tests of a model that sees (the `tiny_smolvlm_dir`
fixture of tests/conftest.py builds it once a session), and HF's side of their comparisons:
transformers' Idefics3Processor's prompt of a conversation with images, and HF generate's
greedy tokens for it."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

#: SmolVLM's chat template: each content a list of parts, an image written as <image>
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
#: its image processor's: images resized to a longest edge of 96, tiles of 32 (of 4 tokens each)
SMOLVLM_PRE = {"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 32}, "resample": 1}


def make_tiny_smolvlm(out: Path, smollm_dir: Path) -> Path:
    """A tiny random-weight SmolVLM (Idefics3) checkpoint that sees, in `out`: SigLIP of 2 layers over
    32x32 tiles of 8x8 patches, a 1-layer Llama, SmolLM2's tokenizer with Idefics3's special
    tokens, the chat template above and the image processor's configs (image_seq_len 4)."""
    import json

    import torch
    import transformers

    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(smollm_dir))
    grid = [f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)]
    specials = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", *grid]
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = SMOLVLM_TEMPLATE
    tok.save_pretrained(str(out))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    text = dict(model_type="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=1)
    cfg = transformers.Idefics3Config(
        vision_config=vision | {"image_size": 32, "patch_size": 8},
        text_config=text | {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": len(tok)},
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(3)
    hf = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # larger weights than the default init give peaked, varied logits
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    hf.save_pretrained(str(out))
    (out / "preprocessor_config.json").write_text(
        json.dumps(SMOLVLM_PRE | {"image_processor_type": "Idefics3ImageProcessor"})
    )
    (out / "processor_config.json").write_text(json.dumps({"image_seq_len": 4}))
    return out


#: a conversation: turns of (role, parts), each part text or an image's file
Turns = list[tuple[str, list[Any]]]


def png(img: Any) -> bytes:
    """A PIL image's PNG file."""
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def hf_processor(model_dir: Path) -> Any:
    """transformers' Idefics3Processor for the tiny SmolVLM."""
    import transformers

    return transformers.Idefics3Processor(
        transformers.Idefics3ImageProcessor(**SMOLVLM_PRE),
        transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir)),
        image_seq_len=4,
        chat_template=SMOLVLM_TEMPLATE,
    )


def hf_prompt(processor: Any, turns: Turns) -> tuple[list[int], list[bytes]]:
    """The conversation's prompt as transformers' Idefics3Processor writes it, and its images."""
    from PIL import Image

    msgs = [
        {
            "role": r,
            "content": [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in ps],
        }
        for r, ps in turns
    ]
    files = [p for _, ps in turns for p in ps if isinstance(p, bytes)]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    return processor(text=text, images=[images])["input_ids"][0], files


def hf_tokens(hf: Any, ids: list[int], files: list[bytes], max_tokens: int) -> list[int]:
    """HF generate's greedy tokens (fp32, no end) for the prompt `ids` with these images."""
    import torch
    from PIL import Image
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    pixels = Idefics3ImageProcessorPil(**SMOLVLM_PRE)([images], return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor([ids]),
            pixel_values=pixels["pixel_values"],
            pixel_attention_mask=pixels["pixel_attention_mask"],
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
        )
    return out[0, len(ids) :].tolist()
