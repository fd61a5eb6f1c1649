/* Pipeline cache. Building a pipeline can mean compiling the shader library (Metal), so each
 * kernel is built once per device and looked up by name afterwards. */
#include <stdlib.h>
#include <string.h>

#include "core.h"

static unsigned hash_name(const char *s) {
    unsigned h = 2166136261u; /* FNV-1a */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 16777619u;
    return h % DM_PIPELINE_BUCKETS;
}

int dm_pipeline_get(dm_device *device, const char *name, dm_pipeline **out) {
    if (device == NULL || name == NULL || out == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_pipeline_get: NULL argument");
    *out = NULL;
    if (name[0] == '\0') return dm_set_error(DM_ERR_INVALID, "empty kernel name");
    unsigned bucket = hash_name(name);
    for (dm_pipeline *p = device->pipelines[bucket]; p; p = p->next) {
        if (strcmp(p->name, name) == 0) {
            *out = p;
            return DM_OK;
        }
    }
    dm_pipeline *p = calloc(1, sizeof *p);
    char *copy = malloc(strlen(name) + 1);
    if (p == NULL || copy == NULL) {
        free(p);
        free(copy);
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    }
    strcpy(copy, name);
    int rc = device->driver->pipeline_create(device->handle, name, &p->handle, &p->facts);
    if (rc != DM_OK) {
        free(p);
        free(copy);
        return rc;
    }
    if (p->facts.max_total_threads == 0) p->facts.max_total_threads = 1;
    p->device = device;
    p->name = copy;
    p->next = device->pipelines[bucket];
    device->pipelines[bucket] = p;
    device->stats.pipelines_built++;
    *out = p;
    return DM_OK;
}

void dm_pipelines_free(dm_device *device) {
    for (int i = 0; i < DM_PIPELINE_BUCKETS; i++) {
        dm_pipeline *p = device->pipelines[i];
        while (p) {
            dm_pipeline *next = p->next;
            device->driver->pipeline_free(device->handle, p->handle);
            free(p->name);
            free(p);
            p = next;
        }
        device->pipelines[i] = NULL;
    }
}

uint32_t dm_pipeline_max_threads(const dm_pipeline *p) { return p ? p->facts.max_total_threads : 0; }
uint32_t dm_pipeline_execution_width(const dm_pipeline *p) {
    return p ? p->facts.execution_width : 0;
}
uint32_t dm_pipeline_static_tg_memory(const dm_pipeline *p) {
    return p ? p->facts.static_tg_memory : 0;
}
const char *dm_pipeline_name(const dm_pipeline *p) { return p ? p->name : ""; }
