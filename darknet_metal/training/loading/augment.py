"""One training image as Darknet's ``load_data_detection`` makes it (data.cpp), without mosaic.

The steps, in Darknet's order:

1. draws (:func:`draw_image`): four crop fractions, two resize fractions, flip, hue,
   saturation and exposure factors, blur mode, gaussian noise on or off;
2. the crop (:func:`place`): each side of the source moves in or out by up to
   ``jitter`` of the image (``pleft``, ``pright``, ``ptop``, ``pbot``; negative = padding),
   plus ``resize``'s zoom, plus the letterbox padding that keeps the aspect ratio;
3. the truths (:func:`transform_truths`, Darknet's ``fill_truth_detection`` and
   ``correct_boxes``): shuffled, cut to ``max`` boxes, moved into the crop, flipped, clipped
   to the image, and dropped when narrower or lower than one network pixel;
4. the pixels (:func:`augment_pixels`, Darknet's ``image_data_augmentation``): crop (the
   outside filled with the image's mean colour), bilinear resize to the network size, flip,
   HSV distortion, blur, gaussian noise; all on 8-bit images with OpenCV, as Darknet does.

Arithmetic that decides a pixel or a box is done in float32 with C's truncations, so the
offsets are those Darknet computes for the same draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from darknet_metal.errors import ArgumentError

from .draws import rand_bool, rand_float, rand_int, rand_precalc_random, rand_scale, rand_uniform
from .settings import LoaderSettings

__all__ = [
    "ImageDraws",
    "Placement",
    "augment_pixels",
    "check_boxes",
    "distort_hsv",
    "draw_image",
    "place",
    "transform_truths",
]

_F32 = np.float32
# Gaussian blur kernel of blur mode 1 (blur the background, keep the objects sharp).
_BACKGROUND_BLUR_KERNEL = 17


@dataclass(frozen=True)
class ImageDraws:
    """The random draws of one image (Darknet draws them in this order).

    ``r1``..``r4``: crop fractions of left, right, top, bottom in [0, 1); ``resize_r1``,
    ``resize_r2``: zoom fractions; ``flip``: mirror left-right; ``dhue`` (fraction of the hue
    circle), ``dsat``, ``dexp``: HSV changes; ``blur``: 0 none, 1 blur the background, >1 the
    whole image with a kernel of about that many pixels; ``gaussian_noise``: noise standard
    deviation in 8-bit levels (0: none); ``corner``: a mosaic piece pushed to its corner.
    """

    r1: float = 0.5
    r2: float = 0.5
    r3: float = 0.5
    r4: float = 0.5
    resize_r1: float = 0.5
    resize_r2: float = 0.5
    flip: bool = False
    dhue: float = 0.0
    dsat: float = 1.0
    dexp: float = 1.0
    blur: int = 0
    gaussian_noise: int = 0
    corner: bool = False


def draw_image(rng: np.random.Generator, settings: LoaderSettings, *, mosaic: bool) -> ImageDraws:
    """Draw one image's augmentation with Darknet's distributions (``load_data_detection``)."""
    resize_r1 = rand_float(rng)
    resize_r2 = rand_float(rng)
    r1, r2, r3, r4 = (rand_float(rng) for _ in range(4))
    flip = rand_bool(rng) if settings.flip else False
    dhue = rand_uniform(rng, -settings.hue, settings.hue)
    dsat = rand_scale(rng, settings.saturation)
    dexp = rand_scale(rng, settings.exposure)
    blur = 0
    if settings.blur:
        mode = rand_int(rng, 0, 2)
        blur = 0 if mode == 0 else 1 if mode == 1 else settings.blur
    noise = settings.gaussian_noise if settings.gaussian_noise and rand_bool(rng) else 0
    corner = rand_bool(rng) if mosaic else False
    return ImageDraws(
        r1=float(r1), r2=float(r2), r3=float(r3), r4=float(r4),
        resize_r1=float(resize_r1), resize_r2=float(resize_r2), flip=flip,
        dhue=float(dhue), dsat=float(dsat), dexp=float(dexp), blur=blur,
        gaussian_noise=noise, corner=corner,
    )


@dataclass(frozen=True)
class Placement:
    """Where the crop lies in the source image, in source pixels.

    ``pleft``, ``pright``, ``ptop``, ``pbot``: how far each side of the crop lies inside the
    image (negative: outside, padded); the crop is ``swidth`` x ``sheight`` from column
    ``pleft``, row ``ptop`` of the ``ow`` x ``oh`` source. ``sx``, ``sy``, ``dx``, ``dy``:
    Darknet's float32 scale and offset of ``correct_boxes`` (new = old * (1/s) - d).
    """

    ow: int
    oh: int
    pleft: int
    pright: int
    ptop: int
    pbot: int

    @property
    def swidth(self) -> int:
        return self.ow - self.pleft - self.pright

    @property
    def sheight(self) -> int:
        return self.oh - self.ptop - self.pbot

    @property
    def sx(self) -> np.float32:
        return _F32(self.swidth) / _F32(self.ow)

    @property
    def sy(self) -> np.float32:
        return _F32(self.sheight) / _F32(self.oh)

    @property
    def dx(self) -> np.float32:
        return (_F32(self.pleft) / _F32(self.ow)) / self.sx

    @property
    def dy(self) -> np.float32:
        return (_F32(self.ptop) / _F32(self.oh)) / self.sy


def _trunc(value: np.float32) -> int:
    """C's float-to-int conversion: toward zero."""
    return int(np.trunc(value))


