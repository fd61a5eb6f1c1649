"""Checks a user runs against a device: ``darknet-metal doctor`` (device facts, every pipeline
built, kernel and network parity) and the layer-by-layer CPU-against-device comparison of
``tools/parity.py`` (``parity``).

Owns: the reports that say whether a device computes what the CPU does. May import anything
below the command line: ``network``, ``runtime``, ``ops``, ``metal``, ``model``,
``inference``, ``errors``.
"""
