"""The prefix cache's keys of a prompt with images (wsllm/prefix_hash.py): a block that
holds an image's placeholders is keyed by the image's digest and offset, so the same
image hits, a different image with the same tokens misses from its first block on, the
text before it keeps its keys, and another tenant's root keeps its own."""

from __future__ import annotations

from wsllm.prefix_hash import ImageSpan, cache_root, image_extras, prompt_keys

BS = 4
# text [0, 6), an image's 9 placeholders [6, 15), text after: 5 full blocks to look up
PROMPT = [11, 12, 13, 14, 15, 16] + [99] * 9 + [21, 22, 23, 24, 25, 26]
CAT, DOG = ImageSpan(6, 9, "c" * 64), ImageSpan(6, 9, "d" * 64)


def test_a_block_holding_an_image_is_keyed_by_it_and_its_offset() -> None:
    assert image_extras([CAT], 0, 4) == ()  # text alone: the key it always had
    assert image_extras([CAT], 4, 8) == (f"{'c' * 64}@0",)
    assert image_extras([CAT], 8, 12) == (f"{'c' * 64}@2",)
    assert image_extras([CAT], 12, 16) == (f"{'c' * 64}@6",)
    assert image_extras([CAT], 16, 20) == ()
    two = [ImageSpan(0, 2, "a"), ImageSpan(2, 3, "b")]
    assert image_extras(two, 0, 4) == ("a@0", "b@0")


def test_the_same_image_hits_another_misses_and_the_text_before_is_kept() -> None:
    plain = prompt_keys(PROMPT, BS)
    cat = prompt_keys(PROMPT, BS, images=[CAT])
    assert len(cat) == 5 and prompt_keys(PROMPT, BS, images=[CAT]) == cat
    dog = prompt_keys(PROMPT, BS, images=[DOG])
    assert cat[0] == dog[0] == plain[0]  # the first block is text alone
    assert all(c != d for c, d in zip(cat[1:], dog[1:], strict=True))  # from the image's first block on
    assert cat[1] != plain[1]  # the placeholders' ids alone are not the image


def test_another_tenants_same_image_does_not_hit() -> None:
    alice, bob = cache_root("alice-salt"), cache_root("bob-salt")
    mine = prompt_keys(PROMPT, BS, alice, [CAT])
    theirs = prompt_keys(PROMPT, BS, bob, [CAT])
    assert not set(mine) & set(theirs)
