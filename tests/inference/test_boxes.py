"""Box decoding, NMS and detection reporting.

References: Darknet V5's detections for its own [yolo] outputs (../shared/golden),
hand-computed boxes and overlaps, and the real libstdc++ ``std::sort`` (compiled here when
g++ is available) for the order Darknet leaves equal scores in.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import subprocess

import numpy as np
import pytest
from shared_paths import SHARED

from darknet_metal.inference.boxes import (
    Detection,
    YoloHead,
    _heap_sort,
    _introsort,
    _std_sort_order,
    decode_yolo,
    detect_boxes,
    diou_nms,
    nms_sort,
)

GOLDEN = SHARED / "golden" / "darknet-v5-cpu-yolov3-tiny"
MODEL = SHARED / "models" / "yolov3-tiny"


# ---------------------------------------------------------------------------------------
# Against Darknet's detections


def yolo_heads_from_cfg(path: pathlib.Path) -> list[YoloHead]:
    """Anchors and masks of each [yolo] section, read straight from the cfg text."""
    heads, section, values = [], None, {}

    def flush():
        if section == "yolo":
            anchors = np.array([float(v) for v in values["anchors"].split(",")]).reshape(-1, 2)
            mask = [int(v) for v in values["mask"].split(",")]
            heads.append(YoloHead(anchors[mask], int(values["classes"]), False))

    for raw in path.read_text().splitlines():
        line = raw.split("#")[0].strip()
        if line.startswith("["):
            flush()
            section, values = line.strip("[]"), {}
        elif "=" in line:
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    flush()
    return heads


@pytest.mark.parametrize("stem", ["dog", "coffee"])
def test_detections_match_darknet(stem):
    golden = json.loads((GOLDEN / "detections.json").read_text())[stem]
    names = (MODEL / "coco.names").read_text().splitlines()
    heads = yolo_heads_from_cfg(MODEL / "yolov3-tiny.cfg")
    assert [h.anchors.tolist() for h in heads] == [
        [[81, 82], [135, 169], [344, 319]],
        [[10, 14], [23, 27], [37, 58]],
    ]
    outputs = [
        np.fromfile(GOLDEN / f"{stem}_layer16.bin", "<f4").reshape(255, 13, 13),
        np.fromfile(GOLDEN / f"{stem}_layer23.bin", "<f4").reshape(255, 26, 26),
    ]
    dets = detect_boxes(outputs, heads, 416, 416, golden["width"], golden["height"], names=names)
    want = golden["detections"]
    assert [d.name for d in dets] == [w["cls"] for w in want]  # same classes, same order
    for d, w in zip(dets, want, strict=True):
        assert d.class_id == names.index(w["cls"])
        assert d.confidence == pytest.approx(w["conf"], abs=1e-4)
        assert d.objectness == pytest.approx(w["objectness"], abs=1e-4)
        for key in ("left", "top", "width", "height"):
            assert getattr(d, key) == pytest.approx(w[key], abs=0.05), key


# ---------------------------------------------------------------------------------------
# decode_yolo, hand-computed


def _hand_output(new_coords: bool = False) -> tuple[np.ndarray, YoloHead]:
    """2 anchors (10x20, 30x40), 2 classes, a 2-row x 3-column grid."""
    head = YoloHead(np.array([[10, 20], [30, 40]]), 2, new_coords)
    out = np.zeros((2, 7, 2, 3), np.float32)  # anchor, entry (x y w h obj c0 c1), row, col
    wide = 0.5 if new_coords else math.log(2.0)  # both make the width factor 1 resp. 2
    half = math.sqrt(0.125) if new_coords else math.log(0.5)
    out[1, :, 0, 2] = [0.5, 0.25, wide, 0.5 if new_coords else 0.0, 0.9, 0.5, 0.2]
    out[0, :, 1, 0] = [0.1, 0.9, 0.5 if new_coords else 0.0, half, 0.3, 1.0, 0.9]
    out[0, 4, 0, 1] = 0.25  # objectness equal to thresh: not a candidate
    out[1, 4:, 1, 2] = [0.26, 0.5, 0.5]  # a candidate whose class scores fall below thresh
    return out.reshape(14, 2, 3), head


def test_decode_by_hand():
    out, head = _hand_output()
    boxes, obj, probs = decode_yolo(out, head, 60, 40, 120, 80, 0.25, False)
    # V5 order: anchor 0 (row 1, col 0), then anchor 1 (row 0, col 2), then (row 1, col 2).
    # x = (col + tx) / 3, y = (row + ty) / 2, w = e^tw * anchor_w / 60, h = e^th * ah / 40.
    want = [
        [(0 + 0.1) / 3, (1 + 0.9) / 2, 10 / 60, 0.5 * 20 / 40],
        [(2 + 0.5) / 3, (0 + 0.25) / 2, 2 * 30 / 60, 1 * 40 / 40],
        [2 / 3, 1 / 2, 30 / 60, 40 / 40],
    ]
    np.testing.assert_allclose(boxes, want, rtol=1e-6)
    np.testing.assert_allclose(obj, [0.3, 0.9, 0.26], rtol=1e-6)
    # probs = objectness * class score, zeroed unless > 0.25: 0.3*0.9 = 0.27 stays.
    np.testing.assert_allclose(probs, [[0.3, 0.27], [0.45, 0.0], [0.0, 0.0]], rtol=1e-6)
    assert boxes.dtype == obj.dtype == probs.dtype == np.float32


def test_decode_new_coords_by_hand():
    out, head = _hand_output(new_coords=True)
    boxes, _, _ = decode_yolo(out, head, 60, 40, 120, 80, 0.25, False)
    # w = tw^2 * 4 * anchor_w / 60: 0.5^2 * 4 = 1 and 0.125 * 4 = 0.5.
    np.testing.assert_allclose(boxes[0, 2:], [1 * 10 / 60, 0.5 * 20 / 40], rtol=1e-6)
    np.testing.assert_allclose(boxes[1, 2:], [1 * 30 / 60, 1 * 40 / 40], rtol=1e-6)


def _one_box_output(tx, ty, anchor_w, anchor_h):
    head = YoloHead(np.array([[anchor_w, anchor_h]]), 1)
    out = np.array([tx, ty, 0.0, 0.0, 0.9, 1.0], np.float32).reshape(6, 1, 1)
    return out, head


@pytest.mark.parametrize(
    "image_w, image_h, want",
    [
        # 200x100 into 100x100: new 100x50 at row 25. y: (0.3 - 25/100) / 0.5 = 0.1,
        # h: 0.2 / 0.5 = 0.4; x and w unchanged.
        (200, 100, [0.3, 0.1, 0.4, 0.4]),
        # 100x200: new 50x100 at column 25. x: (0.3 - 0.25) / 0.5 = 0.1, w: 0.8.
        (100, 200, [0.1, 0.3, 0.8, 0.2]),
    ],
)
def test_letterbox_correction_by_hand(image_w, image_h, want):
    out, head = _one_box_output(0.3, 0.3, 40, 20)  # w = 40/100 = 0.4, h = 20/100 = 0.2
    boxes, _, _ = decode_yolo(out, head, 100, 100, image_w, image_h, 0.25, True)
    np.testing.assert_allclose(boxes[0], want, rtol=1e-6)
    plain, _, _ = decode_yolo(out, head, 100, 100, image_w, image_h, 0.25, False)
    np.testing.assert_allclose(plain[0], [0.3, 0.3, 0.4, 0.2], rtol=1e-6)


def test_letterbox_correction_truncates_the_resized_size():
    # 300x200 into 416x416: new_h = 200*416 // 300 = 277 (not 277.33), offset 139 rows.
    # A box centred in the network maps to the image centre only with 277:
    # (0.5 - 139/2/416) / (277/416) = 138.5 / 277 = 0.5. Height scales by 416/277.
    out, head = _one_box_output(0.5, 0.5, 41.6, 41.6)
    boxes, _, _ = decode_yolo(out, head, 416, 416, 300, 200, 0.25, True)
    np.testing.assert_allclose(boxes[0], [0.5, 0.5, 0.1, 0.1 * 416 / 277], rtol=1e-6)


# ---------------------------------------------------------------------------------------
# NMS, hand-computed

# Boxes are (x, y, w, h). IoU(A, B) = 0.03 / 0.05 = 0.6, IoU(B, C) = 0.6,
# IoU(A, C) = 0.02 / 0.06 = 1/3. D has zero objectness.
A = [0.50, 0.5, 0.2, 0.2]
B = [0.55, 0.5, 0.2, 0.2]
C = [0.60, 0.5, 0.2, 0.2]
D = [0.50, 0.5, 0.2, 0.2]


def _candidates():
    boxes = np.array([A, B, C, D], np.float32)
    obj = np.array([0.95, 0.9, 0.8, 0.0], np.float32)
    probs = np.array([[0.9, 0.0], [0.8, 0.6], [0.7, 0.0], [0.95, 0.0]], np.float32)
    return boxes, obj, probs


def test_nms_sort_by_hand():
    boxes, obj, probs = _candidates()
    nms_sort(boxes, obj, probs, 0.45)
    # Class 0, by score A, B, C: A suppresses B (0.6); B is then skipped, so C (1/3 from A)
    # survives although it overlaps B by 0.6. D (zero objectness) is moved to the end
    # untouched. Class 1 sorts B (0.6) first, then A and C keep their order (0 == 0):
    # final order B, A, C, D.
    np.testing.assert_array_equal(boxes, np.array([B, A, C, D], np.float32))
    np.testing.assert_array_equal(obj, np.array([0.9, 0.95, 0.8, 0.0], np.float32))
    want = np.array([[0.0, 0.6], [0.9, 0.0], [0.7, 0.0], [0.95, 0.0]], np.float32)
    np.testing.assert_array_equal(probs, want)


def test_nms_sort_threshold_is_strict_greater():
    boxes, obj, probs = _candidates()
    nms_sort(boxes, obj, probs, 0.65)  # nothing overlaps by more than 0.6
    assert np.count_nonzero(probs[:, 0]) == 4


def test_diou_nms_by_hand():
    # A and B: IoU 0.6; enclosing box 0.25 x 0.2, so c^2 = 0.1025; centres 0.05 apart,
    # d^2 = 0.0025. DIoU = 0.6 - (0.0025/0.1025)^beta: beta 0.6 -> 0.4923, beta 1 -> 0.5756.
    ratio = 0.0025 / 0.1025
    assert 0.6 - ratio**0.6 == pytest.approx(0.4923, abs=1e-4)
    assert 0.6 - ratio**1.0 == pytest.approx(0.5756, abs=1e-4)

    def run(beta):
        boxes = np.array([A, B], np.float32)
        obj = np.array([0.95, 0.9], np.float32)
        probs = np.array([[0.9], [0.8]], np.float32)
        diou_nms(boxes, obj, probs, 0.5, beta)
        return probs[:, 0].tolist()

    assert run(0.6) == pytest.approx([0.9, 0.8])  # 0.4923 <= 0.5: kept (IoU alone would not)
    assert run(1.0) == pytest.approx([0.9, 0.0])  # 0.5756 > 0.5: suppressed
    boxes, obj, probs = np.array([A, B], np.float32), np.ones(2, np.float32), np.ones((2, 1))
    probs = probs.astype(np.float32)
    nms_sort(boxes, obj, probs, 0.5)
    assert probs[:, 0].tolist() == [1.0, 0.0]


def _two_box_output():
    """One 1x1 cell, two anchors of 20x20 px in a 100x100 net: boxes A and B of above."""
    head = YoloHead(np.array([[20, 20], [20, 20]]), 1)
    out = np.array(
        [[0.50, 0.5, 0.0, 0.0, 0.9, 1.0], [0.55, 0.5, 0.0, 0.0, 0.8, 1.0]], np.float32
    ).reshape(12, 1, 1)
    return out, head


@pytest.mark.parametrize(
    "kind, beta, nms, count",
    [
        ("default", 0.6, 0.5, 1),  # IoU 0.6 > 0.5
        ("cornersnms", 1.0, 0.5, 1),  # IoU as well
        ("diounms", 0.6, 0.5, 2),  # DIoU 0.4923
        ("diounms", 1.0, 0.5, 1),  # DIoU 0.5756
        ("greedynms", 1.0, 0.5, 2),  # DIoU with Darknet's fixed exponent 0.6
        ("default", 0.6, 0.0, 2),  # nms 0 turns NMS off
    ],
)
def test_detect_boxes_nms_kinds(kind, beta, nms, count):
    out, head = _two_box_output()
    dets = detect_boxes([out], [head], 100, 100, 100, 100, nms=nms, nms_kind=kind, beta_nms=beta)
    assert len(dets) == count
    first = dets[0]
    assert first == Detection(
        0, "class_0", first.confidence, first.objectness, 40.0, 40.0, 20.0, 20.0
    )
    assert first.confidence == pytest.approx(0.9) and first.objectness == pytest.approx(0.9)


def test_detect_boxes_reports_each_class_of_a_box_in_class_order():
    head = YoloHead(np.array([[20, 10]]), 3)
    out = np.array([0.5, 0.5, 0.0, 0.0, 0.8, 0.9, 0.1, 0.5], np.float32).reshape(8, 1, 1)
    dets = detect_boxes([out], [head], 100, 100, 640, 480, names=["a", "b", "c"])
    assert [(d.class_id, d.name) for d in dets] == [(0, "a"), (2, "c")]
    assert [d.confidence for d in dets] == pytest.approx([0.72, 0.4])
    # Pixels: left = (0.5 - 0.1) * 640 = 256, top = (0.5 - 0.05) * 480 = 216.
    assert (dets[0].left, dets[0].top) == pytest.approx((256, 216))
    assert (dets[0].width, dets[0].height) == pytest.approx((128, 48))


def test_detect_boxes_rejects_bad_input():
    out, head = _two_box_output()
    other = YoloHead(np.array([[20, 20]]), 2)
    with pytest.raises(ValueError, match="at least one"):
        detect_boxes([], [], 100, 100, 100, 100)
    with pytest.raises(ValueError, match="2 yolo outputs for 1 heads"):
        detect_boxes([out, out], [head], 100, 100, 100, 100)
    with pytest.raises(ValueError, match="classes"):
        detect_boxes([out, out], [head, other], 100, 100, 100, 100)
    with pytest.raises(ValueError, match=r"\(12, 1, 1\)"):
        detect_boxes([out], [other], 100, 100, 100, 100)
    with pytest.raises(ValueError, match="nms_kind"):
        detect_boxes([out], [head], 100, 100, 100, 100, nms_kind="fastnms")
    with pytest.raises(ValueError, match="names"):
        detect_boxes([out], [YoloHead(np.array([[20, 20]]), 3)], 100, 100, 100, 100, names=["x"])
    with pytest.raises(ValueError, match="image_w"):
        detect_boxes([out], [head], 100, 100, 0, 100)
    with pytest.raises(ValueError, match=r"shape \(n, 2\)"):
        YoloHead(np.array([1.0, 2.0, 3.0]), 80)
    with pytest.raises(ValueError, match="writeable"):
        boxes, obj, probs = _candidates()
        boxes.setflags(write=False)
        nms_sort(boxes, obj, probs, 0.45)


def test_no_candidates_gives_no_detections():
    out, head = _two_box_output()
    assert detect_boxes([out], [head], 100, 100, 100, 100, thresh=0.95) == []


# ---------------------------------------------------------------------------------------
# The order of equal scores: libstdc++'s std::sort, compiled for real

SORT_PROGRAM = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
int main() {
    int mode, n;
    while (std::scanf("%d %d", &mode, &n) == 2) {
        std::vector<float> key(n);
        for (auto &k : key) std::scanf("%f", &k);
        std::vector<int> s(n);
        for (int i = 0; i < n; ++i) s[i] = i;
        auto before = [&](int a, int b) { return key[b] < key[a]; };  // Darknet's order
        if (mode == 0) std::sort(s.begin(), s.end(), before);
        else std::partial_sort(s.begin(), s.end(), s.end(), before);  // the heap fallback
        for (int i = 0; i < n; ++i) std::printf("%d ", s[i]);
        std::printf("\n");
    }
}
"""


