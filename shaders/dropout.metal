// [dropout] in training: counter-based uniform draws and the dropout itself, as
// dropout.{uniform_fill,dropout_forward_train,dropout_backward}_step of darknet_metal/cpu/.
// No thread reads what another writes, so results never depend on scheduling.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// splitmix64's increment (2^64 / golden ratio) and output function.
constant ulong DM_GAMMA = 0x9E3779B97F4A7C15UL;

static inline ulong dm_mix64(ulong z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9UL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBUL;
    return z ^ (z >> 31);
}

// rand[i] = draw i of (seed, counter): the reference's float32 draws bit for bit, the top 24
// bits of a hash times 2^-24. The counter (a 64-bit value as two words, low first) is only
// read here: uniform_buf_advance_f32 advances it afterwards, since a thread advancing it
// here would race with threads still reading it. Grid: n.
kernel void uniform_buf_f32(constant dm_uniform_args& args [[buffer(0)]],
                            device const uint* counter [[buffer(1)]],
                            device float* rand [[buffer(2)]],
                            uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    const ulong seed = (ulong(args.seed_hi) << 32) | ulong(args.seed_lo);
    const ulong count = (ulong(counter[1]) << 32) | ulong(counter[0]);
    const ulong key = dm_mix64(seed ^ dm_mix64(count + DM_GAMMA));
    const ulong bits = dm_mix64(key + (ulong(gid) + 1UL) * DM_GAMMA);
    rand[gid] = float(uint(bits >> 40)) * 5.9604644775390625e-08f;
}

// counter c += 1 (wrapping at 2^64) for each of `count` counters stored two words apiece.
// Grid: count.
kernel void uniform_buf_advance_f32(constant dm_counter_args& args [[buffer(0)]],
                                    device uint* counter [[buffer(1)]],
                                    uint gid [[thread_position_in_grid]]) {
    if (gid >= args.count) return;
    const uint lo = counter[2 * gid] + 1u;
    counter[2 * gid] = lo;
    if (lo == 0u) counter[2 * gid + 1] = counter[2 * gid + 1] + 1u;
}

// Darknet's dropout on x in place with the kept draws: 0 where rand < probability, else
// x*scale. Forward (training) on the layer's input, backward on its delta. Grid: n.
kernel void dropout_fwd_train_f32(constant dm_dropout_args& args [[buffer(0)]],
                                  device const float* rand [[buffer(1)]],
                                  device float* x [[buffer(2)]],
                                  uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    x[gid] = rand[gid] < args.probability ? 0.0f : x[gid] * args.scale;
}

kernel void dropout_bwd_f32(constant dm_dropout_args& args [[buffer(0)]],
                            device const float* rand [[buffer(1)]],
                            device float* delta [[buffer(2)]],
                            uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    delta[gid] = rand[gid] < args.probability ? 0.0f : delta[gid] * args.scale;
}
