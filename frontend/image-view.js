// Images on the page: the chips of images waiting to be sent (a thumbnail, the name, the size
// and a remove button) and the thumbnails of a sent message. Every src is a data: URL checked
// by isImageDataUrl: nothing is fetched.

import { icon } from "./icons.js";
import { formatBytes, imagesOf, isImageDataUrl } from "./images.js";

function thumbImg(im, alt) {
  const img = document.createElement("img");
  img.className = "thumb";
  img.alt = alt;
  img.decoding = "async";
  img.src = isImageDataUrl(im.thumb) ? im.thumb : im.url;
  if (im.width && im.height) {
    img.width = im.width;
    img.height = im.height; // the box keeps its shape before the thumbnail is drawn
  }
  return img;
}

const sizeOf = (im) => (im.width && im.height ? `${im.width}×${im.height}, ` : "") + formatBytes(im.size || 0);

/** The waiting images as chips; `onRemove(k)` drops the k-th. */
export function imageChipList(list, onRemove) {
  const ul = document.createElement("ul");
  ul.className = "chips image-chips";
  ul.setAttribute("aria-label", "Attached images");
  list.forEach((im, k) => {
    const li = document.createElement("li");
    li.className = "chip image-chip";
    li.title = `${im.name}, ${sizeOf(im)}`;
    const name = document.createElement("span");
    name.className = "chip-name";
    name.textContent = im.name;
    const size = document.createElement("span");
    size.className = "chip-size";
    size.textContent = formatBytes(im.size || 0);
    const b = document.createElement("button");
    b.type = "button";
    b.className = "chip-remove";
    b.setAttribute("aria-label", `Remove image ${im.name}`);
    b.appendChild(icon("close"));
    b.addEventListener("click", () => onRemove(k));
    li.append(thumbImg(im, ""), name, size, b); // the name is the text beside it: the thumbnail is decoration
    ul.appendChild(li);
  });
  return ul;
}

/** A sent message's images: a thumbnail each, named by its alt text; one whose file this
 * browser could not keep says that the model no longer sees it. */
export function imageGallery(msg) {
  const list = imagesOf(msg);
  if (!list.length) return null;
  const ul = document.createElement("ul");
  ul.className = "msg-images";
  ul.setAttribute("aria-label", "Images");
  for (const im of list) {
    const li = document.createElement("li");
    li.title = `${im.name}, ${sizeOf(im)}`;
    li.appendChild(thumbImg(im, `Image ${im.name}`));
    if (!isImageDataUrl(im.url)) {
      li.classList.add("dropped");
      const note = document.createElement("span");
      note.className = "image-note";
      note.textContent = "Not kept (browser storage was full): no longer sent to the model";
      li.appendChild(note);
    }
    ul.appendChild(li);
  }
  return ul;
}

/** What a message's images look like, for redrawing only when they change. */
export function imagesKey(msg) {
  return imagesOf(msg)
    .map((im) => `${im.name}\u0000${im.size}\u0000${isImageDataUrl(im.url)}`)
    .join("\u0000");
}
