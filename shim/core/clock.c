/* Monotonic, so a wall-clock change while encoding cannot make encode_ns go backwards. */
#include <time.h>

#include "clock.h"

uint64_t dm_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
