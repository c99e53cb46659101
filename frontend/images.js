// Image attachments: PNG, JPEG, WebP or GIF files read in the browser, checked against the
// server's limits before anything is sent, sent as OpenAI `image_url` parts with data: URLs
// (docs/vision.md, "What a request may carry").
//
// A user message keeps its images in `msg.images`, [{name, type, size, width, height, url, thumb}]:
//   url    the file itself, unchanged, as a data: URL (base64): what the model reads, again in
//          every later request of the conversation (a chat request carries its history)
//   thumb  a small JPEG data: URL (at most THUMB_PX a side) that the page shows
// What is stored: the whole `url` in localStorage, so that a conversation goes on after a reload
// (the server's WebSocket message limit, 1 MiB by default, keeps a conversation's images under
// about 750 KB). When the browser's storage (about 5 MB for every conversation) refuses that,
// the conversation is stored with thumbnails only (`storedForm`: `url` dropped, `dropped: true`)
// and the page says so: after a reload such an image is shown, marked, and never sent again.

// The server's defaults (wsllm/config_gateway.py); a hello whose `limits` names them wins.
export const IMAGE_LIMITS = Object.freeze({
  max_image_bytes: 5 << 20, // --max-image-bytes: the file, before base64
  max_image_pixels: 4096 * 4096, // --max-image-pixels: width x height
  max_images_per_request: 8, // --max-images-per-request: a chat request holds the whole conversation's
});
export const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];
export const IMAGE_ACCEPT = `${IMAGE_TYPES.join(",")},.png,.jpg,.jpeg,.webp,.gif`;
const KIND = { "image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WebP", "image/gif": "GIF" };
const THUMB_PX = 192; // the thumbnail's longest side (shown at up to 96 CSS pixels: sharp at 2x)
const DATA_URL = /^data:image\/(png|jpeg|webp|gif);base64,[A-Za-z0-9+/]*={0,2}$/;

/** The server's image limits: its hello's where it names them, else its defaults. */
export function imageLimits(hello) {
  const out = { ...IMAGE_LIMITS };
  for (const key of Object.keys(out)) {
    const v = hello?.limits?.[key];
    if (Number.isInteger(v) && v > 0) out[key] = v;
  }
  return out;
}

/** "5 MiB", "740 KiB", "512 B": sizes as the server's byte limits count them. */
export function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1 << 20) return `${Math.round(n / 1024)} KiB`;
  return `${(n / (1 << 20)).toFixed(1).replace(/\.0$/, "")} MiB`;
}

/** Whether `s` is a data: URL of an image this server reads (and nothing else: it is put in
 * an <img src>, so a stored or imported conversation cannot make the page fetch anything). */
export function isImageDataUrl(s) {
  return typeof s === "string" && DATA_URL.test(s);
}

/** The file's type from its first bytes (its name or the browser's guess may lie), or null. */
export function sniffType(b) {
  const at = (k, ...bytes) => bytes.every((x, j) => b[k + j] === x);
  if (at(0, 0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a)) return "image/png";
  if (at(0, 0xff, 0xd8, 0xff)) return "image/jpeg";
  if (at(0, 0x47, 0x49, 0x46, 0x38) && (b[4] === 0x37 || b[4] === 0x39) && b[5] === 0x61) return "image/gif";
  if (at(0, 0x52, 0x49, 0x46, 0x46) && at(8, 0x57, 0x45, 0x42, 0x50)) return "image/webp";
  return null;
}

/** Whether a picked, pasted or dropped file is meant as an image (SVG is text: attachments.js). */
export function looksLikeImage(file) {
  const type = String(file.type || "");
  return (type.startsWith("image/") && type !== "image/svg+xml") || /\.(png|jpe?g|webp|gif)$/i.test(file.name || "");
}

function dataUrl(blob) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(String(r.result));
    r.onerror = () => reject(r.error);
    r.readAsDataURL(blob);
  });
}

/** A small JPEG of the image, over white (as the server composites transparency). */
function thumbnail(bitmap) {
  const scale = Math.min(1, THUMB_PX / Math.max(bitmap.width, bitmap.height));
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.round(bitmap.width * scale));
  canvas.height = Math.max(1, Math.round(bitmap.height * scale));
  const g = canvas.getContext("2d");
  g.fillStyle = "#ffffff";
  g.fillRect(0, 0, canvas.width, canvas.height);
  g.drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  return canvas.toDataURL("image/jpeg", 0.85);
}

/** {image} or {error}: a File read as an image and checked against `limits` (imageLimits). */
export async function readImageFile(file, limits) {
  const name = String(file.name || "image").slice(0, 255);
  const most = limits.max_image_bytes;
  if (file.size > most) {
    return { error: `“${name}” is ${formatBytes(file.size)}: an image may be at most ${formatBytes(most)} on this server.` };
  }
  const bytes = new Uint8Array(await file.arrayBuffer());
  const type = sniffType(bytes);
  if (!type) return { error: `“${name}” is not a PNG, JPEG, WebP or GIF image.` };
  let bitmap;
  try {
    bitmap = await createImageBitmap(new Blob([bytes], { type })); // a GIF: its first frame
  } catch {
    return { error: `“${name}” does not open as a ${KIND[type]} image (is the file damaged?).` };
  }
  const { width, height } = bitmap;
  try {
    if (width * height > limits.max_image_pixels) {
      const px = (n) => n.toLocaleString("en-US");
      return {
        error: `“${name}” is ${width}×${height} = ${px(width * height)} pixels: an image may have at most ${px(limits.max_image_pixels)} on this server.`,
      };
    }
    const thumb = thumbnail(bitmap);
    const url = await dataUrl(new Blob([bytes], { type }));
    return { image: { name, type, size: bytes.length, width, height, url, thumb } };
  } finally {
    bitmap.close();
  }
}

/** A message's images as stored, dropping anything that is not one. */
export function imagesOf(msg) {
  const list = Array.isArray(msg?.images) ? msg.images : [];
  return list.filter((im) => im && typeof im.name === "string" && (isImageDataUrl(im.url) || isImageDataUrl(im.thumb)));
}

/** Images the model reads: those whose file is kept. */
export function sendable(msg) {
  return imagesOf(msg).filter((im) => isImageDataUrl(im.url));
}

/** A user message's images as OpenAI content parts. */
export function imageParts(msg) {
  return sendable(msg).map((im) => ({ type: "image_url", image_url: { url: im.url } }));
}

/** What a conversation's sent images take in every later request: how many, and their
 * data: URLs' characters (bytes on the wire). */
export function conversationImages(conv) {
  let count = 0;
  let chars = 0;
  for (const m of conv?.messages || []) {
    if (m.role !== "user") continue;
    for (const im of sendable(m)) {
      count += 1;
      chars += im.url.length;
    }
  }
  return { count, chars };
}

/** A copy of a conversation with its images' files left out (thumbnails kept): for a
 * browser storage that refused the whole. Null when it has no image file to leave out. */
export function storedForm(conv) {
  if (!conv.messages.some((m) => sendable(m).length)) return null;
  const c = { ...conv, messages: conv.messages.map((m) => ({ ...m })) };
  for (const m of c.messages) {
    if (!Array.isArray(m.images)) continue;
    m.images = m.images.map(({ url, ...rest }) => (url ? { ...rest, dropped: true } : rest));
  }
  return c;
}
