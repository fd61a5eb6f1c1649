"""Cython CPU reference kernels: im2col, convolution, activations and the other layers."""

import os

# Layers alternate between OpenMP loops and multi-threaded BLAS calls. OpenMP's default is to
# spin after a parallel loop, which steals the cores BLAS is about to use; sleeping instead
# costs microseconds per loop. Must be set before the OpenMP runtime loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
