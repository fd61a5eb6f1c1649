/* Host clock behind the encode_ns counter, apart from the device code so that the stream and
 * dispatch lists can time themselves without depending on device.c. */
#ifndef DM_CLOCK_H
#define DM_CLOCK_H

#include <stdint.h>

/* Nanoseconds from an arbitrary fixed point: only differences are meaningful. */
uint64_t dm_now_ns(void);

#endif
