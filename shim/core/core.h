/* Private structures of the portable core and the functions its translation units call in
 * one another, grouped by the file that defines them. The clock and the allocation
 * accounting have their own headers (clock.h, stats.h). */
#ifndef DM_CORE_H
#define DM_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "../dm_shim.h"
#include "../drivers/driver.h"

#define DM_POOL_CLASSES 256   /* size-class slots: 4 per power of two from 2^8 */
#define DM_PIPELINE_BUCKETS 64
#define DM_MAX_IN_FLIGHT 32   /* committed command buffers before the oldest is waited for */

struct dm_buffer {
    dm_device *device;
    void *handle;   /* driver buffer */
    void *contents; /* host pointer */
    size_t size;     /* requested bytes */
    size_t capacity; /* size class (or exact size when wrapped) */
    int wrapped;
    int live;          /* handed out, not released */
    /* Dispatch lists naming it: a released buffer waits for 0 before pooling. */
    uint32_t dispatch_list_refs;
    uint64_t last_use; /* sequence number of the last command buffer that bound it */
    dm_buffer *next_free;            /* pool free list of its class */
    dm_buffer *prev_all, *next_all;  /* every buffer the device owns */
};

struct dm_pipeline {
    dm_device *device;
    char *name;
    void *handle;
    dm_driver_pipeline_facts facts;
    dm_pipeline *next; /* hash chain */
};

typedef struct dm_in_flight {
    void *command;
    uint64_t seq;
} dm_in_flight;

struct dm_device {
    const dm_driver *driver;
    void *handle;
    int kind;
    dm_driver_facts facts;
    int order;
    uint64_t seed;

    dm_buffer *all;                       /* list of every buffer */
    dm_buffer *pool[DM_POOL_CLASSES];     /* released buffers by class index */
    dm_pipeline *pipelines[DM_PIPELINE_BUCKETS];

    /* Command stream: sequence numbers start at 1; 0 means "never used". */
    void *open_command;
    uint64_t open_seq;
    uint32_t open_dispatches;
    uint32_t commit_every;
    uint64_t next_seq;
    uint64_t completed_seq;
    dm_in_flight in_flight[DM_MAX_IN_FLIGHT];
    int n_in_flight;

    /* Every dispatch list made on this device (detached when it is destroyed). */
    dm_dispatch_list *dispatch_lists;

    dm_stats stats;
    /* The driver's copy totals when the counters were last reset. */
    uint64_t copies_base, copy_bytes_base;

    /* Profiling (profile.c): the kernel of each dispatch encoded since dm_profile_begin. */
    int profiling;
    dm_profile_record *profile;
    uint64_t *profile_ns;
    size_t n_profile, cap_profile;
};

/* pool.c */
/* Class index of a class size returned by dm_size_class, or -1 beyond the table. */
int dm_size_class_index(size_t class_size);
/* Ends a release deferred while dispatch lists named the buffer: stats, then the pool (or
 * freed). */
void dm_buffer_finish_release(dm_buffer *buffer);
/* Frees every buffer (live or pooled) after all work completed. */
void dm_buffers_free_all(dm_device *device);

/* pipeline.c */
/* Frees every cached pipeline. */
void dm_pipelines_free(dm_device *device);

/* dispatch_check.c */
/* dm_dispatch's checks; fills the driver's form of the dispatch (args not copied). */
int dm_check_dispatch(dm_device *device, dm_pipeline *pipeline, const dm_dispatch_desc *desc,
                      dm_driver_dispatch *out);

/* stream.c */
/* Commits the open command buffer if any (does not count a wait). */
int dm_stream_commit(dm_device *device);
/* Makes work up to `seq` complete: commits the open command buffer if it is `seq`, then
 * waits for in-flight command buffers with a sequence number <= seq (counts one wait). */
int dm_stream_wait_for(dm_device *device, uint64_t seq);
/* Opens a command buffer if none is open. */
int dm_stream_open(dm_device *device);
/* Notes `n` dispatches just encoded while profiling: their pipelines and tags. */
int dm_profile_note(dm_device *device, dm_pipeline *const *pipelines, const uint64_t *tags,
                    int n);

/* dispatch_list.c */
/* Detaches every dispatch list of a device being destroyed (they can then only be
 * destroyed). */
void dm_dispatch_lists_detach(dm_device *device);

/* profile.c */
void dm_profile_free(dm_device *device);

#endif
