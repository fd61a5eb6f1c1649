"""Image loading, Darknet's resize/letterbox, drawing and atomic image writes.

References: the network input Darknet V5 itself computed (../shared/golden), OpenCV's
``imread`` (the decoder Darknet V5 calls), an exact rational-arithmetic replay of the
two-pass resize written here, and hand-computed values.
"""

from __future__ import annotations

import math
import os
import pathlib
from fractions import Fraction

import cv2
import numpy as np
import pytest
from PIL import Image
from shared_paths import SHARED

from darknet_metal.errors import ImageError
from darknet_metal.inference.boxes import Detection
from darknet_metal.inference.draw import class_color, draw_detections, save_image_atomic
from darknet_metal.inference.image import letterbox_image, load_image, prepare_input, resize_image

IMAGES = SHARED / "images"
GOLDEN = SHARED / "golden" / "darknet-v5-cpu-yolov3-tiny"


def golden_input(stem: str) -> np.ndarray:
    return np.fromfile(GOLDEN / f"{stem}_input.bin", dtype="<f4").reshape(3, 416, 416)


def imread_bytes(path: os.PathLike[str] | str) -> np.ndarray:
    """The bytes Darknet V5's load_image starts from: cv::imread (BGR) as planar RGB."""
    bgr = cv2.imread(os.fspath(path))
    assert bgr is not None
    return bgr[:, :, ::-1].transpose(2, 0, 1)


# ---------------------------------------------------------------------------------------
# Against Darknet's own network input


def test_png_input_matches_darknet():
    # PNG decoding is lossless and deterministic, so any difference is ours: <= 1e-6.
    ours = resize_image(load_image(IMAGES / "coffee.png"), 416, 416)
    diff = np.abs(ours - golden_input("coffee"))
    assert diff.max() <= 1e-6, f"max {diff.max():.3g}"


def test_png_input_is_bit_identical_to_darknet():
    # Darknet's reference build fuses the interpolation into FMAs; without reproducing
    # that, about a third of the pixels differ by one ulp. This guards the emulation.
    ours = resize_image(load_image(IMAGES / "coffee.png"), 416, 416)
    np.testing.assert_array_equal(ours, golden_input("coffee"))


def test_jpeg_input_matches_darknet():
    # Darknet decodes JPEG with OpenCV's libjpeg, we with Pillow's. Both are libjpeg-turbo
    # with the same default IDCT and upsampling, and on dog.jpg we measured max and mean
    # difference 0.0 after resizing. Another libjpeg build could round a few IDCT outputs
    # differently (by 1/255 at most per pixel, smoothed by the resize), so the bound left
    # here is for decoder drift, not for our arithmetic: mean < 1e-3, max <= 8/255.
    ours = resize_image(load_image(IMAGES / "dog.jpg"), 416, 416)
    diff = np.abs(ours - golden_input("dog"))
    assert diff.mean() < 1e-3, f"mean {diff.mean():.3g}"
    assert diff.max() <= 8 / 255, f"max {diff.max():.3g}"


def test_prepare_input_without_letterbox_is_the_plain_resize():
    img = load_image(IMAGES / "coffee.png")
    np.testing.assert_array_equal(prepare_input(img, 416, 416, False), golden_input("coffee"))


# ---------------------------------------------------------------------------------------
# load_image against OpenCV's imread, which is what Darknet V5 calls


