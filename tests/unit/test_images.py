"""An image part's data is decoded, checked and hashed by its pixels (server/images.py):
each format the gateway reads gives the same pixels' digest, a GIF its first frame, and
every bad image is a 400 naming the part before its pixels are decoded where it can be."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image as PILImage

from wsllm.server import images
from wsllm.server.errors import APIError

LIMITS = images.ImageLimits(max_bytes=1 << 16, max_pixels=64 * 64, per_request=2, per_conversation=3)
AT = "messages.0.content.1"


def picture(color: tuple[int, int, int], size: tuple[int, int] = (8, 6)) -> PILImage.Image:
    img = PILImage.new("RGB", size, color)
    img.putpixel((1, 2), (255 - color[0], 7, 9))  # not one flat colour: a digest of real pixels
    return img


def encoded(img: PILImage.Image, fmt: str, **kw: object) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kw)
    return out.getvalue()


# 64 x 64 pixels of noise: a PNG that does not compress to nothing, to cut in half
NOISE = encoded(PILImage.effect_noise((64, 64), 64).convert("RGB"), "PNG")


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(raw).decode()}"


def refusal(url: str, limits: images.ImageLimits = LIMITS) -> str:
    with pytest.raises(APIError) as e:
        images.from_url(url, AT, limits)
    assert e.value.status == 400 and e.value.param == AT and e.value.message.startswith(AT + ": ")
    return e.value.message


def test_the_digest_is_of_the_pixels_whatever_the_lossless_format() -> None:
    img = picture((10, 200, 30))
    png = images.from_url(data_url(encoded(img, "PNG")), AT, LIMITS)
    webp = images.from_url(data_url(encoded(img, "WEBP", lossless=True), "image/webp"), AT, LIMITS)
    assert (png.format, webp.format) == ("PNG", "WEBP")
    assert (png.width, png.height) == (8, 6) and png.digest == webp.digest
    assert png.data == encoded(img, "PNG")  # the file as sent is what crosses on
    other = images.from_url(data_url(encoded(picture((10, 200, 31)), "PNG")), AT, LIMITS)
    assert other.digest != png.digest


def test_jpeg_decodes_and_a_gif_is_its_first_frame() -> None:
    jpeg = images.from_url(data_url(encoded(picture((90, 90, 90)), "JPEG"), "image/jpeg"), AT, LIMITS)
    assert jpeg.format == "JPEG" and (jpeg.width, jpeg.height) == (8, 6)
    first, second = PILImage.new("RGB", (4, 4), (255, 0, 0)), PILImage.new("RGB", (4, 4), (0, 0, 255))
    gif = encoded(first, "GIF", save_all=True, append_images=[second])
    got = images.from_url(data_url(gif, "image/gif"), AT, LIMITS)
    assert got.format == "GIF"
    assert got.digest == images.decode(encoded(first, "PNG"), AT, LIMITS).digest


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("https://example.com/cat.png", "not fetched"),
        ("http://10.0.0.1/x.png", "not fetched"),
        ("file:///etc/passwd", "must be a data: URL"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:text/plain;base64,aGk=", "not an image type"),
        ("data:image/png;base64,not*base64", "not valid base64"),
        (data_url(b"hello, not a picture"), "is not a PNG, JPEG, WebP or GIF image"),
        (data_url(encoded(picture((1, 2, 3)), "BMP")), "is not a PNG, JPEG, WebP or GIF image"),
        (data_url(NOISE[: len(NOISE) // 2]), "the PNG image does not decode"),
        (data_url(encoded(picture((1, 2, 3), (65, 64)), "PNG")), "65x64 = 4160 pixels"),
        (data_url(b"\x89PNG" + b"0" * (1 << 16)), "limit is 65536"),
    ],
    ids=[
        "https",
        "http",
        "file",
        "not-base64",
        "text",
        "bad-base64",
        "not-an-image",
        "bmp",
        "truncated-png",
        "over-pixels",
        "over-bytes",
    ],
)
def test_a_bad_image_is_a_400_naming_the_part(url: str, words: str) -> None:
    assert words in refusal(url)


def with_size(png: bytes, width: int, height: int) -> bytes:
    """`png` whose header claims another size (its pixels are not those of that size)."""
    ihdr = png[12:16] + struct.pack(">II", width, height) + png[24:29]
    return png[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + png[33:]


@pytest.mark.parametrize(("side", "words"), [(5000, "5000x5000 = 25000000 pixels"), (20000, "limit of 4096")])
def test_the_pixel_limit_is_read_from_the_header_before_the_pixels(side: int, words: str) -> None:
    # Decoding these pixels would fail ("does not decode"), or take gigabytes: the
    # header's size is refused first. 20000 x 20000 is past Pillow's own bomb check too.
    assert words in refusal(data_url(with_size(encoded(picture((1, 2, 3)), "PNG"), side, side)))


def test_too_many_images_names_the_first_past_the_limit() -> None:
    parts = [f"messages.0.content.{j}" for j in range(3)]
    images.check_count(parts[:2], LIMITS.per_request, "a request")
    with pytest.raises(APIError) as e:
        images.check_count(parts, LIMITS.per_request, "a request")
    assert e.value.param == "messages.0.content.2" and "at most 2 images" in e.value.message


def test_transparency_is_composited_over_white_as_transformers_does() -> None:
    clear = PILImage.new("RGBA", (4, 4), (0, 0, 0, 0))  # transparent black reads as white
    white = PILImage.new("RGB", (4, 4), (255, 255, 255))
    got = images.decode(encoded(clear, "PNG"), AT, LIMITS)
    assert got.digest == images.decode(encoded(white, "PNG"), AT, LIMITS).digest