def place(
    ow: int,
    oh: int,
    settings: LoaderSettings,
    draws: ImageDraws,
    *,
    net_w: int,
    net_h: int,
    piece: int | None = None,
) -> Placement:
    """The crop of an ``ow`` x ``oh`` image for these draws (``load_data_detection``).

    ``piece``: the mosaic quadrant (0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right)
    when the image is one of a mosaic's four, else None.
    """
    jitter = _F32(settings.jitter)
    dw = _trunc(_F32(ow) * jitter)
    dh = _trunc(_F32(oh) * jitter)
    resize = _F32(settings.resize)
    resize_down = _F32(1) / resize if resize > 1 else resize
    resize_up = _F32(1) / resize if resize < 1 else resize
    min_rdw = _trunc(_F32(ow) * (_F32(1) - _F32(1) / resize_down) / _F32(2))
    min_rdh = _trunc(_F32(oh) * (_F32(1) - _F32(1) / resize_down) / _F32(2))
    max_rdw = _trunc(_F32(ow) * (_F32(1) - _F32(1) / resize_up) / _F32(2))
    max_rdh = _trunc(_F32(oh) * (_F32(1) - _F32(1) / resize_up) / _F32(2))

    pleft = _trunc(rand_precalc_random(-dw, dw, _F32(draws.r1)))
    pright = _trunc(rand_precalc_random(-dw, dw, _F32(draws.r2)))
    ptop = _trunc(rand_precalc_random(-dh, dh, _F32(draws.r3)))
    pbot = _trunc(rand_precalc_random(-dh, dh, _F32(draws.r4)))

    top_w = 0 if resize < 1 else max_rdw
    top_h = 0 if resize < 1 else max_rdh
    r1, r2 = _F32(draws.resize_r1), _F32(draws.resize_r2)
    pleft = _trunc(_F32(pleft) + rand_precalc_random(min_rdw, top_w, r1))
    pright = _trunc(_F32(pright) + rand_precalc_random(min_rdw, top_w, r2))
    ptop = _trunc(_F32(ptop) + rand_precalc_random(min_rdh, top_h, r1))
    pbot = _trunc(_F32(pbot) + rand_precalc_random(min_rdh, top_h, r2))

    if settings.letter_box:
        img_ar = _F32(ow) / _F32(oh)
        net_ar = _F32(net_w) / _F32(net_h)
        if img_ar / net_ar > 1:
            delta_h = (_F32(ow) / net_ar - _F32(oh)) / _F32(2)
            ptop = _trunc(_F32(ptop) - delta_h)
            pbot = _trunc(_F32(pbot) - delta_h)
        else:
            delta_w = (_F32(oh) * net_ar - _F32(ow)) / _F32(2)
            pleft = _trunc(_F32(pleft) - delta_w)
            pright = _trunc(_F32(pright) - delta_w)

    if piece is not None and draws.corner:
        # Darknet moves one side's whole offset onto the opposite side (which side depends
        # on the quadrant and the flip), so that more of the image reaches the mosaic.
        into_right = piece in (0, 2)
        if draws.flip:
            into_right = not into_right
        if into_right:
            pright, pleft = pright + pleft, 0
        else:
            pleft, pright = pleft + pright, 0
        if piece in (0, 1):
            pbot, ptop = pbot + ptop, 0
        else:
            ptop, pbot = ptop + pbot, 0

    # With jitter < 0.5 the crop keeps at least one pixel; a resize zoom can still push it
    # past the image's far side, which Darknet's OpenCV crop would reject: keep a pixel.
    if ow - pleft - pright < 1:
        pright = ow - pleft - 1
    if oh - ptop - pbot < 1:
        pbot = oh - ptop - 1
    return Placement(ow, oh, pleft, pright, ptop, pbot)


