// [route]: concatenation along channels, one dispatch per source layer, forward and
// backward. With groups/group_id the host passes the channel slice [group_id*C/groups,
// (group_id+1)*C/groups) of the source as src_offset/channels; dst_offset is where that part
// starts in the output.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// Grid (spatial, channels, batch).
template <typename T>
kernel void route_fwd(constant dm_route_args& args [[buffer(0)]],
                      device const T* x [[buffer(1)]],
                      device T* y [[buffer(2)]],
                      uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.channels || gid.z >= args.batch) return;
    const uint src = (gid.z * args.src_channels + args.src_offset + gid.y) * args.spatial + gid.x;
    const uint dst = (gid.z * args.dst_channels + args.dst_offset + gid.y) * args.spatial + gid.x;
    y[dst] = x[src];
}

typedef decltype(route_fwd<float>) route_fwd_f32_t;
typedef decltype(route_fwd<half>) route_fwd_f16_t;
template [[host_name("route_fwd_f32")]] kernel route_fwd_f32_t route_fwd<float>;
template [[host_name("route_fwd_f16")]] kernel route_fwd_f16_t route_fwd<half>;

// ---- backward ------------------------------------------------------------------------------

// x_grad[b, src_offset + c] += delta[b, dst_offset + c] (or = when not accumulate):
// route_fwd_f32's arguments, one dispatch per routed layer. Grid (spatial, channels, batch).
kernel void route_bwd_f32(constant dm_route_args& args [[buffer(0)]],
                          device const float* delta [[buffer(1)]],
                          device float* x_grad [[buffer(2)]],
                          uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.channels || gid.z >= args.batch) return;
    const uint src = (gid.z * args.src_channels + args.src_offset + gid.y) * args.spatial + gid.x;
    const uint dst = (gid.z * args.dst_channels + args.dst_offset + gid.y) * args.spatial + gid.x;
    x_grad[src] = (args.accumulate != 0u ? x_grad[src] : 0.0f) + delta[dst];
}
