"""Cython CPU reference kernels: im2col, convolution, activations and the other layers."""
