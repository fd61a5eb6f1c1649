"""calc_anchors against a scalar float32 oracle of Darknet's k-means.

The oracle follows src-lib/matrix.cpp (do_kmeans, random_centers, sample, dist,
closest_center, kmeans_expectation, kmeans_maximization) and src-lib/detector.cpp
(calc_anchors: the sort by area, the average IoU) one element at a time, with Darknet's
rand() replaced by the documented draws from numpy.random.default_rng(seed).
"""

import numpy as np
import pytest

from darknet_metal import ArgumentError
from darknet_metal.evaluation import calc_anchors, format_anchors

F = np.float32


def _dist(x, y):
    # matrix.cpp dist(): sizes at a common corner, 1 - IoU, float32.
    mw = x[0] if x[0] < y[0] else y[0]
    mh = x[1] if x[1] < y[1] else y[1]
    inter = F(mw * mh)
    union = F(F(x[0] * x[1]) + F(y[0] * y[1])) - inter
    return F(1) - F(inter / union), F(inter / union)


def _closest(datum, centers):
    # closest_center(): the first centre at the smallest distance.
    best, best_dist = 0, _dist(datum, centers[0])[0]
    for j in range(len(centers)):
        d = _dist(datum, centers[j])[0]
        if d < best_dist:
            best, best_dist = j, d
    return best


def _oracle(wh, k, width, height, seed):
    data = [(F(F(w) * F(width)), F(F(h) * F(height))) for w, h in wh]
    n = len(data)
    # sample(): Fisher-Yates from the last position down; the swap index for position i is
    # the draw for i (here all drawn at once, high = i + 1 for i = n-1 .. 0).
    draws = np.random.default_rng(seed).integers(0, np.arange(n, 0, -1))
    s = list(range(n))
    for i, j in zip(range(n - 1, -1, -1), draws, strict=True):
        s[i], s[int(j)] = s[int(j)], s[i]
    centers = [list(data[s[i]]) for i in range(k)]
    assignments = [0] * n

    def maximization():
        old = [c[:] for c in centers]
        counts = [0] * k
        for c in centers:
            c[0] = c[1] = F(0)
        for i, (w, h) in enumerate(data):
            a = assignments[i]
            counts[a] += 1
            centers[a][0] = F(centers[a][0] + w)
            centers[a][1] = F(centers[a][1] + h)
        for j in range(k):
            if counts[j]:
                centers[j][0] = F(centers[j][0] / F(counts[j]))
                centers[j][1] = F(centers[j][1] / F(counts[j]))
        for j in range(k):
            for m in range(2):
                if centers[j][m] == 0:
                    centers[j][m] = old[j][m]

    def expectation():
        converged = True
        for i in range(n):
            c = _closest(data[i], centers)
            if c != assignments[i]:
                converged = False
            assignments[i] = c
        return converged

    if k == 1:
        maximization()
    it = 0
    while it < 1000 and not expectation():
        maximization()
        it += 1
    # calc_anchors(): sort by area, increasing; a stable sort for equal areas.
    centers.sort(key=lambda c: F(c[0] * c[1]))
    total = F(0)
    for datum in data:
        best_dist, best_iou = F(np.inf), F(0)
        for c in centers:
            d, iou = _dist(datum, c)
            if d < best_dist:
                best_dist, best_iou = d, iou
        total = F(total + best_iou)
    return np.array(centers, dtype=F), it, float(F(F(100) * total / F(n)))


def _boxes(seed, n):
    rng = np.random.default_rng(seed)
    # Three size families (small square, tall, wide) so the clusters have shapes to find.
    family = rng.integers(0, 3, n)
    base = np.array([[0.05, 0.05], [0.1, 0.3], [0.4, 0.15]])[family]
    return np.clip(base * rng.lognormal(0, 0.3, (n, 2)), 0.005, 1.0)


