"""A tiny random-weight SmolVLM for the tests of a model that sees (the `tiny_smolvlm_dir`
fixture of tests/conftest.py builds it once a session)."""

from __future__ import annotations

from pathlib import Path

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