def _write_cases(tmp: pathlib.Path) -> list[pathlib.Path]:
    rng = np.random.default_rng(7)
    paths = []

    def add(name: str) -> pathlib.Path:
        paths.append(tmp / name)
        return tmp / name

    rgba = rng.integers(0, 256, (5, 7, 4), dtype=np.uint8)
    rgba[..., 3] = 0  # fully transparent: imread keeps the colours, it does not composite
    Image.fromarray(rgba).save(add("rgba.png"))
    Image.fromarray(rng.integers(0, 256, (5, 7), dtype=np.uint8)).save(add("gray.png"))
    la = rng.integers(0, 256, (5, 7, 2), dtype=np.uint8)
    Image.fromarray(la, "LA").save(add("gray_alpha.png"))
    pal = Image.fromarray(rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)).convert("P")
    pal.save(add("palette_transparent.png"), transparency=0)
    cv2.imwrite(str(add("gray16.png")), rng.integers(0, 65536, (5, 7), dtype=np.uint16))
    cv2.imwrite(str(add("rgb16.png")), rng.integers(0, 65536, (5, 7, 3), dtype=np.uint16))
    bits = rng.integers(0, 2, (5, 7), dtype=np.uint8) * 255
    Image.fromarray(bits).convert("1").save(add("bilevel.png"))
    rotated = Image.fromarray(rng.integers(0, 256, (6, 10, 3), dtype=np.uint8))
    exif = rotated.getexif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    rotated.save(add("exif_rotated.jpg"), exif=exif, quality=95)
    return paths


def test_file_conversions_match_opencv_imread(tmp_path):
    for path in _write_cases(tmp_path):
        ref = imread_bytes(path)
        ours = load_image(path)
        assert ours.dtype == np.float32 and ours.flags.c_contiguous
        assert ours.shape == ref.shape, path.name
        # Same bytes, and each float within two float32 roundings (< 1.2e-7) of byte/255.
        np.testing.assert_array_equal(np.rint(ours * 255.0), ref, err_msg=path.name)
        assert np.abs(ours - ref / 255.0).max() < 1.2e-7, path.name


def test_exif_orientation_is_applied(tmp_path):
    paths = {p.name: p for p in _write_cases(tmp_path)}
    assert load_image(paths["exif_rotated.jpg"]).shape == (3, 10, 6)


def test_load_image_from_arrays():
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (4, 6, 3), dtype=np.uint8)
    out = load_image(rgb)
    assert out.shape == (3, 4, 6) and out.dtype == np.float32
    np.testing.assert_allclose(out, rgb.transpose(2, 0, 1) / 255.0, rtol=0, atol=1.2e-7)
    assert load_image(np.zeros((1, 1, 3), np.uint8)).max() == 0.0
    assert load_image(np.full((1, 1, 3), 255, np.uint8)).min() == 1.0

    gray = rng.integers(0, 256, (4, 6), dtype=np.uint8)
    g = load_image(gray)
    assert g.shape == (3, 4, 6)
    np.testing.assert_array_equal(g[0], g[1])
    np.testing.assert_array_equal(g[0], g[2])
    np.testing.assert_array_equal(load_image(gray[:, :, None]), g)

    rgba = np.concatenate([rgb, rng.integers(0, 256, (4, 6, 1), dtype=np.uint8)], axis=2)
    np.testing.assert_array_equal(load_image(rgba), out)


@pytest.mark.parametrize(
    "array, words",
    [
        (np.zeros((4, 6, 3), np.float32), ["float32", "uint8"]),
        (np.zeros((4, 6, 2), np.uint8), ["(4, 6, 2)"]),
        (np.zeros((2, 4, 6, 3), np.uint8), ["(2, 4, 6, 3)"]),
        (np.zeros((0, 6, 3), np.uint8), ["(0, 6, 3)", "empty"]),
    ],
)
def test_bad_arrays_raise_image_error(array, words):
    with pytest.raises(ImageError) as err:
        load_image(array)
    for word in words:
        assert word in str(err.value)


def test_bad_files_raise_image_error_naming_the_path(tmp_path):
    missing = tmp_path / "nope.jpg"
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(b"this is not an image at all" * 10)
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.jpg"
    data = (IMAGES / "dog.jpg").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    for path in (missing, garbage, empty, truncated, tmp_path):
        with pytest.raises(ImageError) as err:
            load_image(path)
        assert str(path) in str(err.value)
    with pytest.raises(ImageError):
        load_image(12345)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# resize_image against an exact replay of Darknet's two-pass formula


