from cython cimport floating

# Ids are the positions in darknet_metal.model.activations.ACTIVATIONS (checked at import).
cdef enum:
    ACT_LINEAR = 0
    ACT_LEAKY = 1
    ACT_RELU = 2
    ACT_RELU6 = 3
    ACT_LOGISTIC = 4
    ACT_LOGGY = 5
    ACT_TANH = 6
    ACT_ELU = 7
    ACT_SELU = 8
    ACT_GELU = 9
    ACT_MISH = 10
    ACT_SWISH = 11
    ACT_HARD_MISH = 12
    ACT_HARDTAN = 13
    ACT_LHTAN = 14
    ACT_PLSE = 15
    ACT_STAIR = 16
    ACT_RAMP = 17
    ACT_RELIE = 18
    ACT_REVLEAKY = 19
    ACT_NORM_CHAN = 20
    ACT_NORM_CHAN_SOFTMAX = 21
    ACT_NORM_CHAN_SOFTMAX_MAXVAL = 22
    ACT_COUNT = 23


# Array kernels (float32 or float64 through ``floating``), applied in place; see
# activation.pyx for which of input or output the gradients take.
cdef void activate_array(floating* x, Py_ssize_t n, int act) noexcept nogil
cdef void gradient_array(const floating* y, Py_ssize_t n, int act,
                         floating* delta) noexcept nogil
cdef void activate_channels(floating* x, Py_ssize_t batch, Py_ssize_t channels,
                            Py_ssize_t spatial, int act) noexcept nogil
cdef void gradient_channels(const floating* y, Py_ssize_t batch, Py_ssize_t channels,
                            Py_ssize_t spatial, int act, floating* delta) noexcept nogil
