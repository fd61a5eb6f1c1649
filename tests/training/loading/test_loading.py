"""The loader: HSV distortion, reproducibility across workers, random=1 sizes, lifecycle,
settings from a cfg."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from loading_scenes import scene_samples, write_png

from darknet_metal.errors import ArgumentError, CfgError, ImageError
from darknet_metal.model.cfg import parse_cfg_text
from darknet_metal.training.loading import Loader, LoaderSettings, load_batch, random_size
from darknet_metal.training.loading.augment import distort_hsv
from darknet_metal.training.loading.batch import SampleSource
from darknet_metal.training.loading.loader import THREAD_NAME_PREFIX

# --- HSV ---------------------------------------------------------------------------------


def _oracle_hsv(rgb: np.ndarray, dhue: float, dsat: float, dexp: float) -> np.ndarray:
    """Darknet's image_data_augmentation colour steps with the textbook HSV formulas that
    OpenCV documents for 8-bit images (H in degrees / 2, S and V scaled to 255), in float64:
    S and V times the factor (float32 product, rounded half to even, saturated), H plus
    round(179 * dhue) saturated to [0, 255], then back to RGB with H wrapping at 180."""
    c = rgb.reshape(-1, 3).astype(np.float64)
    r, g, b = c.T
    v = c.max(axis=1)
    span = v - c.min(axis=1)
    s = np.where(v > 0, 255 * span / np.where(v > 0, v, 1), 0)
    safe = np.where(span > 0, span, 1)
    h = np.where(v == r, 60 * (g - b) / safe,
                 np.where(v == g, 120 + 60 * (b - r) / safe, 240 + 60 * (r - g) / safe))
    h = np.where(span > 0, h, 0)
    h = np.where(h < 0, h + 360, h)
    # OpenCV's fixed-point tables round the conversion's halves up.
    h8, s8, v8 = np.floor(h / 2 + 0.5), np.floor(s + 0.5), v
    f32 = np.float32
    s8 = np.clip(np.rint((s8.astype(f32) * f32(dsat)).astype(np.float64)), 0, 255)
    v8 = np.clip(np.rint((v8.astype(f32) * f32(dexp)).astype(np.float64)), 0, 255)
    h8 = np.clip(h8 + np.rint(float(f32(179) * f32(dhue))), 0, 255)
    hd = (h8 * 2) % 360 / 60
    sv, vv = s8 / 255, v8 / 255
    chroma = vv * sv
    x = chroma * (1 - np.abs(hd % 2 - 1))
    m = vv - chroma
    sector = np.floor(hd).astype(int) % 6
    zero = np.zeros_like(x)
    table = [(chroma, x, zero), (x, chroma, zero), (zero, chroma, x), (zero, x, chroma),
             (x, zero, chroma), (chroma, zero, x)]
    out = np.empty_like(c)
    for k, (rr, gg, bb) in enumerate(table):
        sel = sector == k
        out[sel] = np.stack([rr[sel], gg[sel], bb[sel]], axis=1) + m[sel, None]
    return np.rint(out * 255).reshape(rgb.shape)


@pytest.mark.parametrize(("dhue", "dsat", "dexp"), [
    (0.1, 1.5, 0.7), (-0.1, 0.6, 1.4), (0.05, 1.0, 1.0), (-0.03, 2.0, 2.0), (0.0, 1.0, 0.5),
])
def test_hsv_distortion_follows_darknets_steps(dhue, dsat, dexp):
    levels = [0, 40, 128, 200, 255]
    rgb = np.array([[(r, g, b) for r in levels for g in levels for b in levels]], np.uint8)
    got = distort_hsv(rgb, dhue, dsat, dexp)
    expected = _oracle_hsv(rgb, dhue, dsat, dexp)
    # OpenCV's 8-bit conversions go through integer tables: a level or two apart.
    assert np.abs(got.astype(int) - expected).max() <= 2


def test_negative_hue_shift_stops_at_red():
    """A shift below 0 saturates (OpenCV's 8-bit add), so red stays red instead of
    wrapping to magenta; a positive shift past 180 wraps."""
    red = np.array([[[255, 0, 0]]], np.uint8)
    assert distort_hsv(red, -0.2, 1.0, 1.0).tolist() == [[[255, 0, 0]]]
    magenta = np.array([[[255, 0, 255]]], np.uint8)  # H = 150
    shifted = distort_hsv(magenta, 0.2, 1.0, 1.0)  # 150 + 36 = 186 -> 6 (12 degrees)
    np.testing.assert_allclose(shifted[0, 0], [255, 51, 0], atol=2)


def test_gray_images_get_only_the_exposure():
    gray = np.array([[[0], [100], [200], [255]]], np.uint8)
    np.testing.assert_array_equal(distort_hsv(gray, 0.1, 1.5, 1.5)[..., 0],
                                  [[0, 150, 255, 255]])


# --- reproducibility ---------------------------------------------------------------------


def _samples(tmp_path, count=5):
    return scene_samples(tmp_path, count)


FULL = dict(width=96, height=64, batch=4, jitter=0.3, resize=1.2, hue=0.1, saturation=1.5,
            exposure=1.5, blur=3, gaussian_noise=8, mixup=3, max_boxes=6)


def _run(samples, workers, seed, sizes=((96, 64), (128, 96), (128, 96)), **kwargs):
    settings = LoaderSettings(**{**FULL, **kwargs})
    batches = []
    with Loader(samples, settings, seed=seed, workers=workers, prefetch=2) as loader:
        for width, height in sizes:
            loader.set_size(width, height)
            batch = loader.next()
            assert batch.x.shape == (4, 3, height, width)
            batches.append((batch.x.tobytes(), [t.tobytes() for t in batch.truths]))
    return batches


def test_same_seed_same_batches_for_any_number_of_workers(tmp_path):
    samples = _samples(tmp_path)
    reference = _run(samples, 0, seed=11)
    assert _run(samples, 1, seed=11) == reference
    assert _run(samples, 3, seed=11) == reference
    other = _run(samples, 3, seed=12)
    assert all(a[0] != b[0] for a, b in zip(reference, other, strict=True))


def test_loader_batches_are_load_batch(tmp_path):
    samples = _samples(tmp_path)
    settings = LoaderSettings(**FULL)
    with Loader(samples, settings, seed=5, workers=2, start_iteration=7) as loader:
        batch = loader.next()
    direct = load_batch(SampleSource(samples), settings, 5, 7)
    assert batch.iteration == 7 and direct.iteration == 7
    assert batch.x.tobytes() == direct.x.tobytes()
    assert batch.images == direct.images
    x, truths = batch
    assert x.dtype == np.float32 and 0 <= x.min() and x.max() <= 1
    assert all(t.dtype == np.float32 and t.shape[1] == 5 and len(t) <= 6 for t in truths)


def test_batches_written_into_given_arrays_are_the_same_and_the_arrays_reused(tmp_path):
    # A trainer gives the loader arrays its device reads in place: the loader makes
    # prefetch + 2 per size and then cycles through them, the batches unchanged.
    samples = _samples(tmp_path)
    settings = LoaderSettings(**FULL)
    made = []

    def allocate(shape):
        made.append(np.full(shape, np.nan, np.float32))  # every pixel must be written
        return made[-1]

    with Loader(samples, settings, seed=5, workers=2, prefetch=2) as plain, \
            Loader(samples, settings, seed=5, workers=2, prefetch=2,
                   allocate=allocate) as given:
        for _ in range(7):
            a, b = plain.next(), given.next()
            assert b.x.tobytes() == a.x.tobytes()
            assert any(b.x is m for m in made)
        assert len(made) == 4
        # The two batches being made when the size changes are dropped, and their arrays
        # are never handed out again (a worker may still be writing one): coming back to
        # the size, the loader makes two new arrays instead.
        given.set_size(128, 96)
        given.next()
        given.set_size(96, 64)
        for _ in range(6):
            given.next()
        assert sum(m.shape[2:] == (64, 96) for m in made) == 6


def test_epoch_sampling_visits_every_image_once_per_epoch(tmp_path):
    samples = _samples(tmp_path, count=6)
    settings = LoaderSettings(width=32, height=32, batch=3)
    source = SampleSource(samples)
    seen = [i for it in range(4) for i in load_batch(source, settings, 3, it,
                                                      sampling="epoch").images]
    assert sorted(seen[:6]) == list(range(6)) and sorted(seen[6:]) == list(range(6))
    assert seen[:6] != seen[6:]  # a new order each epoch


# --- random=1 ----------------------------------------------------------------------------


class _Draws:
    """A generator stand-in returning fixed draws: rand_scale takes one uniform float and
    one coin (integers(0, 2) == 0 means the reciprocal)."""

    def __init__(self, uniform: float, reciprocal: bool) -> None:
        self.uniform, self.reciprocal = uniform, reciprocal

    def random(self, dtype=np.float64):
        return dtype(self.uniform)

    def integers(self, low, high, endpoint=False):
        return 0 if self.reciprocal else 1


def _oracle_size(iteration, start, random, w, h, step, max_batches, uniform, reciprocal):
    """train_detector's multi-scale rule (detector.cpp), float64 with C's roundl."""
    if not random or (iteration - start) % 10:
        return None
    coef = 1.4 if random == 1 else random
    f = 1 + (coef - 1) * uniform
    if reciprocal:
        f = 1 / f

    def size(k, initial):
        return int(math.floor(k * initial / step + 1 + 0.5) * step)

    dw, dh = size(f, w), size(f, h)
    if f < 1 and (dw > w or dh > h):
        dw, dh = w, h
    if iteration == start or iteration > max_batches - 100:
        dw, dh = size(coef, w), size(coef, h)
    return max(dw, int(step)), max(dh, int(step))


@pytest.mark.parametrize(("iteration", "uniform", "reciprocal", "hand"), [
    (0, 0.5, False, (608, 608)),     # first iteration of the run: the largest size
    (5, 0.5, False, None),           # not a multiple of 10
    (10, 0.5, False, (544, 544)),    # 416 * 1.2 / 32 + 1 = 16.6 -> 17 * 32
    (20, 0.5, True, (384, 384)),     # 416 / 1.2 / 32 + 1 = 11.83 -> 12 * 32
    (30, 0.0, False, (448, 448)),    # factor 1: 416 / 32 + 1 = 14 -> 448
    (40, 0.1, True, (416, 416)),     # 1/1.04: 13.5 -> 14 * 32 = 448 > 416: stays 416
    (40, 0.99, True, (320, 320)),    # 1/1.396: 10.31 -> 10 * 32
    (950, 0.0, True, (608, 608)),    # past max_batches - 100: the largest size
])
def test_random_size_table(iteration, uniform, reciprocal, hand):
    values = {"width": 416, "height": 416, "random": 1.0, "resize_step": 32.0}
    got = random_size(iteration, values, 1000, _Draws(uniform, reciprocal))
    assert got == hand
    assert got == _oracle_size(iteration, 0, 1.0, 416, 416, 32, 1000, uniform, reciprocal)


def test_random_size_variants():
    values = {"width": 320, "height": 192, "random": 1.2, "resize_step": 16.0}
    for iteration, uniform, reciprocal in [(3, 0.3, False), (13, 0.7, True), (23, 0.9, False)]:
        got = random_size(iteration, values, 5000, _Draws(uniform, reciprocal), start_iteration=3)
        expected = _oracle_size(iteration, 3, 1.2, 320, 192, 16, 5000, uniform, reciprocal)
        assert got == expected
    assert random_size(10, {**values, "random": 0.0}, 5000, 0) is None
    # An int seed draws from (seed, iteration) alone: the same answer every time.
    assert random_size(40, values, 5000, 9) == random_size(40, values, 5000, 9)
    sizes = {random_size(i, values, 5000, 9) for i in range(10, 400, 10)}
    assert len(sizes) > 3 and all(w % 16 == 0 and h % 16 == 0 for w, h in sizes)


# --- lifecycle ---------------------------------------------------------------------------


def _loader_threads():
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)]


def test_close_mid_epoch_leaves_no_thread(tmp_path):
    samples = _samples(tmp_path)
    loader = Loader(samples, LoaderSettings(**FULL), workers=3, prefetch=3)
    loader.next()
    assert _loader_threads()
    loader.close()
    loader.close()
    assert not _loader_threads()
    with pytest.raises(ArgumentError, match="closed"):
        loader.next()
    assert loader.wait_seconds > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_image_raises_naming_the_file(tmp_path, workers):
    samples = _samples(tmp_path, count=2)
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    samples = [*samples, (str(bad), np.zeros((0, 5), np.float32))]
    settings = LoaderSettings(**{**FULL, "mixup": 0, "batch": 8})
    loader = Loader(samples, settings, workers=workers, sampling="epoch")
    with pytest.raises(ImageError, match="broken.jpg"):
        for _ in range(3):
            loader.next()
    assert loader.closed and not _loader_threads()


def test_missing_image_and_bad_boxes(tmp_path):
    settings = LoaderSettings(width=32, height=32, batch=1)
    with pytest.raises(ImageError, match="nowhere.png: image file not found"):
        load_batch(SampleSource([(str(tmp_path / "nowhere.png"), [])]), settings, 0, 0)
    path = _samples(tmp_path, count=1)[0][0]
    bad_rows = [[0, 0.5, 0.5, 0.2, 0.2], [1, 0.5, np.nan, 0.2, 0.2]]
    with pytest.raises(ArgumentError, match=r"img0.png: box 2 .* not finite"):
        load_batch(SampleSource([(path, bad_rows)]), settings, 0, 0)
    with pytest.raises(ArgumentError, match=r"box 1 .*class 3 .* below 3"):
        load_batch(SampleSource([(path, [[3, 0.5, 0.5, 0.1, 0.1]])], classes=3), settings, 0, 0)
    with pytest.raises(ArgumentError, match="no width or height"):
        load_batch(SampleSource([(path, [[0, 0.5, 0.5, 0.0, 0.1]])]), settings, 0, 0)


def test_interrupt_in_a_worker_reaches_the_caller_and_stops_everything(tmp_path):
    samples = [p for p, _ in _samples(tmp_path)]

    def boxes(path):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with Loader(samples, LoaderSettings(**FULL), boxes=boxes, workers=2) as loader:
            loader.next()
    assert not _loader_threads()


def test_samples_with_a_boxes_callable(tmp_path):
    pairs = _samples(tmp_path, count=2)
    lookup = {p: b for p, b in pairs}

    class Sample:
        def __init__(self, image):
            self.image = image

    settings = LoaderSettings(width=64, height=48, batch=2)
    with Loader([Sample(p) for p in lookup], settings, boxes=lambda s: lookup[s.image],
                workers=1) as loader:
        by_callable = loader.next()
    with Loader(pairs, settings, workers=1) as loader:
        by_pairs = loader.next()
    assert by_callable.x.tobytes() == by_pairs.x.tobytes()


# --- settings ----------------------------------------------------------------------------

CFG = """[net]
width=416
height=288
channels=3
batch=16
subdivisions=2
mosaic=1
hue=.1
saturation=1.5
exposure=1.5

[convolutional]
filters=18
size=1
activation=linear

[yolo]
classes=1
jitter=.1
random=0
max=50

[convolutional]
filters=18
size=1
activation=linear

[yolo]
classes=1
jitter=.3
resize=1.5
random=1
max=90
"""


def test_settings_from_cfg_take_the_last_yolo_layer():
    from darknet_metal.training.loading import settings_from_cfg

    s = settings_from_cfg(parse_cfg_text(CFG))
    assert (s.width, s.height, s.batch, s.channels) == (416, 288, 16, 3)
    assert (s.jitter, s.resize, s.random, s.max_boxes, s.classes) == (0.3, 1.5, 1.0, 90, 1)
    assert s.mosaic and (s.hue, s.saturation, s.exposure) == (0.1, 1.5, 1.5)


@pytest.mark.parametrize(("extra", "key", "line"), [
    ("cutmix=1\n", "cutmix", 11), ("letter_box=1\n", "letter_box", 11),
])
def test_settings_refuse_what_darknet_refuses(extra, key, line):
    from darknet_metal.training.loading import settings_from_cfg

    text = CFG.replace("exposure=1.5\n", "exposure=1.5\n" + extra)
    with pytest.raises(CfgError) as info:
        settings_from_cfg(parse_cfg_text(text))
    assert info.value.key == key and info.value.line == line


def test_settings_refuse_a_jitter_that_can_empty_the_crop():
    from darknet_metal.training.loading import settings_from_cfg

    with pytest.raises(CfgError) as info:
        settings_from_cfg(parse_cfg_text(CFG.replace("jitter=.3", "jitter=.6")))
    assert info.value.key == "jitter" and info.value.line == 30


def test_gray_networks_and_blended_images(tmp_path):
    black, white = tmp_path / "black.png", tmp_path / "white.png"
    write_png(black, np.zeros((40, 50, 3), np.uint8))
    write_png(white, np.full((40, 50, 3), 255, np.uint8))
    one_box = np.array([[0, 0.5, 0.5, 0.4, 0.4]], np.float32)
    samples = [(str(black), one_box), (str(white), one_box)]
    gray = LoaderSettings(width=32, height=24, channels=1, batch=4, exposure=1.5, mixup=3)
    batch = load_batch(SampleSource(samples), gray, 0, 0)
    assert batch.x.shape == (4, 1, 24, 32)
    # mixup=1: about half the images are black and white half and half, with both boxes.
    blend = LoaderSettings(width=32, height=24, batch=16, jitter=0.0, flip=0, mixup=1)
    batch = load_batch(SampleSource(samples), blend, 0, 0)
    counts = [len(t) for t in batch.truths]
    assert set(counts) == {1, 2}
    for x, n in zip(batch.x, counts, strict=True):
        values = set(np.unique(x).tolist())
        assert values <= ({0.0, 1.0} if n == 1 else {0.0, 0.5, 1.0})
        assert n == 1 or len(values) == 1  # blended: one value all over
