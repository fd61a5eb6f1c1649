/* One dispatch as the CUDA entry points of the translated kernels receive it, by value.
 * Shared by the driver (shim/drivers/cuda_driver.cpp), which fills it, and the prelude of
 * the kernels (metal_cuda.h), which reads it: one declaration, one layout. */
#ifndef DM_DMC_LAUNCH_H
#define DM_DMC_LAUNCH_H

#include <stdint.h>

#define DMC_MAX_BUFFERS 31 /* Metal's argument table */
#define DMC_MAX_TG_ARGS 8

/* dmc_launch.order of a launch whose blocks form the threadgroups' own 3-D grid. */
#define DMC_ORDER_GRID 3u

typedef struct dmc_launch {
    void *buffers[DMC_MAX_BUFFERS];      /* device addresses by [[buffer(i)]], offsets applied */
    uint32_t tg_offset[DMC_MAX_TG_ARGS]; /* byte offsets of [[threadgroup(i)]] in dynamic memory */
    uint32_t tpg[3];   /* threads per grid */
    uint32_t dtptg[3]; /* threads per threadgroup, as requested */
    uint32_t tgpg[3];  /* threadgroups per grid; the launch has their product as blocks */
    uint32_t order;    /* group order: 0 forward, 1 reverse, 2 a seeded permutation (blocks in
                        * one row), DMC_ORDER_GRID forward with blocks in the groups' 3-D grid */
    uint32_t stride;   /* order 2: group g runs as (offset + stride * g) mod groups */
    uint32_t offset;
} dmc_launch;

#endif
