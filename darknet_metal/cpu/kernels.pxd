# Cython declarations of kernels.h: the float32 loops written in C so the compiler
# vectorises them (see the header for each one's layout and rounding contract). All are
# nogil and cannot raise; every module that uses them cimports them from here.

cdef extern from "kernels.h" nogil:
    void dm_bias_act_f32(float* out, const float* bias, Py_ssize_t channels,
                         Py_ssize_t spatial, int leaky)
    void dm_maxpool2x2s2_f32(const float* src, float* dst, Py_ssize_t planes, Py_ssize_t h,
                             Py_ssize_t w, Py_ssize_t out_h, Py_ssize_t out_w)
    Py_ssize_t dm_conv3x3_direct_scratch(Py_ssize_t channels, Py_ssize_t filters,
                                         Py_ssize_t height, Py_ssize_t width)
    void dm_conv3x3_direct_f32(const float* x, Py_ssize_t channels, Py_ssize_t height,
                               Py_ssize_t width, const float* weights, const float* bias,
                               Py_ssize_t filters, int leaky, float* scratch, float* out)
    void dm_wino2_input_f32(const float* x, Py_ssize_t channels, Py_ssize_t height,
                            Py_ssize_t width, Py_ssize_t tiles_y, Py_ssize_t tiles_x, float* v)
    void dm_wino2_output_f32(const float* m, const float* bias, Py_ssize_t filters,
                             Py_ssize_t height, Py_ssize_t width, Py_ssize_t tiles_y,
                             Py_ssize_t tiles_x, int leaky, float* out)