@pytest.fixture(scope="module")
def std_sort_binary(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not available to build the std::sort reference")
    work = tmp_path_factory.mktemp("stdsort")
    (work / "sort.cpp").write_text(SORT_PROGRAM)
    binary = work / "sort"
    subprocess.run([gxx, "-O1", "-o", str(binary), str(work / "sort.cpp")], check=True)
    return binary


def _key_sets():
    rng = np.random.default_rng(11)
    sets = []
    for n in (0, 1, 2, 3, 15, 16, 17, 18, 31, 64, 100, 257):
        sets.append(np.zeros(n, np.float32))  # all equal: std::sort still moves them
        ties = rng.choice(np.array([0.0, 0.3, 0.5, 0.7], np.float32), n)
        sets.append(ties.astype(np.float32))
        sparse = np.where(rng.random(n) < 0.1, rng.random(n), 0).astype(np.float32)
        sets.append(sparse)
        sets.append(rng.random(n).astype(np.float32))
        sets.append(np.sort(rng.random(n).astype(np.float32)))  # ascending: worst order
    return sets


def test_std_sort_replay_matches_libstdcxx(std_sort_binary):
    sets = _key_sets()
    lines = []
    for mode in (0, 1):
        for keys in sets:
            lines.append(f"{mode} {len(keys)} " + " ".join(f"{k:.9g}" for k in keys))
    run = subprocess.run(
        [str(std_sort_binary)],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        check=True,
    )
    results = run.stdout.splitlines()
    assert len(results) == 2 * len(sets)
    for i, keys in enumerate(sets):
        want_sort = [int(v) for v in results[i].split()]
        want_heap = [int(v) for v in results[len(sets) + i].split()]
        s = list(range(len(keys)))
        _introsort(s, keys.tolist())
        assert s == want_sort, f"std::sort, n={len(keys)}"
        assert _std_sort_order(keys) == want_sort, f"n={len(keys)}"
        h = list(range(len(keys)))
        _heap_sort(h, keys.tolist(), 0, len(keys))
        assert h == want_heap, f"partial_sort, n={len(keys)}"


def test_std_sort_is_a_descending_sort():
    # Independent of the compiler: whatever the order of ties, keys come out descending.
    for keys in _key_sets():
        s = list(range(len(keys)))
        _introsort(s, keys.tolist())
        assert sorted(s) == list(range(len(keys)))
        assert np.all(np.diff(keys[s]) <= 0)


def test_nms_gives_the_same_result_when_overlaps_are_computed_row_by_row(monkeypatch):
    # Many candidates switch the overlap table to rows computed on demand; the result
    # must not depend on which way it was computed.
    rng = np.random.default_rng(4)
    n = 150
    boxes = np.column_stack([rng.random((n, 2)), rng.random((n, 2)) * 0.3]).astype(np.float32)
    obj = (rng.random(n) * 0.7 + 0.25).astype(np.float32)
    probs = ((rng.random((n, 6)) < 0.3) * rng.random((n, 6))).astype(np.float32)
    full = [a.copy() for a in (boxes, obj, probs)]
    nms_sort(*full, 0.45)
    monkeypatch.setattr("darknet_metal.inference.boxes._OverlapTable._FULL_LIMIT", 0)
    rows = [a.copy() for a in (boxes, obj, probs)]
    nms_sort(*rows, 0.45)
    for x, y in zip(full, rows, strict=True):
        np.testing.assert_array_equal(x, y)
    assert np.count_nonzero(full[2]) < np.count_nonzero(probs)  # something was suppressed
