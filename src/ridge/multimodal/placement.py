"""Images placed in a token prompt: each image's one placeholder token widened to the tokens the vision tower makes
of it, and the prompt's multimodal rotary positions (Qwen2-VL's M-RoPE). Mistral 3's images are laid out row by row,
a break token after each row and an end token after the last, Gemma 3's between newlines and a start and an end
token; both turn at their indexes as text does.

M-RoPE turns each head's frequencies in three sections by three positions: time, row and column. A text token's
three are equal, one past the position before it; an image's tokens sit on its grid of merged patches (time fixed,
row and column counting from where the image starts), and the text after it resumes one past the grid's largest
position. A prompt's positions thus run behind its token indexes by `rope_delta` after its last image, and every
later token (a reply's) turns at its index plus that delta, all three sections alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ridge.multimodal.images import ImagePatches, ImageProcessing, load_image, preprocess_image


@dataclass
class PlacedImage:
    """An image in a prompt: its first token's index, its tokens, its patches; and the tower's output for it
    [tokens, levels, hidden], computed when a step first computes one of its tokens and dropped when its prefill is
    done. rows: the places in its span that read the tower's rows, in order (Mistral 3's: all but the row breaks
    and the end token; Gemma 3's: all but the newlines and the start and end tokens); None: every token of the
    span."""

    offset: int
    length: int
    image: ImagePatches
    embeddings: torch.Tensor | None = None
    rows: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def places(self) -> torch.Tensor:
        """The places of its span that read the tower's rows, in the rows' order."""
        return torch.arange(self.length) if self.rows is None else self.rows


@dataclass
class ImagePrompt:
    """A prompt with its images placed: token ids (the placeholders widened), the images in order, and the rotary
    positions [3, len(token_ids)] and delta its tokens turn by (None and 0: every token at its index)."""

    token_ids: list[int]
    images: list[PlacedImage]
    rope_positions: torch.Tensor | None
    rope_delta: int


@dataclass(frozen=True)
class ImageReader:
    """How an engine of a vision model reads a request's images: preprocessed by `processing`, placed at its
    placeholder token; `refused`: why this engine takes none (its configuration), said when a request brings one.
    Made by the engine, and sent to the server's process, which prepares a request's images before queuing it.
    row_break_id, image_end_id: Mistral 3's layout (place_rows) where set; placeholder_id, before, after: Gemma 3's
    (place_framed) where placeholder_id is set."""

    processing: ImageProcessing
    image_token_id: int
    merge_size: int
    refused: str | None = None
    row_break_id: int | None = None
    image_end_id: int | None = None
    placeholder_id: int | None = None
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()

    def place(self, token_ids: list[int], sources: list, local_files: bool | Path = True) -> ImagePrompt:
        """token_ids with the images of `sources` placed (multimodal/images.py's load_image reads them, and local
        files as local_files allows); ValueError naming what cannot be read."""
        if self.refused is not None:
            raise ValueError(f"images: not supported with {self.refused}")
        images = [preprocess_image(load_image(source, local_files), self.processing) for source in sources]
        if self.placeholder_id is not None:
            return place_framed(token_ids, images, self.placeholder_id, self.image_token_id, self.merge_size,
                                self.before, self.after)
        if self.row_break_id is not None and self.image_end_id is not None:
            return place_rows(token_ids, images, self.image_token_id, self.merge_size, self.row_break_id,
                              self.image_end_id)
        return place_images(token_ids, images, self.image_token_id, self.merge_size)


def _placeholders(token_ids: list[int], images: list[ImagePatches], image_token_id: int) -> list[int]:
    """The placeholders' indexes: as many as the images, and single (a prompt whose template already widened them
    is not widened twice)."""
    marks = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(marks) != len(images):
        raise ValueError(f"prompt: {len(marks)} image placeholder tokens (id {image_token_id}) for {len(images)} "
                         "images; each image needs one where it goes (the chat template puts them)")
    return marks


def place_rows(token_ids: list[int], images: list[ImagePatches], image_token_id: int, merge_size: int,
               row_break_id: int, image_end_id: int) -> ImagePrompt:
    """Widen the i-th placeholder to images[i]'s rows of merged tokens, each row followed by a break and the last
    by the end token instead (Pixtral's layout); the tokens turn at their indexes."""
    widened: list[int] = []
    placed: list[PlacedImage] = []
    previous = 0
    for mark, image in zip(_placeholders(token_ids, images, image_token_id), images, strict=True):
        widened += token_ids[previous:mark]
        rows, columns = image.grid[1] // merge_size, image.grid[2] // merge_size
        span = ([image_token_id] * columns + [row_break_id]) * rows
        span[-1] = image_end_id
        read = torch.arange(len(span)).view(rows, columns + 1)[:, :columns].flatten()
        placed.append(PlacedImage(len(widened), len(span), image, rows=read))
        widened += span
        previous = mark + 1
    return ImagePrompt(widened + token_ids[previous:], placed, None, 0)


def place_framed(token_ids: list[int], images: list[ImagePatches], placeholder_id: int, image_token_id: int,
                 merge_size: int, before: tuple[int, ...], after: tuple[int, ...]) -> ImagePrompt:
    """Replace the i-th placeholder with `before`, images[i]'s tokens, `after` (Gemma 3's: the newlines and its
    start token, then its end token and the newlines); the tokens turn at their indexes."""
    widened: list[int] = []
    placed: list[PlacedImage] = []
    previous = 0
    for mark, image in zip(_placeholders(token_ids, images, placeholder_id), images, strict=True):
        widened += token_ids[previous:mark]
        tokens = image.num_tokens(merge_size)
        rows = torch.arange(len(before), len(before) + tokens)
        placed.append(PlacedImage(len(widened), len(before) + tokens + len(after), image, rows=rows))
        widened += [*before, *[image_token_id] * tokens, *after]
        previous = mark + 1
    return ImagePrompt(widened + token_ids[previous:], placed, None, 0)


def place_images(token_ids: list[int], images: list[ImagePatches], image_token_id: int,
                 merge_size: int) -> ImagePrompt:
    """Widen the i-th placeholder (image_token_id) of token_ids to images[i]'s tokens, on M-RoPE's positions."""
    marks = _placeholders(token_ids, images, image_token_id)
    widened: list[int] = []
    placed: list[PlacedImage] = []
    sections: list[torch.Tensor] = []
    position = previous = 0
    for mark, image in zip(marks, images, strict=True):
        text = token_ids[previous:mark]
        widened += text
        sections.append(torch.arange(position, position + len(text)).expand(3, -1))
        position += len(text)
        length = image.num_tokens(merge_size)
        placed.append(PlacedImage(len(widened), length, image))
        widened += [image_token_id] * length
        frames, rows, columns = image.grid[0], image.grid[1] // merge_size, image.grid[2] // merge_size
        t, r, c = torch.meshgrid(torch.zeros(frames, dtype=torch.long), torch.arange(rows), torch.arange(columns),
                                 indexing="ij")
        sections.append(torch.stack([t.flatten(), r.flatten(), c.flatten()]) + position)
        position += max(rows, columns)
        previous = mark + 1
    tail = token_ids[previous:]
    widened += tail
    sections.append(torch.arange(position, position + len(tail)).expand(3, -1))
    positions = torch.cat(sections, dim=1)
    return ImagePrompt(widened, placed, positions, int(positions.max()) + 1 - len(widened))
