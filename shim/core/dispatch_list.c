/* Prepared dispatch lists: checked and copied once, encoded together many times. */
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "core.h"

struct dm_dispatch_list {
    dm_device *device; /* NULL once the device was destroyed */
    dm_dispatch_list *prev, *next;

    dm_driver_item *items;
    dm_pipeline **pipelines; /* per item, for messages */
    uint64_t *tags;          /* per item, for profiles */
    void **args;             /* per item: owned copy of the argument bytes (or NULL) */
    int *ref_end;            /* per item: end of its buffers in `refs` */
    int n, cap;

    dm_buffer **refs; /* buffers bound by each item, item after item */
    int n_refs, cap_refs;

    dm_buffer **held; /* distinct buffers, each counted once in its dispatch_list_refs */
    int n_held, cap_held;
    void *driver_cache; /* what the driver keeps of the whole list (encode_list), or NULL */
};

/* Lets the driver drop what it kept of the list (the list changed or goes away). */
static void drop_cache(dm_dispatch_list *list) {
    if (list->driver_cache && list->device && list->device->driver->list_free)
        list->device->driver->list_free(list->device->handle, list->driver_cache);
    list->driver_cache = NULL;
}

static int grow(void **array, int *cap, int need, size_t item) {
    if (need <= *cap) return DM_OK;
    int next = *cap > 0 ? *cap : 16;
    while (next < need) next *= 2;
    void *p = realloc(*array, (size_t)next * item);
    if (p == NULL)
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory growing a dispatch list");
    *array = p;
    *cap = next;
    return DM_OK;
}

static int grow_items(dm_dispatch_list *list, int need) {
    if (need <= list->cap) return DM_OK;
    int cap = list->cap > 0 ? list->cap : 16;
    while (cap < need) cap *= 2;
    /* Arrays already grown stay grown if a later one fails: harmless, cap is unchanged. */
    void *p = realloc(list->items, (size_t)cap * sizeof *list->items);
    if (p == NULL) goto fail;
    list->items = p;
    p = realloc(list->pipelines, (size_t)cap * sizeof *list->pipelines);
    if (p == NULL) goto fail;
    list->pipelines = p;
    p = realloc(list->tags, (size_t)cap * sizeof *list->tags);
    if (p == NULL) goto fail;
    list->tags = p;
    p = realloc(list->args, (size_t)cap * sizeof *list->args);
    if (p == NULL) goto fail;
    list->args = p;
    p = realloc(list->ref_end, (size_t)cap * sizeof *list->ref_end);
    if (p == NULL) goto fail;
    list->ref_end = p;
    list->cap = cap;
    return DM_OK;
fail:
    return dm_set_error(DM_ERR_RESOURCE, "out of host memory growing a dispatch list");
}