def _nearest_f32(q: Fraction) -> np.float32:
    """The float32 nearest the rational q, ties to even (one correct rounding)."""
    guess = np.float32(float(q))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess]
    candidates.append(np.nextafter(guess, np.float32(np.inf)))
    best = min(
        candidates,
        key=lambda c: (abs(Fraction(float(c)) - q), int(np.array(c).view(np.uint32)) & 1),
    )
    return np.float32(best)


def _mul(a, b):
    return _nearest_f32(Fraction(float(a)) * Fraction(float(b)))


def _fma(a, b, c):
    return _nearest_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def _sub(a, b):
    return _nearest_f32(Fraction(float(a)) - Fraction(float(b)))


def reference_resize(im: np.ndarray, w: int, h: int) -> np.ndarray:
    """Darknet's resize_image, one pixel at a time, every float32 operation rounded once.

    Fused multiply-adds as in Darknet's reference build: fma(1-dx, p0, dx*p1) and
    fma(dy, q1, (1-dy)*q0). A target size of 1 samples source position 0 (Darknet's C code
    divides by zero there).
    """
    c_, hh, ww = im.shape
    if (ww, hh) == (w, h):
        return im.copy()
    one = np.float32(1)
    ws = _nearest_f32(Fraction(ww - 1, w - 1)) if w > 1 else np.float32(0)
    hs = _nearest_f32(Fraction(hh - 1, h - 1)) if h > 1 else np.float32(0)
    part = np.zeros((c_, hh, w), np.float32)
    for k in range(c_):
        for r in range(hh):
            for c in range(w):
                if c == w - 1 or ww == 1:
                    part[k, r, c] = im[k, r, ww - 1]
                    continue
                sx = _mul(np.float32(c), ws)
                ix = int(sx)
                dx = _sub(sx, np.float32(ix))
                p1 = _mul(dx, im[k, r, ix + 1])
                part[k, r, c] = _fma(_sub(one, dx), im[k, r, ix], p1)
    out = np.zeros((c_, h, w), np.float32)
    for k in range(c_):
        for r in range(h):
            sy = _mul(np.float32(r), hs)
            iy = int(sy)
            dy = _sub(sy, np.float32(iy))
            for c in range(w):
                val = _mul(_sub(one, dy), part[k, iy, c])
                if r != h - 1 and hh != 1:
                    val = _fma(dy, part[k, iy + 1, c], val)
                out[k, r, c] = val
    return out


RESIZE_CASES = [
    ((5, 8), (7, 4)),  # (src h, src w) -> (dst w, dst h): mixed up/down
    ((6, 9), (4, 3)),  # down both ways
    ((3, 4), (11, 9)),  # up both ways
    ((5, 7), (7, 5)),  # same size: a copy
    ((1, 6), (4, 5)),  # one source row
    ((6, 1), (5, 4)),  # one source column
    ((1, 1), (3, 2)),  # one source pixel
    ((5, 6), (1, 4)),  # one target column: Darknet copies the last source column
    ((5, 6), (4, 1)),  # one target row
    ((2, 3), (3, 42)),  # float rounding darkens the last row (see the next test)
]


@pytest.mark.parametrize("src, dst", RESIZE_CASES)
def test_resize_matches_exact_replay(src, dst):
    rng = np.random.default_rng(sum(src) * 31 + sum(dst))
    im = rng.random((3, *src), dtype=np.float32)
    ours = resize_image(im, *dst)
    assert ours.shape == (3, dst[1], dst[0]) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours, reference_resize(im, *dst))


