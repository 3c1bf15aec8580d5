"""Where a request's images come from: chat messages' image parts, and vLLM's prompt dicts with `multi_modal_data`.

A chat's image parts are OpenAI's ({"type": "image_url", "image_url": {"url": ...}}), vLLM's ({"type": "image_url",
"image_url": url}, {"type": "image_pil", "image_pil": image}) and HF's ({"type": "image", "image": ...}). Each
becomes HF's {"type": "image"} for the template, which writes the model's placeholder there (Qwen2-VL's
<|vision_start|><|image_pad|><|vision_end|>); the engine widens each placeholder to its image's tokens.
"""

from __future__ import annotations

from typing import Any

IMAGE_PART_TYPES = ("image_url", "image", "image_pil", "input_image")


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The messages with each image part made {"type": "image"}, and the parts' images (a URL, a path, bytes or a
    PIL image: multimodal/images.py's load_image reads them), in the order the template places them."""
    images: list[Any] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PART_TYPES:
                images.append(image_source(part, f"messages.{i}.content.{j}"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def image_source(part: dict[str, Any], where: str) -> Any:
    """The image an image part holds; ValueError naming the field where it holds none, or asks for a detail level
    ridge does not honour (the model's own pixel budget sizes every image)."""
    kind = part["type"]
    value = part.get(kind if kind != "input_image" else "image_url")
    if isinstance(value, dict):  # OpenAI's {"url": ..., "detail": ...}
        detail = value.get("detail", "auto")
        if detail != "auto":
            raise ValueError(f"{where}.{kind}.detail: {detail!r} is not supported (auto: the model's own pixel "
                             "budget sizes each image)")
        value = value.get("url")
    if kind == "input_image" and part.get("detail", "auto") != "auto":
        raise ValueError(f"{where}.detail: {part['detail']!r} is not supported (auto)")
    if value is None or isinstance(value, str) and not value:
        raise ValueError(f"{where}.{kind}: an image part needs its image (a data: URL, a path, bytes or a PIL image)")
    return value


def prompt_images(prompt: Any) -> tuple[Any, list[Any]]:
    """vLLM's prompt dict with `multi_modal_data` ({"image": an image or a list of them}) -> the prompt without it,
    and its images (load_image reads them); any other prompt as it is, with none."""
    if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
        return prompt, []
    rest = {key: value for key, value in prompt.items() if key != "multi_modal_data"}
    media = prompt["multi_modal_data"] or {}
    if not isinstance(media, dict) or set(media) - {"image"}:
        kinds = sorted(media) if isinstance(media, dict) else [type(media).__name__]
        raise ValueError(f"multi_modal_data: only images are supported ({{'image': ...}}); got {kinds}")
    images = media.get("image")
    return rest, list(images) if isinstance(images, list | tuple) else [images] if images is not None else []