def check_boxes(boxes: object, where: str, classes: int | None = None) -> np.ndarray:
    """Validated (k, 5) float32 truths (class, cx, cy, w, h) normalised to the image.

    Raises ``ArgumentError`` naming ``where`` (the image) and the 1-based row for a wrong
    shape, a non-finite value, a class id that is not a whole number in [0, classes), or a
    box with no width or height inside the image (Darknet's ``read_boxes`` stops there).
    """
    array = np.asarray(boxes, dtype=np.float32) if not isinstance(boxes, np.ndarray) else boxes
    if array.size == 0:
        return np.zeros((0, 5), np.float32)
    if array.ndim != 2 or array.shape[1] != 5:
        raise ArgumentError(
            f"{where}: boxes must be a (k, 5) array of class, cx, cy, w, h; got shape "
            f"{array.shape}"
        )
    array = array.astype(np.float32, copy=False)
    for row, values in enumerate(array, start=1):
        text = " ".join(f"{v:g}" for v in values)
        if not np.all(np.isfinite(values)):
            raise ArgumentError(f"{where}: box {row} ({text}) is not finite")
        cls = values[0]
        if cls < 0 or cls != np.floor(cls) or (classes is not None and cls >= classes):
            limit = f" below {classes}" if classes is not None else ""
            raise ArgumentError(
                f"{where}: box {row} ({text}): class {cls:g} is not a whole number from 0{limit}"
            )
        x, y, w, h = np.clip(values[1:], 0, 1)
        if w <= 0 or h <= 0:
            raise ArgumentError(f"{where}: box {row} ({text}) has no width or height")
    return array


