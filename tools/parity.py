"""CPU-versus-GPU parity of a Darknet network, layer by layer.

    python tools/parity.py CFG [--weights W | --random-seed S] [--image IMG | --random-input]
                           [--device emu|metal|cuda] [--size WxH] [--gemm auto|simd|tiled]
                           [--json]
    python tools/parity.py CFG --train [--batch N] [--weights W | --random-seed S]
                           [--device emu|metal|cuda] [--size WxH] [--json]

Prints, per layer: index, type, output shape, where it ran (kernels or CPU fallback), max abs
diff, NMSE and the verdict against the tolerance of ``darknet_metal.diagnostics.parity``;
exits 1 if any layer fails. While it runs, a line per stage (loading, CPU pass, device pass,
with the seconds each took) goes to stderr, with or without ``--json``. Importable:
``run_parity(...)`` returns the report as a dict.
"""

from __future__ import annotations

import sys

from darknet_metal.diagnostics.parity import (
    DEFAULT_TOLERANCE,
    format_report,
    format_training_report,
    main,
    run_parity,
    run_training_parity,
)

__all__ = ["DEFAULT_TOLERANCE", "format_report", "format_training_report", "main",
           "run_parity", "run_training_parity"]

if __name__ == "__main__":
    sys.exit(main())
