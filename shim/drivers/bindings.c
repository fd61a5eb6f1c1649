/* Binding checks shared by the drivers built from the translated kernel table. */
#include "bindings.h"

int dm_check_kernel_bindings(const emu_kernel_info *kernel, const dm_driver_dispatch *d) {
    for (int i = 0; i < EMU_MAX_BUFFERS; i++) {
        int bound = (i == 0 && d->args_size > 0) || (i < d->n_indices && d->buffers[i]);
        if ((kernel->buffer_mask >> i & 1u) && !bound)
            return dm_set_error(DM_ERR_INVALID,
                                "kernel '%s' (%s:%d) reads [[buffer(%d)]] but nothing is bound "
                                "at index %d",
                                kernel->name, kernel->file, kernel->line, i, i);
    }
    for (int i = 0; i < EMU_MAX_TG_ARGS; i++) {
        if ((kernel->tg_arg_mask >> i & 1u) && (i >= d->n_tg_memory || d->tg_memory[i] == 0))
            return dm_set_error(DM_ERR_INVALID,
                                "kernel '%s' (%s:%d) takes [[threadgroup(%d)]] memory but no "
                                "length was set",
                                kernel->name, kernel->file, kernel->line, i);
    }
    return DM_OK;
}
