"""Images in requests: a part's data (a `data:` URL, or Anthropic's base64 source)
decoded with Pillow, checked against the operator's limits, and hashed by its pixels.

Every API wing hands its image parts here while the request is validated (before
admission, as every other 400 that needs no tokenizer), so a bad image is a 400 naming
the part and never reaches an engine (docs/vision.md):
- only `data:` URLs are read; an `http(s)` URL is refused (fetching any URL a client
  names would be a server-side request forgery), and so is every other scheme;
- its bytes are bounded before they are decoded from base64 (`max_image_bytes`), its
  pixels before its pixels are decoded (`max_image_pixels`: the header says them), and
  only PNG, JPEG, WebP and GIF (its first frame) are decoded;
- a file that does not decode whole (a truncated PNG) is refused, not padded.

`Image.digest` is the SHA-256 of the decoded RGB pixels and their size, not of the
file: the same picture sent as PNG or as lossless WebP is one image. The prefix cache
keys an image's placeholder tokens by it under the tenant's salt (the chain's root),
so that one tenant's image is never another's hit."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image as PILImage

from wsllm.config_gateway import GatewayConfig
from wsllm.server.errors import APIError

#: the formats decoded, as Pillow names them, and the media types that name them
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
_TOKEN = r"[\w.+-]+"
_DATA_URL = re.compile(rf"data:(?P<type>{_TOKEN}/{_TOKEN})?(?:;{_TOKEN}={_TOKEN})*(?P<b64>;base64)?,")


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """The operator's limits on images (GatewayConfig's `max_image_*` settings)."""

    max_bytes: int
    max_pixels: int
    per_request: int
    per_conversation: int

    @classmethod
    def of(cls, cfg: GatewayConfig) -> ImageLimits:
        return cls(
            cfg.max_image_bytes,
            cfg.max_image_pixels,
            cfg.max_images_per_request,
            cfg.max_images_per_conversation,
        )


@dataclass(frozen=True, slots=True)
class Image:
    """A checked image: its file as sent (what crosses to an engine) and what was read
    of it."""

    data: bytes  # the compressed file, as the client sent it
    format: str  # Pillow's name: PNG, JPEG, WEBP or GIF
    width: int
    height: int
    #: SHA-256 (hex) of the decoded RGB pixels and the size: the image's identity
    digest: str

    @property
    def pixels(self) -> int:
        return self.width * self.height


def refused(param: str, message: str) -> APIError:
    """The 400 for an image part: `param` names it."""
    return APIError(400, "invalid_request", f"{param}: {message}", param=param)


def from_url(url: str, param: str, limits: ImageLimits) -> Image:
    """The image a URL part names: a base64 `data:` URL only (see the module's docstring)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
    if scheme in ("http", "https"):
        raise refused(
            param,
            "image URLs are not fetched by this server (a server-side request forgery); "
            "send the image inline as a data: URL (data:image/png;base64,...)",
        )
    m = _DATA_URL.match(url)
    if m is None:
        raise refused(param, "an image must be a data: URL (data:image/png;base64,...)")
    if not m["b64"]:
        raise refused(param, "a data: URL of an image must be base64 (data:image/png;base64,...)")
    return from_base64(url[m.end() :], m["type"], param, limits)


def from_base64(data: str, media_type: str | None, param: str, limits: ImageLimits) -> Image:
    """An image sent as base64 text (a data URL's payload, Anthropic's `source.data`)."""
    if media_type is not None and media_type.lower() not in MEDIA_TYPES:
        raise refused(param, f"{media_type} is not an image type this server reads (PNG, JPEG, WebP or GIF)")
    # Bounded before it is decoded: 4 characters of base64 are 3 bytes.
    size = len(data) // 4 * 3
    if size > limits.max_bytes:
        raise refused(param, f"the image has about {size} bytes; this server's limit is {limits.max_bytes}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise refused(param, "the image's data is not valid base64") from None
    return decode(raw, param, limits)


def decode(raw: bytes, param: str, limits: ImageLimits) -> Image:
    """Decode and check an image file; its pixels hashed. A 400 naming `param` for what
    is not a PNG, JPEG, WebP or GIF, what does not decode whole, and what is over the
    limits."""
    if len(raw) > limits.max_bytes:
        raise refused(param, f"the image has {len(raw)} bytes; this server's limit is {limits.max_bytes}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)  # our own limit decides
        try:
            img = PILImage.open(io.BytesIO(raw), formats=FORMATS)
        except PILImage.DecompressionBombError:
            over = f"the image is over this server's limit of {limits.max_pixels} pixels"
            raise refused(param, over) from None
        except Exception:  # Pillow raises what its decoders raise
            raise refused(param, "is not a PNG, JPEG, WebP or GIF image") from None
        with img:
            width, height = img.size
            if width * height > limits.max_pixels:
                raise refused(
                    param,
                    f"the image has {width}x{height} = {width * height} pixels; "
                    f"this server's limit is {limits.max_pixels}",
                )
            fmt = str(img.format)
            try:
                img.seek(0)  # a GIF's first frame; an animation's others are not read
                rgb = rgb_pixels(img)
            except Exception as e:  # a truncated or corrupt file
                raise refused(param, f"the {fmt} image does not decode ({e})") from None
    digest = hashlib.sha256(f"RGB {width}x{height}\n".encode() + rgb.tobytes()).hexdigest()
    return Image(raw, fmt, width, height, digest)


def rgb_pixels(img: PILImage.Image) -> PILImage.Image:
    """An image as the model reads it: RGB, any transparency composited over white (as
    transformers' image processors do), decoded whole."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return PILImage.alpha_composite(PILImage.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert(
            "RGB"
        )
    return img.convert("RGB")


def check_count(parts: list[str], limit: int, what: str) -> None:
    """At most `limit` images in `what` (a request, or a conversation), `parts` naming
    each; the 400 names the first one past the limit."""
    if len(parts) > limit:
        raise refused(parts[limit], f"at most {limit} images in {what} (got {len(parts)})")