def transform_truths(
    boxes: np.ndarray,
    placement: Placement,
    *,
    flip: bool,
    net_w: int,
    net_h: int,
    max_boxes: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, int]:
    """The truths of one augmented image (``fill_truth_detection`` + ``correct_boxes``).

    ``boxes``: validated (k, 5) rows (class, cx, cy, w, h) normalised to the source image.
    Rows are shuffled (so that the ``max_boxes`` kept are a random subset when there are
    more), cut to ``max_boxes``, clamped to the image as Darknet reads them, moved into the
    crop, mirrored if ``flip``, clipped to [0, 1], and dropped when narrower than
    1/``net_w`` or lower than 1/``net_h``.

    Returns float32 (n, 5) rows (class, cx, cy, w, h) normalised to the network input, and
    Darknet's ``min_w_h``: the smallest kept side in network pixels, truncated (0 if none).
    """
    if len(boxes) == 0:
        return np.zeros((0, 5), np.float32), 0
    boxes = boxes[rng.permutation(len(boxes))][:max_boxes]
    one, zero, half = _F32(1), _F32(0), _F32(2)
    x = np.clip(boxes[:, 1], zero, one)
    y = np.clip(boxes[:, 2], zero, one)
    w = np.clip(boxes[:, 3], zero, one)
    h = np.clip(boxes[:, 4], zero, one)
    left = np.clip(boxes[:, 1] - boxes[:, 3] / half, zero, one)
    right = np.clip(boxes[:, 1] + boxes[:, 3] / half, zero, one)
    top = np.clip(boxes[:, 2] - boxes[:, 4] / half, zero, one)
    bottom = np.clip(boxes[:, 2] + boxes[:, 4] / half, zero, one)
    del x, y, w, h  # Darknet moves the edges; the centre and size are recomputed from them

    # correct_boxes receives 1/sx computed in double and passed as float.
    sx = _F32(1.0 / float(placement.sx))
    sy = _F32(1.0 / float(placement.sy))
    dx, dy = placement.dx, placement.dy
    left = left * sx - dx
    right = right * sx - dx
    top = top * sy - dy
    bottom = bottom * sy - dy
    if flip:
        left, right = one - right, one - left
    left = np.clip(left, zero, one)
    right = np.clip(right, zero, one)
    top = np.clip(top, zero, one)
    bottom = np.clip(bottom, zero, one)
    cx = (left + right) / half
    cy = (top + bottom) / half
    bw = np.clip(right - left, zero, one)
    bh = np.clip(bottom - top, zero, one)

    lowest_w = one / _F32(net_w)
    lowest_h = one / _F32(net_h)
    keep = ~((bw < lowest_w) | (bh < lowest_h))
    out = np.stack([boxes[:, 0], cx, cy, bw, bh], axis=1)[keep].astype(np.float32)

    min_w_h = 0
    for _, _, _, kw, kh in out:
        side_w = kw * _F32(net_w)
        side_h = kh * _F32(net_h)
        if min_w_h == 0:
            min_w_h = _trunc(side_w)
        if min_w_h > side_w:
            min_w_h = _trunc(side_w)
        if min_w_h > side_h:
            min_w_h = _trunc(side_h)
    return out, min_w_h


def capped_blur(blur: int, min_w_h: int) -> int:
    """Darknet's cap on the whole-image blur: at most the smallest object side / 8."""
    if blur > 1 and min_w_h // 8 < blur:
        return min_w_h // 8
    return blur


def _lut(values: np.ndarray) -> np.ndarray:
    return np.clip(values, 0, 255).astype(np.uint8)


def distort_hsv(rgb: np.ndarray, dhue: float, dsat: float, dexp: float) -> np.ndarray:
    """Darknet's HSV distortion of an 8-bit RGB image (``image_data_augmentation``).

    OpenCV's 8-bit RGB->HSV (H in [0, 180), S and V in [0, 255]); S and V multiplied by
    ``dsat`` and ``dexp`` (float32 product, rounded half to even, saturated: OpenCV's
    ``Mat *= double``); ``179 * dhue`` rounded and added to H with saturation at 0 and 255
    (so a negative shift stops at red, a positive one past 180 wraps in the conversion
    back); HSV->RGB. A 1-channel image only gets the exposure factor. Returns a new array.
    """
    import cv2

    if rgb.shape[2] != 3:
        table = _lut(np.rint(np.arange(256, dtype=np.float32) * _F32(dexp)))
        return cv2.LUT(rgb, table).reshape(rgb.shape)
    hsv = cv2.cvtColor(rgb, cv2.COLOR_RGB2HSV)
    levels = np.arange(256, dtype=np.float32)
    shift = np.rint(np.float64(_F32(179) * _F32(dhue)))
    tables = np.stack([
        _lut(np.arange(256, dtype=np.float64) + shift),
        _lut(np.rint(levels * _F32(dsat))),
        _lut(np.rint(levels * _F32(dexp))),
    ], axis=-1)
    # One table per channel, applied by OpenCV (without the GIL).
    hsv = cv2.LUT(hsv, tables.reshape(256, 1, 3))
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)


