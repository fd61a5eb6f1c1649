/* Device lifetime, facts and settings. */
#include <stdlib.h>
#include <string.h>

#include "core.h"

static const dm_driver *driver_of(int kind) {
    if (kind == DM_DEVICE_EMU) return dm_emu_driver();
    if (kind == DM_DEVICE_CUDA) return dm_cuda_driver();
#if defined(DM_HAVE_METAL)
    if (kind == DM_DEVICE_METAL) return dm_metal_driver();
#endif
    return NULL;
}

/* DARKNET_METAL_EMU_ORDER = forward | reverse | random | random:SEED. A value that cannot be
 * read fails device creation rather than silently testing in the wrong order. */
static int apply_order_from_environment(dm_device *device) {
    const char *value = getenv("DARKNET_METAL_EMU_ORDER");
    if (value == NULL || value[0] == '\0') return DM_OK;
    uint64_t seed = 0;
    int order;
    if (strcmp(value, "forward") == 0) {
        order = DM_ORDER_FORWARD;
    } else if (strcmp(value, "reverse") == 0) {
        order = DM_ORDER_REVERSE;
    } else if (strncmp(value, "random", 6) == 0 && (value[6] == '\0' || value[6] == ':')) {
        order = DM_ORDER_RANDOM;
        if (value[6] == ':') {
            char *end = NULL;
            seed = strtoull(value + 7, &end, 10);
            if (value[7] == '\0' || end == NULL || *end != '\0')
                return dm_set_error(DM_ERR_INVALID,
                                    "DARKNET_METAL_EMU_ORDER='%s': the seed after 'random:' "
                                    "must be a decimal integer",
                                    value);
        }
    } else {
        return dm_set_error(DM_ERR_INVALID,
                            "DARKNET_METAL_EMU_ORDER='%s': expected forward, reverse, random "
                            "or random:SEED",
                            value);
    }
    return dm_device_set_thread_order(device, order, seed);
}

int dm_device_available(int kind) {
    const dm_driver *driver = driver_of(kind);
    if (driver == NULL) {
        dm_set_error(DM_ERR_UNAVAILABLE, "device kind %d is not compiled into this build", kind);
        return 0;
    }
    return driver->probe == NULL || driver->probe() == DM_OK;
}

int dm_device_create(int kind, const dm_device_options *options, dm_device **out) {
    if (out == NULL) return dm_set_error(DM_ERR_INVALID, "dm_device_create: out is NULL");
    *out = NULL;
    if (kind != DM_DEVICE_EMU && kind != DM_DEVICE_METAL && kind != DM_DEVICE_CUDA)
        return dm_set_error(DM_ERR_INVALID, "unknown device kind %d", kind);
    const dm_driver *driver = driver_of(kind);
    if (driver == NULL)
        return dm_set_error(DM_ERR_UNAVAILABLE,
                            "the Metal driver is not built into this extension "
                            "(Metal needs macOS; use the emulator device 'emu' elsewhere)");
    dm_device_options defaults;
    memset(&defaults, 0, sizeof defaults);
    dm_device *device = calloc(1, sizeof *device);
    if (device == NULL) return dm_set_error(DM_ERR_RESOURCE, "out of memory creating a device");
    device->driver = driver;
    device->kind = kind;
    device->next_seq = 1;
    device->order = DM_ORDER_FORWARD;
    int rc = driver->device_create(options ? options : &defaults, &device->handle,
                                   &device->facts);
    if (rc != DM_OK) {
        free(device);
        return rc;
    }
    if (kind == DM_DEVICE_EMU) {
        rc = apply_order_from_environment(device);
        if (rc != DM_OK) {
            dm_device_destroy(device);
            return rc;
        }
    }
    *out = device;
    return DM_OK;
}

void dm_device_destroy(dm_device *device) {
    if (device == NULL) return;
    /* Errors of work nobody will read are dropped on purpose: destruction cannot fail. */
    (void)dm_device_synchronize(device);
    if (device->open_command) {
        device->driver->discard(device->handle, device->open_command);
        device->open_command = NULL;
    }
    dm_dispatch_lists_detach(device);
    dm_buffers_free_all(device);
    dm_pipelines_free(device);
    dm_profile_free(device);
    device->driver->device_destroy(device->handle);
    free(device);
}

int dm_device_get_info(dm_device *device, dm_device_info *out) {
    if (device == NULL || out == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_device_get_info: NULL argument");
    memset(out, 0, sizeof *out);
    memcpy(out->name, device->facts.name, sizeof out->name);
    out->name[sizeof out->name - 1] = '\0';
    out->kind = device->kind;
    out->unified_memory = device->facts.unified_memory;
    out->recommended_working_set = device->facts.recommended_working_set;
    out->max_threads_per_threadgroup = device->facts.max_threads_per_threadgroup;
    out->max_threadgroup_memory = device->facts.max_threadgroup_memory;
    out->apple7 = device->facts.apple7;
    out->simdgroup_matrix = device->facts.simdgroup_matrix;
    out->page_size = device->facts.page_size;
    return DM_OK;
}

int dm_device_set_commit_every(dm_device *device, uint32_t n) {
    if (device == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_device_set_commit_every: NULL device");
    device->commit_every = n;
    return DM_OK;
}

int dm_device_set_thread_order(dm_device *device, int order, uint64_t seed) {
    if (device == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_device_set_thread_order: NULL device");
    if (order != DM_ORDER_FORWARD && order != DM_ORDER_REVERSE && order != DM_ORDER_RANDOM)
        return dm_set_error(DM_ERR_INVALID, "unknown thread order %d", order);
    if (device->driver->set_thread_order == NULL)
        return dm_set_error(DM_ERR_UNSUPPORTED,
                            "the %s driver cannot choose the thread order (the GPU does)",
                            device->driver->name);
    int rc = device->driver->set_thread_order(device->handle, order, seed);
    if (rc == DM_OK) {
        device->order = order;
        device->seed = seed;
    }
    return rc;
}

int dm_device_get_thread_order(dm_device *device, int *order, uint64_t *seed) {
    if (device == NULL || order == NULL || seed == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_device_get_thread_order: NULL argument");
    *order = device->order;
    *seed = device->seed;
    return DM_OK;
}