int dm_dispatch_list_create(dm_device *device, int capacity, dm_dispatch_list **out) {
    if (device == NULL || out == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_dispatch_list_create: NULL argument");
    *out = NULL;
    if (capacity < 0)
        return dm_set_error(DM_ERR_INVALID, "dm_dispatch_list_create: negative capacity %d",
                            capacity);
    dm_dispatch_list *list = calloc(1, sizeof *list);
    if (list == NULL)
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory creating a dispatch list");
    if (capacity > 0 && grow_items(list, capacity) != DM_OK) {
        dm_dispatch_list_destroy(list);
        return DM_ERR_RESOURCE;
    }
    list->device = device;
    list->next = device->dispatch_lists;
    if (device->dispatch_lists) device->dispatch_lists->prev = list;
    device->dispatch_lists = list;
    *out = list;
    return DM_OK;
}

int dm_dispatch_list_size(const dm_dispatch_list *list) { return list ? list->n : 0; }

/* Holds `b` for the dispatch list (once per distinct buffer). */
static int hold(dm_dispatch_list *list, dm_buffer *b) {
    for (int i = 0; i < list->n_held; i++)
        if (list->held[i] == b) return DM_OK;
    int rc = grow((void **)&list->held, &list->cap_held, list->n_held + 1, sizeof *list->held);
    if (rc != DM_OK) return rc;
    list->held[list->n_held++] = b;
    b->dispatch_list_refs++;
    return DM_OK;
}

int dm_dispatch_list_add(dm_dispatch_list *list, dm_pipeline *pipeline,
                         const dm_dispatch_desc *desc) {
    if (list == NULL || pipeline == NULL || desc == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_dispatch_list_add: NULL argument");
    dm_device *device = list->device;
    if (device == NULL)
        return dm_set_error(DM_ERR_INVALID,
                            "dm_dispatch_list_add: the dispatch list's device was destroyed");
    if (pipeline->device != device)
        return dm_set_error(DM_ERR_INVALID, "kernel '%s': pipeline of another device",
                            pipeline->name);
    dm_driver_dispatch d;
    int rc = dm_check_dispatch(device, pipeline, desc, &d);
    if (rc != DM_OK) return rc;
    rc = grow_items(list, list->n + 1);
    if (rc != DM_OK) return rc;
    drop_cache(list);
    rc = grow((void **)&list->refs, &list->cap_refs, list->n_refs + desc->n_buffers,
              sizeof *list->refs);
    if (rc != DM_OK) return rc;
    void *args = NULL;
    if (d.args_size > 0) {
        args = malloc(d.args_size);
        if (args == NULL) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
        memcpy(args, d.args, d.args_size);
        d.args = args;
    }
    /* Hold every buffer before publishing the item; on failure undo what this call held. */
    int held_before = list->n_held;
    int n_refs = list->n_refs;
    for (int i = 0; i < desc->n_buffers; i++) {
        dm_buffer *b = desc->buffers[i];
        if (b == NULL) continue;
        rc = hold(list, b);
        if (rc != DM_OK) {
            while (list->n_held > held_before) list->held[--list->n_held]->dispatch_list_refs--;
            free(args);
            return rc;
        }
        list->refs[n_refs++] = b;
    }
    list->n_refs = n_refs;
    list->items[list->n].pipeline = pipeline->handle;
    list->items[list->n].dispatch = d;
    list->pipelines[list->n] = pipeline;
    list->tags[list->n] = desc->tag;
    list->args[list->n] = args;
    list->ref_end[list->n] = n_refs;
    list->n++;
    return DM_OK;
}

/* The first item binding `b`, for the message of a failed encode. */
static int first_use(const dm_dispatch_list *list, const dm_buffer *b) {
    int item = 0;
    for (int r = 0; r < list->n_refs; r++) {
        while (list->ref_end[item] <= r) item++;
        if (list->refs[r] == b) return item;
    }
    return 0;
}

static int encode_items(dm_device *device, dm_dispatch_list *list, int first, int n, int *n_done) {
    const dm_driver *driver = device->driver;
    if (driver->encode_list && first == 0 && n == list->n) {
        return driver->encode_list(device->handle, device->open_command, list->items, n,
                                   &list->driver_cache, n_done);
    }
    if (driver->encode_batch)
        return driver->encode_batch(device->handle, device->open_command, list->items + first, n,
                                    n_done);
    for (int i = 0; i < n; i++) {
        const dm_driver_item *item = &list->items[first + i];
        int rc = driver->encode(device->handle, device->open_command, item->pipeline,
                                &item->dispatch);
        if (rc != DM_OK) {
            *n_done = i;
            return rc;
        }
    }
    *n_done = n;
    return DM_OK;
}

int dm_dispatch_list_encode(dm_device *device, dm_dispatch_list *list) {
    if (device == NULL || list == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_dispatch_list_encode: NULL argument");
    if (list->device == NULL)
        return dm_set_error(DM_ERR_INVALID,
                            "dm_dispatch_list_encode: the dispatch list's device was destroyed");
    if (list->device != device)
        return dm_set_error(DM_ERR_INVALID,
                            "dm_dispatch_list_encode: the dispatch list belongs to another "
                            "device");
    /* Refuse before encoding anything, so a stale dispatch list leaves the command buffer as
     * it was. */
    for (int i = 0; i < list->n_held; i++) {
        dm_buffer *b = list->held[i];
        if (!b->live) {
            int item = first_use(list, b);
            return dm_set_error(DM_ERR_INVALID,
                                "dispatch list of %d dispatches: a buffer of dispatch %d "
                                "(kernel '%s') was released",
                                list->n, item + 1, list->pipelines[item]->name);
        }
    }
    uint64_t start = dm_now_ns();
    int rc = DM_OK;
    int i = 0;
    while (i < list->n && rc == DM_OK) {
        rc = dm_stream_open(device);
        if (rc != DM_OK) break;
        int chunk = list->n - i;
        if (device->commit_every) {
            /* Split where n separate dispatches would have committed. */
            uint32_t room = device->commit_every > device->open_dispatches
                                ? device->commit_every - device->open_dispatches
                                : 1;
            if ((uint32_t)chunk > room) chunk = (int)room;
        }
        int done = 0;
        rc = encode_items(device, list, i, chunk, &done);
        int r0 = i > 0 ? list->ref_end[i - 1] : 0;
        int r1 = done > 0 ? list->ref_end[i + done - 1] : r0;
        for (int r = r0; r < r1; r++) list->refs[r]->last_use = device->open_seq;
        device->open_dispatches += (uint32_t)done;
        int prc = dm_profile_note(device, list->pipelines + i, list->tags + i, done);
        if (rc == DM_OK) rc = prc;
        device->stats.kernels_dispatched += (uint64_t)done;
        i += done;
        if (rc == DM_OK && device->commit_every &&
            device->open_dispatches >= device->commit_every)
            rc = dm_stream_commit(device);
    }
    device->stats.encode_ns += dm_now_ns() - start;
    return rc;
}

void dm_dispatch_list_destroy(dm_dispatch_list *list) {
    if (list == NULL) return;
    dm_device *device = list->device;
    drop_cache(list);
    if (device != NULL) {
        if (list->prev) list->prev->next = list->next;
        else device->dispatch_lists = list->next;
        if (list->next) list->next->prev = list->prev;
        for (int i = 0; i < list->n_held; i++) {
            dm_buffer *b = list->held[i];
            if (--b->dispatch_list_refs == 0 && !b->live) dm_buffer_finish_release(b);
        }
    }
    for (int i = 0; i < list->n; i++) free(list->args[i]);
    free(list->items);
    free(list->pipelines);
    free(list->tags);
    free(list->args);
    free(list->ref_end);
    free(list->refs);
    free(list->held);
    free(list);
}

void dm_dispatch_lists_detach(dm_device *device) {
    for (dm_dispatch_list *p = device->dispatch_lists; p; p = p->next) {
        drop_cache(p);
        p->device = NULL;
    }
    device->dispatch_lists = NULL;
}