def crop_and_resize(rgb: np.ndarray, placement: Placement, net_w: int, net_h: int) -> np.ndarray:
    """The crop of ``placement`` resized bilinearly to ``net_w`` x ``net_h`` (8-bit, OpenCV);
    the part outside the source is the source's mean colour, rounded."""
    import cv2

    oh, ow = rgb.shape[:2]
    p = placement
    if p.pleft == 0 and p.ptop == 0 and p.swidth == ow and p.sheight == oh:
        src = rgb
    else:
        # The crop's part inside the image, bordered with the image's mean colour where the
        # crop reaches past it.
        mean = np.rint(np.asarray(cv2.mean(rgb)[: rgb.shape[2]]))
        x0, y0 = max(p.pleft, 0), max(p.ptop, 0)
        x1, y1 = min(p.pleft + p.swidth, ow), min(p.ptop + p.sheight, oh)
        if x1 > x0 and y1 > y0:
            left, top = max(0, -p.pleft), max(0, -p.ptop)
            right, bottom = p.swidth - left - (x1 - x0), p.sheight - top - (y1 - y0)
            src = cv2.copyMakeBorder(
                rgb[y0:y1, x0:x1], top, bottom, left, right, cv2.BORDER_CONSTANT,
                value=[float(v) for v in mean] + [0.0] * (4 - len(mean)),
            ).reshape(p.sheight, p.swidth, rgb.shape[2])
        else:
            src = np.empty((p.sheight, p.swidth, rgb.shape[2]), np.uint8)
            src[:] = mean.astype(np.uint8)
    sized = cv2.resize(src, (net_w, net_h), interpolation=cv2.INTER_LINEAR)
    return sized.reshape(net_h, net_w, rgb.shape[2])


def augment_pixels(
    rgb: np.ndarray,
    placement: Placement,
    draws: ImageDraws,
    truths: np.ndarray,
    blur: int,
    *,
    net_w: int,
    net_h: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """The augmented 8-bit image, (net_h, net_w, C) uint8 (``image_data_augmentation``).

    ``truths``: the image's transformed truths (normalised to the output), whose boxes
    blur mode 1 leaves sharp; ``blur``: the mode after :func:`capped_blur`.
    """
    import cv2

    channels = rgb.shape[2]
    sized = crop_and_resize(rgb, placement, net_w, net_h)
    if draws.flip:
        sized = sized[:, ::-1]
    if draws.dsat != 1 or draws.dexp != 1 or draws.dhue != 0:
        sized = distort_hsv(np.ascontiguousarray(sized), draws.dhue, draws.dsat, draws.dexp)
    if blur:
        sized = np.ascontiguousarray(sized)
        if blur == 1:
            kernel = _BACKGROUND_BLUR_KERNEL
        else:
            kernel = (blur // 2) * 2 + 1
        blurred = cv2.GaussianBlur(sized, (kernel, kernel), 0).reshape(sized.shape)
        if blur == 1:
            for _, cx, cy, bw, bh in truths:
                left = int((float(cx) - float(bw) / 2.0) * net_w)
                top = int((float(cy) - float(bh) / 2.0) * net_h)
                right = min(left + int(float(bw) * net_w), net_w)
                bottom = min(top + int(float(bh) * net_h), net_h)
                left, top = max(left, 0), max(top, 0)
                if right > left and bottom > top:
                    blurred[top:bottom, left:right] = sized[top:bottom, left:right]
        sized = blurred
    if draws.gaussian_noise:
        sigma = _F32(min(max(draws.gaussian_noise, 0), 127))
        noise = np.rint(rng.standard_normal(sized.shape, dtype=np.float32) * sigma)
        sized = np.clip(sized.astype(np.float32) + noise, 0, 255).astype(np.uint8)
    return np.ascontiguousarray(sized).reshape(net_h, net_w, channels)
