"""Geometry of Darknet's detection augmentation: crops, letterbox, zoom, flip, mosaic.

Scenes of coloured rectangles are augmented and every output truth box is compared with the
rectangle found in the output pixels. The crop offsets and the kept/dropped boxes are also
compared with an oracle written here from Darknet's formulas (``load_data_detection``,
``correct_boxes`` and ``fill_truth_detection`` in src-lib/data.cpp), in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from loading_scenes import Colours, pixel_box, scene, to_uint8, truth_pixels, write_png

from darknet_metal.training.loading import LoaderSettings, SampleSource, load_slot
from darknet_metal.training.loading.augment import (
    ImageDraws,
    augment_pixels,
    place,
    transform_truths,
)
from darknet_metal.training.loading.mosaic import MosaicCut, mosaic_truths

NET_W, NET_H = 416, 320
SRC_W, SRC_H = 640, 480
RECTS = [
    (20, 30, 90, 120),     # near the left edge: cut away by a large left crop
    (100, 200, 180, 260),  # partly cut by the same crop
    (300, 150, 420, 330),  # in the middle
    (520, 380, 630, 470),  # bottom right
    (330, 40, 331, 90),    # one source pixel wide: under one network pixel, dropped
    (200, 400, 300, 402),  # two source pixels high
]


def _oracle_place(ow, oh, s, d, net_w, net_h):
    """Darknet's crop offsets (load_data_detection) with C truncation; float64, except the
    zoom limits, which Darknet's float arithmetic puts on the other side of an integer for
    resize=1.5 (480 * (1 - 1/1.5f) / 2 = 79.99999 in float32, 80.00000000000001 in double)."""
    def t(v):
        return math.trunc(float(v))

    f = np.float32
    dw, dh = t(ow * s.jitter), t(oh * s.jitter)
    down = f(1) / f(s.resize) if s.resize > 1 else f(s.resize)
    up = f(1) / f(s.resize) if s.resize < 1 else f(s.resize)
    min_rdw = t(f(ow) * (f(1) - f(1) / down) / f(2))
    min_rdh = t(f(oh) * (f(1) - f(1) / down) / f(2))
    max_rdw = t(f(ow) * (f(1) - f(1) / up) / f(2))
    max_rdh = t(f(oh) * (f(1) - f(1) / up) / f(2))
    pleft = t(d.r1 * 2 * dw - dw)
    pright = t(d.r2 * 2 * dw - dw)
    ptop = t(d.r3 * 2 * dh - dh)
    pbot = t(d.r4 * 2 * dh - dh)
    hi_w = 0 if s.resize < 1 else max_rdw
    hi_h = 0 if s.resize < 1 else max_rdh
    pleft = t(pleft + d.resize_r1 * (hi_w - min_rdw) + min_rdw)
    pright = t(pright + d.resize_r2 * (hi_w - min_rdw) + min_rdw)
    ptop = t(ptop + d.resize_r1 * (hi_h - min_rdh) + min_rdh)
    pbot = t(pbot + d.resize_r2 * (hi_h - min_rdh) + min_rdh)
    if s.letter_box:
        net_ar = net_w / net_h
        if (ow / oh) / net_ar > 1:
            delta = (ow / net_ar - oh) / 2
            ptop, pbot = t(ptop - delta), t(pbot - delta)
        else:
            delta = (oh * net_ar - ow) / 2
            pleft, pright = t(pleft - delta), t(pright - delta)
    return pleft, pright, ptop, pbot


def _oracle_truths(boxes, offsets, ow, oh, flip, net_w, net_h):
    """correct_boxes + fill_truth_detection's drop rule, as geometry: each box's edges in
    the crop, mirrored, clipped, dropped under one network pixel. Rows sorted by class."""
    pleft, pright, ptop, pbot = offsets
    sw, sh = ow - pleft - pright, oh - ptop - pbot
    rows = []
    for cls, cx, cy, w, h in boxes.astype(np.float64):
        left = ((cx - w / 2) * ow - pleft) / sw
        right = ((cx + w / 2) * ow - pleft) / sw
        top = ((cy - h / 2) * oh - ptop) / sh
        bottom = ((cy + h / 2) * oh - ptop) / sh
        if flip:
            left, right = 1 - right, 1 - left
        left, right = np.clip([left, right], 0, 1)
        top, bottom = np.clip([top, bottom], 0, 1)
        if right - left < 1 / net_w or bottom - top < 1 / net_h:
            continue
        rows.append([cls, (left + right) / 2, (top + bottom) / 2, right - left, bottom - top])
    return np.array(rows).reshape(-1, 5)


def _check_pixels(out_rgb, truths, all_classes, width, height, tolerance=1.5):
    """Every truth box lies on its rectangle's pixels; every class without a truth has
    (almost) no pixels left."""
    colours = Colours(out_rgb)
    for row in truths:
        left, top, right, bottom = truth_pixels(row, width, height)
        x0, y0 = max(int(left) - 3, 0), max(int(top) - 3, 0)
        window = np.zeros(out_rgb.shape[:2], bool)
        window[y0 : int(bottom) + 4, x0 : int(right) + 4] = True
        found = pixel_box(colours.mask(int(row[0])) & window)
        assert found is not None, f"class {int(row[0])}: no pixels under its box"
        np.testing.assert_allclose(found, (left, top, right, bottom), atol=tolerance,
                                   err_msg=f"class {int(row[0])}")
    kept = {int(r[0]) for r in truths}
    for cls in set(all_classes) - kept:
        found = pixel_box(colours.mask(cls, pure=True))
        if found is not None:
            assert min(found[2] - found[0], found[3] - found[1]) <= 2, (
                f"class {cls} was dropped but shows {found}"
            )


CASES = {
    "plain": ({}, ImageDraws()),
    "jitter-crop": ({"jitter": 0.3},
                    ImageDraws(r1=0.97, r2=0.12, r3=0.07, r4=0.83)),
    "jitter-crop-flip": ({"jitter": 0.3},
                         ImageDraws(r1=0.97, r2=0.12, r3=0.07, r4=0.83, flip=True)),
    "zoom-out": ({"jitter": 0.1, "resize": 1.5},
                 ImageDraws(r1=0.3, r2=0.8, r3=0.6, r4=0.2, resize_r1=0.1, resize_r2=0.3)),
    "zoom-in": ({"jitter": 0.1, "resize": 1.5},
                ImageDraws(resize_r1=0.93, resize_r2=0.88)),
    "letterbox": ({"letter_box": 1, "jitter": 0.2},
                  ImageDraws(r1=0.4, r2=0.7, r3=0.55, r4=0.45)),
    "letterbox-flip": ({"letter_box": 1, "jitter": 0.25},
                       ImageDraws(r1=0.9, r2=0.2, r3=0.3, r4=0.6, flip=True)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("src_size", [(SRC_W, SRC_H), (480, 640)], ids=["landscape", "portrait"])
def test_fixed_draws_match_pixels_and_darknet(name, src_size):
    overrides, draws = CASES[name]
    ow, oh = src_size
    rects = [(x0 * ow // SRC_W, y0 * oh // SRC_H, max(x1 * ow // SRC_W, x0 * ow // SRC_W + 1),
              max(y1 * oh // SRC_H, y0 * oh // SRC_H + 1)) for x0, y0, x1, y1 in RECTS]
    rgb, boxes = scene(ow, oh, rects)
    settings = LoaderSettings(width=NET_W, height=NET_H, **overrides)
    placement = place(ow, oh, settings, draws, net_w=NET_W, net_h=NET_H)
    expected_offsets = _oracle_place(ow, oh, settings, draws, NET_W, NET_H)
    assert (placement.pleft, placement.pright, placement.ptop, placement.pbot) == expected_offsets

    rng = np.random.default_rng(0)
    truths, _ = transform_truths(boxes, placement, flip=draws.flip, net_w=NET_W, net_h=NET_H,
                                 max_boxes=200, rng=rng)
    oracle = _oracle_truths(boxes, expected_offsets, ow, oh, draws.flip, NET_W, NET_H)
    ordered = truths[np.argsort(truths[:, 0])]
    assert ordered[:, 0].tolist() == oracle[:, 0].tolist()
    np.testing.assert_allclose(ordered, oracle, atol=2e-6)

    out = augment_pixels(rgb, placement, draws, truths, 0, net_w=NET_W, net_h=NET_H, rng=rng)
    assert out.shape == (NET_H, NET_W, 3) and out.dtype == np.uint8
    _check_pixels(out, truths, boxes[:, 0].astype(int).tolist(), NET_W, NET_H)


def test_crop_pads_with_the_image_mean():
    rgb, boxes = scene(SRC_W, SRC_H, [(0, 0, 320, 480)])  # left half coloured
    settings = LoaderSettings(width=NET_W, height=NET_H, jitter=0.3)
    draws = ImageDraws(r1=0.0, r2=0.5, r3=0.5, r4=0.5)  # the left side padded by 192 px
    placement = place(SRC_W, SRC_H, settings, draws, net_w=NET_W, net_h=NET_H)
    assert placement.pleft == -192
    out = augment_pixels(rgb, placement, draws, boxes, 0, net_w=NET_W, net_h=NET_H,
                         rng=np.random.default_rng(0))
    mean = np.rint(rgb.reshape(-1, 3).mean(axis=0))
    np.testing.assert_array_equal(out[:, :40].reshape(-1, 3), np.tile(mean, (40 * NET_H, 1)))


def test_max_boxes_keeps_a_random_subset():
    rects = [(10 + 60 * i, 10, 50 + 60 * i, 60) for i in range(10)]
    rgb, boxes = scene(SRC_W, SRC_H, rects)
    settings = LoaderSettings(width=NET_W, height=NET_H)
    placement = place(SRC_W, SRC_H, settings, ImageDraws(), net_w=NET_W, net_h=NET_H)
    kept = set()
    for seed in range(6):
        truths, _ = transform_truths(boxes, placement, flip=False, net_w=NET_W, net_h=NET_H,
                                     max_boxes=3, rng=np.random.default_rng(seed))
        assert len(truths) == 3
        kept |= {int(c) for c in truths[:, 0]}
    assert len(kept) > 3


def _mosaic_sources(tmp_path, count=6):
    samples = []
    for i in range(count):
        rects = [(40 + 30 * i, 40 + 15 * i, 200 + 30 * i, 180 + 15 * i),  # apart from
                 (400, 280 - 20 * i, 600 - 10 * i, 450 - 10 * i)]        # each other
        rgb, boxes = scene(SRC_W, SRC_H, rects, first_id=2 * i)
        samples.append((write_png(tmp_path / f"scene{i}.png", rgb), boxes))
    return samples


@pytest.mark.parametrize("mode", ["mosaic", "plain"])
def test_random_batches_match_pixels(tmp_path, mode):
    """End to end through load_slot with random draws: jitter, zoom, flip and (plain) the
    letterbox, or (mosaic) four pieces around a random centre with mosaic_bound=1."""
    samples = _mosaic_sources(tmp_path)
    extra = {"mixup": 3, "mosaic_bound": 1} if mode == "mosaic" else {"letter_box": 1}
    width, height = 288, 224
    settings = LoaderSettings(width=width, height=height, batch=1, jitter=0.3, resize=1.3,
                              **extra)
    source = SampleSource(samples)
    all_classes = list(range(2 * len(samples)))
    composed = 0
    for slot in range(10):
        x, truths, _ = load_slot(source, settings, 7, 0, slot, width=width, height=height)
        out = to_uint8(x)
        colours = Colours(out)
        composed += len({int(c) // 2 for c in truths[:, 0]}) > 1
        for row in truths:
            left, top, right, bottom = truth_pixels(row, width, height)
            x0, y0 = max(int(left) - 3, 0), max(int(top) - 3, 0)
            window = np.zeros(out.shape[:2], bool)
            window[y0 : int(bottom) + 4, x0 : int(right) + 4] = True
            found = pixel_box(colours.mask(int(row[0])) & window)
            assert found is not None
            np.testing.assert_allclose(found, (left, top, right, bottom), atol=2.0)
        # Every rectangle visible over 4x4 pixels has a truth of its class over it.
        for cls in all_classes:
            mask = colours.mask(cls, pure=True)
            box = pixel_box(mask)
            if box is None or box[2] - box[0] < 4 or box[3] - box[1] < 4:
                continue
            covered = np.zeros_like(mask)
            for row in truths[truths[:, 0] == cls]:
                left, top, right, bottom = truth_pixels(row, width, height)
                covered[max(int(top) - 1, 0) : int(bottom) + 2,
                        max(int(left) - 1, 0) : int(right) + 2] = True
            assert not (mask & ~covered).any(), (
                f"slot {slot}: class {cls} visible outside its truths"
            )
    if mode == "mosaic":
        assert composed >= 3  # about half the slots are mosaics of several images


def test_mosaic_bound_clips_to_the_quadrant():
    """A piece-0 box crossing the centre: Darknet's default keeps its full extent (clipped
    only to the image), mosaic_bound=1 cuts it at the centre. Hand-computed, with sizes
    whose fractions float32 holds exactly."""
    cut = MosaicCut(cut_x=256, cut_y=128)
    empty = np.zeros((0, 5), np.float32)

    def both(row):
        rows = np.array([row], np.float32)
        return [mosaic_truths(empty, rows, 0, cut, net_w=512, net_h=256, max_boxes=10,
                              mosaic_bound=bound) for bound in (False, True)]

    # Piece 0 shows its image's columns [256, 512) at [0, 256) and rows [128, 256) at
    # [0, 128). A box at rows 32..96 of the piece moves to -96..-32: outside, dropped.
    loose, bound = both([5, 0.875, 0.25, 0.375, 0.25])
    assert len(loose) == 0 and len(bound) == 0
    # Columns 352..544 -> 96..288, across the cut at 256; rows 160..224 -> 32..96.
    loose, bound = both([5, 0.875, 0.75, 0.375, 0.25])
    np.testing.assert_array_equal(loose, [[5, 0.375, 0.25, 0.375, 0.25]])
    np.testing.assert_array_equal(bound, [[5, 176 / 512, 0.25, 160 / 512, 0.25]])


def test_mosaic_drops_boxes_touching_the_rule_limits():
    """blend_truth_mosaic keeps a box only strictly inside (0, 1) in centre and size and
    wider and higher than one pixel: a box filling the whole width is dropped."""
    cut = MosaicCut(cut_x=208, cut_y=160)
    empty = np.zeros((0, 5), np.float32)
    full_width = np.array([[1, 0.5 + 208 / 416, 0.5, 1.0, 0.2]], np.float32)
    assert len(mosaic_truths(empty, full_width, 0, cut, net_w=416, net_h=320, max_boxes=5,
                             mosaic_bound=False)) == 0
    thin = np.array([[1, 0.3, 0.3, 0.5 / 416, 0.1]], np.float32)  # 0.5 px wide
    assert len(mosaic_truths(empty, thin, 3, cut, net_w=416, net_h=320, max_boxes=5,
                             mosaic_bound=False)) == 0
    many = np.tile(np.array([[1, 0.3, 0.3, 0.1, 0.1]], np.float32), (4, 1))
    two = mosaic_truths(empty, many, 3, cut, net_w=416, net_h=320, max_boxes=2,
                        mosaic_bound=False)
    assert len(two) == 2
