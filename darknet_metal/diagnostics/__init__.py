"""Checks a user runs against a device: ``darknet-metal doctor`` (device facts, every pipeline
built, kernel and network parity), the kernel cases it runs (``kernel_cases``, run by
``kernel_parity.run_case``; tests/metal run the same cases on the emulator) and the
layer-by-layer CPU-against-device comparison of ``tools/parity.py`` (``parity``).

Owns: the reports that say whether a device computes what the CPU does, and the kernel cases.
May import anything below the command line: ``network``, ``runtime``, ``ops``, ``metal``,
``cpu`` (the reference kernels), ``model``, ``inference``, ``errors``.
"""
