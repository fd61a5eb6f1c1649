# Cython declarations of kernels.h: the float32 loops written in C so the compiler
# vectorises them (see the header for each one's layout and rounding contract). All are
# nogil and cannot raise; every module that uses them cimports them from here.

cdef extern from "kernels.h" nogil:
    int dm_fma_level()
    # Activation ids, checked against activation.pxd's ACT_* when activation loads.
    enum:
        DM_ACT_LINEAR
        DM_ACT_LEAKY
        DM_ACT_RELU
        DM_ACT_RELU6
        DM_ACT_LOGISTIC
        DM_ACT_LOGGY
        DM_ACT_TANH
        DM_ACT_ELU
        DM_ACT_SELU
        DM_ACT_GELU
        DM_ACT_MISH
        DM_ACT_SWISH
        DM_ACT_HARD_MISH
        DM_ACT_HARDTAN
        DM_ACT_LHTAN
        DM_ACT_PLSE
        DM_ACT_STAIR
        DM_ACT_RAMP
        DM_ACT_RELIE
        DM_ACT_REVLEAKY
    int dm_act_fusable(int act)
    void dm_act_f32(float* x, Py_ssize_t n, int act)
    void dm_bias_act_f32(float* out, const float* bias, Py_ssize_t channels,
                         Py_ssize_t spatial, int act)
    void dm_maxpool2x2s2_f32(const float* src, float* dst, Py_ssize_t planes, Py_ssize_t h,
                             Py_ssize_t w, Py_ssize_t out_h, Py_ssize_t out_w)
    void dm_copy_even_f32(const float* src, float* dst, Py_ssize_t n)
    enum: DM_DIRECT_FB  # filters per block of the direct convolution
    Py_ssize_t dm_conv3x3_direct_scratch(Py_ssize_t channels, Py_ssize_t filters,
                                         Py_ssize_t height, Py_ssize_t width,
                                         Py_ssize_t stride)
    void dm_conv3x3_direct_pad_f32(const float* x, Py_ssize_t height, Py_ssize_t width,
                                   Py_ssize_t stride, Py_ssize_t c0, Py_ssize_t c1,
                                   float* scratch)
    void dm_conv3x3_direct_weights_f32(const float* weights, Py_ssize_t channels,
                                       Py_ssize_t height, Py_ssize_t width, Py_ssize_t stride,
                                       Py_ssize_t filters, float* scratch)
    void dm_conv3x3_direct_rows_f32(Py_ssize_t channels, Py_ssize_t height, Py_ssize_t width,
                                    Py_ssize_t stride, const float* bias, Py_ssize_t filters,
                                    int act, const float* scratch, Py_ssize_t fb0,
                                    Py_ssize_t fb1, Py_ssize_t y0, Py_ssize_t y1, int fused,
                                    float* out)
    enum: DM_GEMM8_M  # weight rows per block of the packed product
    Py_ssize_t dm_pack8_size(Py_ssize_t m, Py_ssize_t k)
    Py_ssize_t dm_gemm8_columns()
    void dm_pack8_f32(const float* a, Py_ssize_t m, Py_ssize_t k, float* packed)
    void dm_gemm8_f32(Py_ssize_t m, Py_ssize_t k, const float* packed, const float* b,
                      Py_ssize_t n, const float* bias, int act, Py_ssize_t mb0,
                      Py_ssize_t mb1, Py_ssize_t x0, Py_ssize_t x1, float* c,
                      Py_ssize_t ldc)
    void dm_wino2_input_f32(const float* x, Py_ssize_t channels, Py_ssize_t c0, Py_ssize_t c1,
                            Py_ssize_t height, Py_ssize_t width, Py_ssize_t tiles_y,
                            Py_ssize_t tiles_x, float* v)
    void dm_wino2_output_f32(const float* m, const float* bias, Py_ssize_t filters,
                             Py_ssize_t f0, Py_ssize_t f1, Py_ssize_t height, Py_ssize_t width,
                             Py_ssize_t tiles_y, Py_ssize_t tiles_x, int act, float* out)
    void dm_wino4_input_f32(const float* x, Py_ssize_t channels, Py_ssize_t c0, Py_ssize_t c1,
                            Py_ssize_t height, Py_ssize_t width, Py_ssize_t tiles_y,
                            Py_ssize_t tiles_x, float* v)
    void dm_wino4_output_f32(const float* m, const float* bias, Py_ssize_t filters,
                             Py_ssize_t f0, Py_ssize_t f1, Py_ssize_t height, Py_ssize_t width,
                             Py_ssize_t tiles_y, Py_ssize_t tiles_x, int act, float* out)