def test_resize_last_row_quirk_by_hand():
    # 2 rows -> 42 rows: the scale is float32(1/41) and float32(41) * that = 0.99999994,
    # so the last row reads row 0 with weight 1 - 0.99999994 = 5.96e-8 and nothing else.
    ones = np.ones((3, 2, 3), np.float32)
    out = resize_image(ones, 3, 42)
    np.testing.assert_allclose(out[:, :41], 1.0, atol=1e-6)
    assert out[:, 41].max() < 1e-7
    assert out[:, 41].max() == pytest.approx(2.0**-24, rel=1e-6)


def test_resize_rejects_bad_input():
    with pytest.raises(ImageError):
        resize_image(np.zeros((4, 4), np.float32), 2, 2)
    with pytest.raises(ImageError):
        resize_image(np.zeros((3, 0, 4), np.float32), 2, 2)
    with pytest.raises(ValueError):
        resize_image(np.zeros((3, 4, 4), np.float32), 0, 2)


# ---------------------------------------------------------------------------------------
# letterbox_image, hand-computed placements


def test_letterbox_wide_image():
    # 4 wide x 2 high into 8x8: 8/4 = 2 < 8/2 = 4, so new_w = 8, new_h = 2*8//4 = 4,
    # placed at column (8-8)//2 = 0, row (8-4)//2 = 2; the rest is 0.5.
    rng = np.random.default_rng(1)
    img = rng.random((3, 2, 4), dtype=np.float32)
    out = letterbox_image(img, 8, 8)
    assert out.shape == (3, 8, 8)
    np.testing.assert_array_equal(out[:, 2:6, :], resize_image(img, 8, 4))
    assert np.all(out[:, :2, :] == 0.5) and np.all(out[:, 6:, :] == 0.5)


def test_letterbox_tall_image_with_odd_margins():
    # 3 wide x 5 high into 11x10: 11/3 = 3.67 >= 10/5 = 2, so new_h = 10,
    # new_w = 3*10//5 = 6, placed at column (11-6)//2 = 2 (not 2.5), row 0.
    rng = np.random.default_rng(2)
    img = rng.random((3, 5, 3), dtype=np.float32)
    out = letterbox_image(img, 11, 10)
    assert out.shape == (3, 10, 11)
    np.testing.assert_array_equal(out[:, :, 2:8], resize_image(img, 6, 10))
    assert np.all(out[:, :, :2] == 0.5) and np.all(out[:, :, 8:] == 0.5)
    np.testing.assert_array_equal(prepare_input(img, 11, 10, True), out)


# ---------------------------------------------------------------------------------------
# Drawing


def _det(class_id=0, left=10.0, top=30.0, width=50.0, height=40.0, conf=0.9):
    return Detection(class_id, f"c{class_id}", conf, 0.95, left, top, width, height)


def test_class_colors_by_hand():
    # class 0: ramp position 0 -> magenta. class 1: 123457 % 80 = 17, ratio 17/80*5 =
    # 1.0625 between blue (0,0,1) and cyan (0,1,1): red = ramp channel 2 = 1, green =
    # channel 1 = 0.0625 -> 16, blue = channel 0 = 0.
    assert class_color(0) == (255, 0, 255)
    assert class_color(1) == (255, 16, 0)


def test_box_edges_land_on_the_right_pixels():
    blank = np.zeros((80, 100, 3), np.uint8)
    out = np.asarray(draw_detections(blank, [_det()]))
    color = (255, 0, 255)
    # left = 10, right = int(10 + 50) = 60, top = 30, bottom = int(30 + 40) = 70; the
    # line is max(1, int(80 * 0.002)) = 1 pixel wide.
    for x, y in [(10, 50), (60, 50), (35, 30), (35, 70), (10, 30), (60, 70)]:
        assert tuple(out[y, x]) == color, (x, y)
    for x, y in [(11, 50), (59, 50), (35, 69), (35, 50), (80, 50), (9, 50), (35, 71)]:
        assert tuple(out[y, x]) == (0, 0, 0), (x, y)
    # The label sits on a box of the class colour just above the top edge.
    assert tuple(out[29, 10]) == color
    assert blank.max() == 0  # the input is not modified


