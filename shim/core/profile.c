/* Profiling: which kernel each dispatch ran, and its device time from the driver. */
#include <stdlib.h>
#include <string.h>

#include "core.h"

int dm_profile_active(const dm_device *device) { return device != NULL && device->profiling; }

int dm_profile_begin(dm_device *device) {
    if (device == NULL) return dm_set_error(DM_ERR_INVALID, "dm_profile_begin: NULL device");
    if (device->driver->profile_start == NULL || device->driver->profile_stop == NULL)
        return dm_set_error(DM_ERR_UNSUPPORTED, "the %s driver cannot time dispatches",
                            device->driver->name);
    if (device->profiling)
        return dm_set_error(DM_ERR_INVALID, "a profile is already being taken on this device");
    /* Work encoded before the profile is not part of it. */
    int rc = dm_device_synchronize(device);
    if (rc != DM_OK) return rc;
    rc = device->driver->profile_start(device->handle);
    if (rc != DM_OK) return rc;
    device->n_profile = 0;
    device->profiling = 1;
    return DM_OK;
}

int dm_profile_end(dm_device *device, const dm_profile_record **records, size_t *n,
                   dm_profile_copies *copies) {
    if (device == NULL || records == NULL || n == NULL || copies == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_profile_end: NULL argument");
    if (!device->profiling)
        return dm_set_error(DM_ERR_INVALID, "dm_profile_end without dm_profile_begin");
    memset(copies, 0, sizeof *copies);
    *records = NULL;
    *n = 0;
    int rc = dm_device_synchronize(device);
    size_t got = 0;
    /* Timing stops even when the work failed, so the device can be profiled again. */
    int src = device->driver->profile_stop(device->handle, device->profile_ns,
                                           device->n_profile, &got, copies);
    device->profiling = 0;
    if (rc != DM_OK) return rc;
    if (src != DM_OK) return src;
    if (got != device->n_profile)
        return dm_set_error(DM_ERR_EXECUTION,
                            "the %s driver timed %zu dispatches of the %zu encoded while "
                            "profiling",
                            device->driver->name, got, device->n_profile);
    for (size_t i = 0; i < got; i++) device->profile[i].device_ns = device->profile_ns[i];
    *records = device->profile;
    *n = got;
    return DM_OK;
}

void dm_profile_free(dm_device *device) {
    free(device->profile);
    free(device->profile_ns);
    device->profile = NULL;
    device->profile_ns = NULL;
    device->n_profile = device->cap_profile = 0;
}
