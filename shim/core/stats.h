/* Allocation accounting, apart from the device code so that the buffer pool can keep the
 * allocated and peak bytes current without depending on device.c. */
#ifndef DM_STATS_H
#define DM_STATS_H

#include <stdint.h>

#include "../dm_shim.h"

/* Driver memory gained (> 0) or given back (< 0); the peak follows the high-water mark. */
void dm_stats_account_alloc(dm_device *device, int64_t delta_bytes);

#endif
