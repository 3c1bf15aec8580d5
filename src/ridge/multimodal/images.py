"""An image as a request gives it (a PIL image, bytes, a data: URL, a path) -> the vision tower's patches.

Preprocessed as HF's Qwen2VLImageProcessor does (PIL's bicubic resize to a multiple of 28 pixels a side within the
model's pixel budget, CLIP's mean and deviation, 14x14 patches two frames deep, each 2x2 of patches consecutive;
Qwen3-VL's: 16x16 patches, sides multiples of 32, a mean and a deviation of 0.5), or as Pixtral's processor does
(Mistral 3: within a longest edge) or Gemma 3's (a fixed square, bilinear), so that the tower sees what it was
trained on. PIL is the library: ridge decodes no image format itself.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ridge.multimodal.vision_config import VisionConfig

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
FETCH_TIMEOUT_S = 10.0
MAX_IMAGE_BYTES = 32 << 20


@dataclass(frozen=True)
class ImageProcessing:
    """How a model's images are cut into patches: HF's preprocessor_config.json of a Qwen2-VL, Qwen2.5-VL or
    Qwen3-VL, of a Mistral 3 (Pixtral's processor: longest_edge set) or of a Gemma 3 (square set)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    # Pixtral's rule: an image larger than this a side shrunk to fit it, each side then rounded up to `factor`
    longest_edge: int | None = None
    square: int | None = None  # SigLIP's (Gemma 3's): every image resized to this side, its aspect ratio not kept
    resample: int = Image.Resampling.BICUBIC  # the config's PIL filter (Gemma 3's: bilinear)

    @classmethod
    def of_model(cls, path: Path, tower: VisionConfig) -> ImageProcessing:
        """The model directory's preprocessor_config.json, or HF's defaults for the tower's patches where it has none
        (Qwen2-VL's processor for 14-pixel patches, Qwen3-VL's for 16; Pixtral's; Gemma 3's). Its patches must be
        the tower's."""
        file = path / "preprocessor_config.json"
        if tower.family == "pixtral":
            return cls._pixtral(file, tower)
        if tower.family == "siglip":
            return cls._siglip(file, tower)
        defaults = QWEN3_VL_PROCESSING if tower.patch_size == QWEN3_VL_PROCESSING.patch_size else QWEN2_VL_PROCESSING
        if not file.exists():
            return defaults
        config = json.loads(file.read_text())
        size = config.get("size") or {}
        processing = cls(
            min_pixels=config.get("min_pixels", size.get("shortest_edge", defaults.min_pixels)),
            max_pixels=config.get("max_pixels", size.get("longest_edge", defaults.max_pixels)),
            patch_size=config.get("patch_size", defaults.patch_size),
            temporal_patch_size=config.get("temporal_patch_size", defaults.temporal_patch_size),
            merge_size=config.get("merge_size", defaults.merge_size),
            mean=tuple(config.get("image_mean", defaults.mean)), std=tuple(config.get("image_std", defaults.std)),
            resample=_resample(config, defaults.resample, file))
        shape = (processing.patch_size, processing.temporal_patch_size, processing.merge_size)
        if shape != (tower.patch_size, tower.temporal_patch_size, tower.merge_size):
            raise ValueError(f"{file}: patch_size, temporal_patch_size, merge_size {shape} are not the vision "
                             f"tower's {(tower.patch_size, tower.temporal_patch_size, tower.merge_size)}")
        return processing

    @classmethod
    def _pixtral(cls, file: Path, tower: VisionConfig) -> ImageProcessing:
        config = json.loads(file.read_text()) if file.exists() else {}
        patch = config.get("patch_size", tower.patch_size)
        if isinstance(patch, dict):
            patch = patch["height"] if patch.get("height") == patch.get("width") else patch
        if patch != tower.patch_size:
            raise ValueError(f"{file}: patch_size {patch} is not the vision tower's {tower.patch_size}")
        return cls.longest_edge_of(tower, tuple(config.get("image_mean", CLIP_MEAN)),
                                   tuple(config.get("image_std", CLIP_STD)),
                                   int((config.get("size") or {}).get("longest_edge", tower.longest_edge)),
                                   _resample(config, Image.Resampling.BICUBIC, file))

    @classmethod
    def longest_edge_of(cls, tower: VisionConfig, mean: tuple[float, ...], std: tuple[float, ...],
                        longest_edge: int, resample: int = Image.Resampling.BICUBIC) -> ImageProcessing:
        """Pixtral's (Mistral 3's): an image within longest_edge a side, each side rounded up to a merged token."""
        return cls(patch_size=tower.patch_size, temporal_patch_size=1, merge_size=tower.merge_size, mean=mean,
                   std=std, longest_edge=longest_edge, resample=resample)

    @classmethod
    def _siglip(cls, file: Path, tower: VisionConfig) -> ImageProcessing:
        config = json.loads(file.read_text()) if file.exists() else {}
        if config.get("do_pan_and_scan"):
            raise ValueError(f"{file}: do_pan_and_scan: Gemma 3's pan and scan (crops of an image as more images) is "
                             "not supported")
        size = config.get("size") or {"height": tower.longest_edge, "width": tower.longest_edge}
        if (size.get("height"), size.get("width")) != (tower.longest_edge, tower.longest_edge):
            raise ValueError(f"{file}: size {size} is not the vision tower's {tower.longest_edge}x{tower.longest_edge}")
        half = (0.5, 0.5, 0.5)  # HF's Gemma 3 processor's defaults (ImageNet's standard mean and deviation)
        return cls.square_of(tower, tuple(config.get("image_mean", half)), tuple(config.get("image_std", half)),
                             _resample(config, Image.Resampling.BILINEAR, file))

    @classmethod
    def square_of(cls, tower: VisionConfig, mean: tuple[float, ...], std: tuple[float, ...],
                  resample: int = Image.Resampling.BILINEAR) -> ImageProcessing:
        """SigLIP's (Gemma 3's): every image resized to the tower's square, its patches pooled merge_size a side."""
        return cls(patch_size=tower.patch_size, temporal_patch_size=1, merge_size=tower.merge_size, mean=mean,
                   std=std, square=tower.longest_edge, resample=resample)

    @property
    def factor(self) -> int:
        """A resized side's multiple: one merged token's pixels."""
        return self.patch_size * self.merge_size

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The size an image is resized to: each side a multiple of `factor`, the area within [min_pixels,
        max_pixels], the aspect ratio kept as closely as that allows (Pixtral's: within longest_edge a side)."""
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ValueError(f"image: an aspect ratio of {max(height, width) / min(height, width):.0f} is over the "
                             f"limit of {MAX_ASPECT_RATIO}")
        factor = self.factor
        if self.square is not None:
            return self.square, self.square
        if self.longest_edge is not None:
            ratio = max(height, width) / self.longest_edge
            if ratio > 1:
                height, width = math.floor(height / ratio), math.floor(width / ratio)
            return math.ceil(height / factor) * factor, math.ceil(width / factor) * factor
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w


def _resample(config: dict[str, Any], default: int, file: Path) -> int:
    """The config's resize filter (PIL's codes); its other steps checked to be the ones preprocess_image takes."""
    for step in ("do_resize", "do_rescale", "do_normalize"):
        if config.get(step) is False:
            raise ValueError(f"{file}: {step}: false is not supported (ridge's preprocessing always takes this step)")
    if abs(config.get("rescale_factor", 1 / 255) - 1 / 255) > 1e-9:
        raise ValueError(f"{file}: rescale_factor: {config['rescale_factor']} is not supported (1/255)")
    resample = config.get("resample", default)
    if resample not in set(Image.Resampling):
        raise ValueError(f"{file}: resample: {resample!r} is not one of PIL's filters")
    return int(resample)


# HF's Qwen2VLImageProcessor's defaults (Qwen2-VL's and Qwen2.5-VL's)
QWEN2_VL_PROCESSING = ImageProcessing()
# HF's preprocessor_config.json of the Qwen3-VL models (Qwen2VLImageProcessor's under other defaults)
QWEN3_VL_PROCESSING = ImageProcessing(min_pixels=65536, max_pixels=16777216, patch_size=16, mean=(0.5, 0.5, 0.5),
                                      std=(0.5, 0.5, 0.5))


@dataclass(frozen=True)
class ImagePatches:
    """One image ready for the vision tower: its patches [rows * columns, patch values] (float32), its grid of
    patches (frames, rows, columns), and a digest of its pixels (what the prefix cache keys it by)."""

    patches: torch.Tensor
    grid: tuple[int, int, int]
    digest: bytes

    def num_tokens(self, merge_size: int) -> int:
        frames, rows, columns = self.grid
        return frames * rows * columns // merge_size**2


def load_image(source: Any, local_files: bool | Path = True) -> Image.Image:
    """A PIL image from a PIL image, encoded bytes, a data: URL, an http(s) URL (fetched), or a local file's path
    (local_files: True, any; a directory, only under it: a server's --allowed-local-media-path; False, none); RGB."""
    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, bytes | bytearray):
        image = _decode(bytes(source), "image")
    elif isinstance(source, str) and source.startswith("data:"):
        image = _decode(data_url_bytes(source), "image_url")
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        image = _decode(fetch_image(source), "image_url")
    elif isinstance(source, str | Path):
        image = _decode(_local_file(Path(str(source).removeprefix("file://")), local_files), "image_url")
    else:
        raise ValueError(f"image: a {type(source).__name__} is not an image (a PIL image, bytes, a data: URL or a "
                         "path)")
    return image.convert("RGB")


def _local_file(path: Path, local_files: bool | Path) -> bytes:
    if local_files is False:
        raise ValueError("image_url: a data: URL or an http(s) URL; this server reads no local files (its "
                         "--allowed-local-media-path)")
    if isinstance(local_files, Path) and not path.resolve().is_relative_to(local_files.resolve()):
        raise ValueError(f"image_url: local files are read only under the server's --allowed-local-media-path "
                         f"({local_files}); {str(path)[:200]!r} is not")
    if not path.is_file():
        raise ValueError(f"image_url: {str(path)[:200]!r} is not a data: URL, an http(s) URL or an image file")
    return path.read_bytes()


def fetch_image(url: str) -> bytes:
    """An image's bytes from an http(s) URL: within FETCH_TIMEOUT_S and MAX_IMAGE_BYTES, or ValueError naming it."""
    import httpx  # the server's client, imported where an image is fetched

    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=True) as response:
            response.raise_for_status()
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise ValueError(f"image_url: {url[:200]} is over the limit of {MAX_IMAGE_BYTES >> 20} MiB")
            return bytes(data)
    except httpx.HTTPError as exc:
        raise ValueError(f"image_url: {url[:200]} could not be fetched ({exc})") from exc


