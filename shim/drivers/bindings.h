/* What a dispatch must bind for a kernel of the translated table (emu_kernel_info, written by
 * the .metal translator): every [[buffer(i)]] the kernel reads and a length for every
 * [[threadgroup(i)]] it takes. Checked by the drivers whose kernels come from that table
 * (the emulator's and CUDA's), where the host can still be told which call was wrong. */
#ifndef DM_BINDINGS_H
#define DM_BINDINGS_H

#include "../emu/emu_abi.h"
#include "driver.h"

#ifdef __cplusplus
extern "C" {
#endif

int dm_check_kernel_bindings(const emu_kernel_info *kernel, const dm_driver_dispatch *d);

#ifdef __cplusplus
}
#endif
#endif
