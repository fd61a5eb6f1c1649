# Libm for the ``floating`` fused type (the f prefix), matched to the precision: float32
# calls the float functions (expf, logf, ...) as Darknet does, so float32 results round as
# Darknet's; float64 calls the double ones.
#
# Defined inline here rather than in a module so each cimporting module compiles its own
# copy and the C compiler can inline them into the hot loops. All are noexcept nogil.

cimport cython
from cython cimport floating
from libc.math cimport atan, atanf, exp, expf, floor, floorf, log, logf, pow, powf, sqrt, sqrtf


cdef inline floating fexp(floating x) noexcept nogil:
    if floating is float:
        return expf(x)
    else:
        return exp(x)


cdef inline floating flog(floating x) noexcept nogil:
    if floating is float:
        return logf(x)
    else:
        return log(x)


cdef inline floating fatan(floating x) noexcept nogil:
    if floating is float:
        return atanf(x)
    else:
        return atan(x)


cdef inline floating fsqrt(floating x) noexcept nogil:
    if floating is float:
        return sqrtf(x)
    else:
        return sqrt(x)


cdef inline floating ffloor(floating x) noexcept nogil:
    if floating is float:
        return floorf(x)
    else:
        return floor(x)


cdef inline floating fcube(floating x) noexcept nogil:
    if floating is float:
        return powf(x, 3.0)
    else:
        return pow(x, 3.0)


@cython.cdivision(True)
cdef inline floating logistic(floating x) noexcept nogil:
    """Darknet's logistic ``1 / (1 + exp(-x))``, in the working precision."""
    # A typed one: a bare 1 would be a C double and promote the float32 path.
    cdef floating one = 1
    return one / (one + fexp(-x))