@pytest.mark.parametrize("seed, n, k, width, height", [
    (0, 300, 6, 416, 416), (1, 250, 9, 608, 320), (2, 40, 1, 416, 416), (3, 12, 12, 32, 64),
])
def test_calc_anchors_equals_the_oracle(seed, n, k, width, height):
    wh = _boxes(seed, n)
    report = calc_anchors(wh, k, width, height, seed=seed)
    anchors, iterations, avg_iou = _oracle(wh, k, width, height, seed)
    np.testing.assert_array_equal(report.anchors, anchors)
    assert report.iterations == iterations
    assert report.avg_iou == avg_iou
    assert report.counts.sum() == n and report.boxes == n
    areas = report.anchors[:, 0] * report.anchors[:, 1]
    assert np.all(np.diff(areas) >= 0)
    if k > 1 and n > k:
        assert iterations > 0  # the loop ran


def test_same_seed_same_anchors_other_seed_other_start():
    wh = _boxes(5, 200)
    a = calc_anchors(wh, 6, 416, 416, seed=7)
    b = calc_anchors(wh, 6, 416, 416, seed=7)
    np.testing.assert_array_equal(a.anchors, b.anchors)
    assert a.iterations == b.iterations and a.avg_iou == b.avg_iou
    others = {calc_anchors(wh, 6, 416, 416, seed=s).iterations for s in range(6)}
    assert len(others) > 1  # the seed does choose the start


def test_one_box_per_cluster_by_hand():
    # k = n: each box is its own centre. Sizes at 416: (41.6, 83.2) and (20.8, 20.8);
    # sorted by area: 20.8 x 20.8 first. Every box has IoU 1 with its own anchor: 100 %.
    wh = np.array([[0.1, 0.2], [0.05, 0.05]])
    report = calc_anchors(wh, 2, 416, 416)
    np.testing.assert_allclose(report.anchors, [[20.8, 20.8], [41.6, 83.2]], rtol=1e-6)
    assert report.avg_iou == pytest.approx(100.0)
    text = format_anchors(report)
    # Darknet V5 prints (int) of each value: 20.8 -> 20, 41.6 -> 41, 83.2 -> 83.
    assert "anchors = 20, 20, 41, 83\n" in text
    assert "avg IoU = 100.00 %" in text
    # At width 32 Darknet prints %2.4f pairs: 0.5 * 32 = 16, 0.25 * 64 = 16.
    small = format_anchors(calc_anchors(np.array([[0.5, 0.25]]), 1, 32, 64))
    assert "anchors = 16.0000,16.0000\n" in small


def test_k_one_is_the_mean():
    wh = np.array([[0.1, 0.1], [0.3, 0.2], [0.2, 0.3]])
    report = calc_anchors(wh, 1, 320, 320)
    # (32 + 96 + 64) / 3 = 64 and (32 + 64 + 96) / 3 = 64.
    np.testing.assert_allclose(report.anchors, [[64, 64]], rtol=1e-6)
    assert report.iterations == 0


@pytest.mark.parametrize("wh, k, width, height, match", [
    (np.full((3, 2), 0.1), 4, 416, 416, r"clusters is 4 but there are only 3 boxes"),
    (np.zeros((0, 2)), 1, 416, 416, r"only 0 boxes"),
    (np.array([[0.1, 0.1], [0.0, 0.2]]), 1, 416, 416, r"row 2: w is 0.0"),
    (np.array([[0.1, 1.5]]), 1, 416, 416, r"row 1: h is 1.5"),
    (np.array([[0.1, np.nan]]), 1, 416, 416, r"row 1: h is nan"),
    (np.full((3, 2), 0.1), 1, 400, 416, r"width must be a multiple of 32"),
    (np.full((3, 2), 0.1), 0, 416, 416, r"clusters"),
    (np.full((3,), 0.1), 1, 416, 416, r"shape \(n, 2\)"),
])
def test_bad_input(wh, k, width, height, match):
    with pytest.raises(ArgumentError, match=match):
        calc_anchors(wh, k, width, height)