def test_thick_lines_and_clipping():
    blank = np.zeros((1000, 300, 3), np.uint8)  # line width int(1000 * 0.002) = 2
    det = _det(class_id=1, left=-20.7, top=500.0, width=120.0, height=100.0)
    out = np.asarray(draw_detections(blank, [det]))
    color = (255, 16, 0)
    # left = int(-20.7) = -20, clipped to 0; right = int(99.3) = 99.
    for x in (0, 1, 98, 99):
        assert tuple(out[550, x]) == color, x
    for x in (2, 97, 100):
        assert tuple(out[550, x]) == (0, 0, 0), x


def test_label_inside_when_no_room_above():
    blank = np.zeros((80, 100, 3), np.uint8)
    out = np.asarray(draw_detections(blank, [_det(top=0.0, height=60.0)]))
    assert tuple(out[0, 10]) == (255, 0, 255)
    assert tuple(out[3, 12]) != (0, 0, 0)  # label background inside the box


def test_draw_rejects_non_rgb_uint8():
    with pytest.raises(ImageError):
        draw_detections(np.zeros((10, 10), np.uint8), [])
    with pytest.raises(ImageError):
        draw_detections(np.zeros((10, 10, 3), np.float32), [])


# ---------------------------------------------------------------------------------------
# Atomic writes


def _solid(color, size=(16, 12)):
    return Image.new("RGB", size, color)


def test_save_writes_and_replaces_atomically(tmp_path):
    target = tmp_path / "out.png"
    save_image_atomic(_solid((10, 20, 30)), target)
    assert os.listdir(tmp_path) == ["out.png"]
    inode = target.stat().st_ino
    save_image_atomic(_solid((200, 100, 50)), target)
    assert os.listdir(tmp_path) == ["out.png"]
    assert target.stat().st_ino != inode  # a new file renamed over the old one
    with Image.open(target) as im:
        assert im.format == "PNG" and im.getpixel((3, 3)) == (200, 100, 50)


def test_save_format_comes_from_the_extension(tmp_path):
    save_image_atomic(_solid((0, 128, 255)), tmp_path / "a.JPG")
    with Image.open(tmp_path / "a.JPG") as im:
        assert im.format == "JPEG"
    save_image_atomic(Image.new("RGBA", (4, 4)), tmp_path / "b.jpg")  # alpha dropped
    assert sorted(os.listdir(tmp_path)) == ["a.JPG", "b.jpg"]


def test_save_bad_paths_raise_and_leave_nothing(tmp_path):
    with pytest.raises(ImageError) as err:
        save_image_atomic(_solid(0), tmp_path / "missing" / "out.png")
    assert "missing" in str(err.value)
    with pytest.raises(ImageError) as err:
        save_image_atomic(_solid(0), tmp_path / "out.notaformat")
    assert ".notaformat" in str(err.value)
    (tmp_path / "adir.png").mkdir()
    with pytest.raises(ImageError):
        save_image_atomic(_solid(0), tmp_path / "adir.png")
    assert os.listdir(tmp_path) == ["adir.png"]


def test_failed_encode_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "out.png"
    save_image_atomic(_solid((1, 2, 3)), target)
    before = target.read_bytes()
    img = _solid((9, 9, 9))

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(img, "save", broken_save)
    with pytest.raises(ImageError) as err:
        save_image_atomic(img, target)
    assert "disk full" in str(err.value) and str(target) in str(err.value)
    assert os.listdir(tmp_path) == ["out.png"]
    assert target.read_bytes() == before


def test_drawn_image_round_trips(tmp_path):
    blank = np.zeros((80, 100, 3), np.uint8)
    target = tmp_path / "pred.png"
    save_image_atomic(draw_detections(blank, [_det()]), target)
    back = np.asarray(Image.open(target))
    assert tuple(back[50, 10]) == (255, 0, 255)
    assert math.isclose(back[50, 35].sum(), 0)
