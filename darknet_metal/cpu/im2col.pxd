from cython cimport floating

# Unfold output rows oy_begin..oy_end-1 of one image into GEMM columns; see im2col.pyx for
# the layout.
cdef void im2col(const floating* im, Py_ssize_t channels, Py_ssize_t height, Py_ssize_t width,
                 Py_ssize_t ksize, Py_ssize_t stride_x, Py_ssize_t stride_y,
                 Py_ssize_t pad, Py_ssize_t dilation, Py_ssize_t oy_begin, Py_ssize_t oy_end,
                 Py_ssize_t out_w, floating* col) noexcept nogil

# Add GEMM columns of output rows oy_begin..oy_end-1 back into one image (the adjoint of
# im2col with the same arguments): every column element is added into the input pixel it
# was unfolded from, elements of padding positions are dropped. ``im`` is accumulated
# into, never cleared.
cdef void col2im(const floating* col, Py_ssize_t channels, Py_ssize_t height,
                 Py_ssize_t width, Py_ssize_t ksize, Py_ssize_t stride_x,
                 Py_ssize_t stride_y, Py_ssize_t pad, Py_ssize_t dilation,
                 Py_ssize_t oy_begin, Py_ssize_t oy_end, Py_ssize_t out_w,
                 floating* im) noexcept nogil
