"""Mosaic (``mosaic=1``) and blend (``mixup=1``) of several augmented images into one.

Mosaic, as Darknet's ``load_data_detection`` does it: a centre (``cut_x``, ``cut_y``) drawn
between 20% and 80% of the network size; four images augmented at the full network size;
from each the part that fills its quadrant (0 top-left, 1 top-right, 2 bottom-left,
3 bottom-right), taken next to the quadrant's corner at the centre, shifted inwards when
the crop was padded on that side (so that the padding stays out of the mosaic where it
can); the truths moved with their pixels and clipped (``blend_truth_mosaic``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .augment import Placement
from .draws import rand_int

__all__ = ["MosaicCut", "blend_truths", "draw_cut", "mosaic_truths", "paste_piece", "shifts"]

_F32 = np.float32
# Darknet keeps the mosaic's centre at least this fraction of the size from every edge.
_MIN_OFFSET = _F32(0.2)


@dataclass(frozen=True)
class MosaicCut:
    """The mosaic's centre and each side's inward shift, in network pixels."""

    cut_x: int
    cut_y: int
    left_shift: int = 0
    right_shift: int = 0
    top_shift: int = 0
    bot_shift: int = 0


def draw_cut(rng: np.random.Generator, net_w: int, net_h: int) -> tuple[int, int]:
    """The mosaic centre: integers in [0.2 w, 0.8 w] and [0.2 h, 0.8 h] (truncated)."""
    low_w = int(_F32(net_w) * _MIN_OFFSET)
    high_w = int(_F32(net_w) * (_F32(1) - _MIN_OFFSET))
    low_h = int(_F32(net_h) * _MIN_OFFSET)
    high_h = int(_F32(net_h) * (_F32(1) - _MIN_OFFSET))
    return rand_int(rng, low_w, high_w), rand_int(rng, low_h, high_h)


def shifts(
    cut_x: int, cut_y: int, placement: Placement, flip: bool, net_w: int, net_h: int
) -> MosaicCut:
    """How far a piece's quadrant moves inwards in its augmented image: the padding the
    crop added on each side (negative ``p*`` offsets) in network pixels, at most the room
    the quadrant leaves. A flipped image's left and right offsets are swapped first."""
    p = placement
    pleft, pright = (p.pright, p.pleft) if flip else (p.pleft, p.pright)

    def inward(offset: int, size: int, original: int) -> int:
        # Darknet's max(0, -offset * size / original): a negative quotient (C truncates,
        # Python floors) ends at 0 either way.
        return max(0, (-offset * size) // original)

    return MosaicCut(
        cut_x=cut_x,
        cut_y=cut_y,
        left_shift=min(cut_x, inward(pleft, net_w, p.ow)),
        top_shift=min(cut_y, inward(p.ptop, net_h, p.oh)),
        right_shift=min(net_w - cut_x, inward(pright, net_w, p.ow)),
        bot_shift=min(net_h - cut_y, inward(p.pbot, net_h, p.oh)),
    )


def paste_piece(canvas: np.ndarray, piece_img: np.ndarray, piece: int, cut: MosaicCut) -> None:
    """Copy the part of ``piece_img`` (H, W, C) that fills quadrant ``piece`` of ``canvas``
    (H, W, C), in place."""
    h, w = canvas.shape[:2]
    cx, cy = cut.cut_x, cut.cut_y
    if piece in (0, 2):
        cols, src_x = slice(0, cx), w - cx - cut.right_shift
    else:
        cols, src_x = slice(cx, w), cut.left_shift
    if piece in (0, 1):
        rows, src_y = slice(0, cy), h - cy - cut.bot_shift
    else:
        rows, src_y = slice(cy, h), cut.top_shift
    height = rows.stop - rows.start
    width = cols.stop - cols.start
    canvas[rows, cols] = piece_img[src_y : src_y + height, src_x : src_x + width]


def mosaic_truths(
    existing: np.ndarray,
    truths: np.ndarray,
    piece: int,
    cut: MosaicCut,
    *,
    net_w: int,
    net_h: int,
    max_boxes: int,
    mosaic_bound: bool,
) -> np.ndarray:
    """``existing`` truths with those of ``piece`` appended (``blend_truth_mosaic``).

    Each box is moved with its pixels; then either clipped to its quadrant
    (``mosaic_bound``) or only to the whole image (Darknet's default: a box may then reach
    into a neighbouring quadrant), and kept only if it lies inside the image with centre
    and size strictly between 0 and 1 and is wider and higher than one network pixel. At
    most ``max_boxes`` rows in all. Rows are (class, cx, cy, w, h), float32.
    """
    w, h = _F32(net_w), _F32(net_h)
    cx, cy = cut.cut_x, cut.cut_y
    lowest_w, lowest_h = _F32(1) / w, _F32(1) / h
    if piece in (0, 2):
        move_x = -(_F32(net_w - cx - cut.right_shift) / w)
        bound_x = (_F32(0), _F32(cx))
    else:
        move_x = _F32(cx - cut.left_shift) / w
        bound_x = (_F32(cx), w)
    if piece in (0, 1):
        move_y = -(_F32(net_h - cy - cut.bot_shift) / h)
        bound_y = (_F32(0), _F32(cy))
    else:
        move_y = _F32(cy - cut.top_shift) / h
        bound_y = (_F32(cy), h)

    rows = list(existing)
    room = max_boxes - len(rows)
    for cls, xb, yb, wb, hb in truths[: max(room, 0)]:
        xb, yb = xb + move_x, yb + move_y
        two = _F32(2)
        left = int(np.trunc((xb - wb / two) * w))
        right = int(np.trunc((xb + wb / two) * w))
        top = int(np.trunc((yb - hb / two) * h))
        bot = int(np.trunc((yb + hb / two) * h))
        if mosaic_bound:
            left = int(max(left, bound_x[0]))
            right = int(min(right, bound_x[1]))
            top = int(max(top, bound_y[0]))
            bot = int(min(bot, bound_y[1]))
            xb = (_F32(right + left) / two) / w
            wb = _F32(right - left) / w
            yb = (_F32(bot + top) / two) / h
            hb = _F32(bot - top) / h
        else:
            if left < 0:
                diff = _F32(left) / w
                xb, wb = xb - diff / two, wb + diff
            if right > net_w:
                diff = _F32(right - net_w) / w
                xb, wb = xb - diff / two, wb - diff
            if top < 0:
                diff = _F32(top) / h
                yb, hb = yb - diff / two, hb + diff
            if bot > net_h:
                diff = _F32(bot - net_h) / h
                yb, hb = yb - diff / two, hb - diff
            left = int(np.trunc((xb - wb / two) * w))
            right = int(np.trunc((xb + wb / two) * w))
            top = int(np.trunc((yb - hb / two) * h))
            bot = int(np.trunc((yb + hb / two) * h))
        inside = left >= 0 and right <= net_w and top >= 0 and bot <= net_h
        if (
            inside
            and 0 < wb < 1
            and 0 < hb < 1
            and 0 < xb < 1
            and 0 < yb < 1
            and wb > lowest_w
            and hb > lowest_h
        ):
            rows.append(np.array([cls, xb, yb, wb, hb], np.float32))
    if not rows:
        return np.zeros((0, 5), np.float32)
    return np.stack(rows).astype(np.float32)


def blend_truths(first: np.ndarray, second: np.ndarray, max_boxes: int) -> np.ndarray:
    """The truths of two blended images (``mixup=1``, Darknet's ``blend_truth``): the
    first image's, then the second's, at most ``max_boxes`` rows."""
    return np.concatenate([first, second])[:max_boxes].astype(np.float32)