def data_url_bytes(url: str) -> bytes:
    """The bytes of a base64 data: URL (data:image/png;base64,...)."""
    header, _, payload = url.partition(",")
    if not header.endswith(";base64") or not payload:
        raise ValueError("image_url: a data: URL must be base64 (data:image/...;base64,<data>)")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"image_url: the data: URL's base64 does not decode ({exc})") from exc


def _decode(data: bytes, field: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, Image.DecompressionBombError, ValueError) as exc:
        raise ValueError(f"{field}: not a readable image ({exc})") from exc
    return image


def preprocess_image(image: Image.Image, processing: ImageProcessing) -> ImagePatches:
    """An RGB image -> its patches: resized, scaled to [0, 1], normalized per channel, cut into patches in the
    order the tower's merger reads them (each merge x merge unit's patches consecutive), each patch twice in time."""
    p, merge, frames = processing.patch_size, processing.merge_size, processing.temporal_patch_size
    height, width = processing.resized(image.height, image.width)
    if (image.height, image.width) != (height, width):
        image = image.resize((width, height), Image.Resampling(processing.resample))
    pixels = np.asarray(image, dtype=np.float32) / 255.0  # [H, W, C]
    pixels = (pixels - np.asarray(processing.mean, dtype=np.float32)) / np.asarray(processing.std, dtype=np.float32)
    channels = pixels.shape[-1]
    rows, columns = height // p, width // p
    units = pixels.transpose(2, 0, 1).reshape(channels, rows // merge, merge, p, columns // merge, merge, p)
    units = units.transpose(1, 4, 2, 5, 0, 3, 6)  # [unit row, unit column, row in unit, column in unit, C, p, p]
    patches = np.broadcast_to(units[:, :, :, :, :, None], (*units.shape[:5], frames, p, p))
    flat = torch.from_numpy(np.ascontiguousarray(patches).reshape(rows * columns, channels * frames * p * p))
    return ImagePatches(flat, (1, rows, columns), image_digest(image))


def image_digest(image: Image.Image) -> bytes:
    """A digest of an image's size and pixels: the same picture sent twice keys the same cached blocks."""
    return hashlib.blake2b(f"{image.width}x{image.height}".encode() + image.tobytes(), digest_size=16).digest()

