// Driver over Apple's Metal (macOS, ARC). Built only on macOS; on every other machine it is
// type-checked against the stub headers in shim/stubs (see .ci/run).
//
// Objects cross into the C core as `void *` with bridged casts: __bridge_retained when a
// handle is created (the core owns one reference), __bridge_transfer when it is freed, plain
// __bridge to use it.
//
// Kernels come from a precompiled .metallib when the build made one, else from the .metal
// sources the host passed (includes already inlined), compiled on the first pipeline request.
// One compute encoder stays open per command buffer; Metal's hazard tracking of shared
// buffers orders its dispatches. While profiling, each dispatch has an encoder of its own
// whose start and end timestamps are sampled into a counter sample buffer (Apple GPUs sample
// at stage boundaries only, not between dispatches of one encoder).
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include "driver.h"

@interface DMMetalDevice : NSObject
@property(nonatomic, strong) id<MTLDevice> device;
@property(nonatomic, strong) id<MTLCommandQueue> queue;
@property(nonatomic, copy) NSString *metallibPath;
@property(nonatomic, strong) NSMutableArray<NSString *> *sources;
@property(nonatomic, strong) NSMutableArray<NSString *> *sourceNames;
@property(nonatomic, strong) NSMutableArray<id<MTLLibrary>> *libraries;
@property(nonatomic) BOOL librariesLoaded;
@property(nonatomic) BOOL profiling;
@property(nonatomic, strong) NSMutableArray<id<MTLCounterSampleBuffer>> *sampleBuffers;
@property(nonatomic) NSUInteger timedCount;
@property(nonatomic) MTLTimestamp cpuStart;
@property(nonatomic) MTLTimestamp gpuStart;
@end

@implementation DMMetalDevice
@end

@interface DMMetalCommand : NSObject
@property(nonatomic, strong) id<MTLCommandBuffer> buffer;
@property(nonatomic, strong) id<MTLComputeCommandEncoder> encoder;
@end

@implementation DMMetalCommand
@end

static const char *describe(NSError *error) {
    if (error == nil) return "unknown error";
    const char *text = error.localizedDescription.UTF8String;
    return text ? text : "unknown error";
}

static void copy_text(char *dst, size_t capacity, const char *src) {
    size_t i = 0;
    for (; i + 1 < capacity && src[i] != '\0'; i++) dst[i] = src[i];
    dst[i] = '\0';
}

static int metal_device_create(const dm_device_options *options, void **out,
                               dm_driver_facts *facts) {
    @autoreleasepool {
        id<MTLDevice> mtl = MTLCreateSystemDefaultDevice();
        if (mtl == nil) return dm_set_error(DM_ERR_UNAVAILABLE, "no Metal device on this Mac");
        id<MTLCommandQueue> queue = [mtl newCommandQueue];
        if (queue == nil) return dm_set_error(DM_ERR_RESOURCE, "Metal: cannot create a command queue");
        DMMetalDevice *device = [DMMetalDevice new];
        device.device = mtl;
        device.queue = queue;
        device.sources = [NSMutableArray array];
        device.sourceNames = [NSMutableArray array];
        device.libraries = [NSMutableArray array];
        if (options->metallib_path)
            device.metallibPath = [NSString stringWithUTF8String:options->metallib_path];
        for (int i = 0; i < options->n_sources; i++) {
            NSString *text = [NSString stringWithUTF8String:options->sources[i]];
            const char *name = options->source_names ? options->source_names[i] : "<source>";
            NSString *label = [NSString stringWithUTF8String:name];
            if (text == nil || label == nil)
                return dm_set_error(DM_ERR_INVALID, "Metal: shader source %d is not UTF-8", i);
            [device.sources addObject:text];
            [device.sourceNames addObject:label];
        }

        const char *name = mtl.name.UTF8String;
        copy_text(facts->name, sizeof facts->name, name ? name : "Metal device");
        facts->unified_memory = mtl.hasUnifiedMemory ? 1 : 0;
        facts->recommended_working_set = mtl.recommendedMaxWorkingSetSize;
        MTLSize max_threads = mtl.maxThreadsPerThreadgroup;
        facts->max_threads_per_threadgroup = (uint32_t)max_threads.width;
        facts->max_threadgroup_memory = (uint32_t)mtl.maxThreadgroupMemoryLength;
        facts->apple7 = [mtl supportsFamily:MTLGPUFamilyApple7] ? 1 : 0;
        facts->simdgroup_matrix = facts->apple7;
        facts->page_size = (uint32_t)NSPageSize();
        *out = (__bridge_retained void *)device;
        return DM_OK;
    }
}

static void metal_device_destroy(void *handle) {
    @autoreleasepool {
        DMMetalDevice *device = (__bridge_transfer DMMetalDevice *)handle;
        device.libraries = nil;
    }
}

static int metal_buffer_alloc(void *handle, size_t nbytes, void **out, void **contents) {
    @autoreleasepool {
        DMMetalDevice *device = (__bridge DMMetalDevice *)handle;
        id<MTLBuffer> buffer = [device.device newBufferWithLength:nbytes
                                                          options:MTLResourceStorageModeShared];
        if (buffer == nil)
            return dm_set_error(DM_ERR_RESOURCE, "Metal: cannot allocate a buffer of %zu bytes",
                                nbytes);
        *contents = [buffer contents];
        *out = (__bridge_retained void *)buffer;
        return DM_OK;
    }
}

static int metal_buffer_wrap(void *handle, void *host, size_t nbytes, void **out) {
    @autoreleasepool {
        DMMetalDevice *device = (__bridge DMMetalDevice *)handle;
        // Metal maps whole pages; the page holding the end of the array is mapped already.
        NSUInteger page = NSPageSize();
        NSUInteger length = (nbytes + page - 1) / page * page;
        id<MTLBuffer> buffer = [device.device newBufferWithBytesNoCopy:host
                                                                length:length
                                                               options:MTLResourceStorageModeShared
                                                           deallocator:nil];
        if (buffer == nil)
            return dm_set_error(DM_ERR_RESOURCE,
                                "Metal: cannot wrap %zu bytes of host memory at %p", nbytes, host);
        *out = (__bridge_retained void *)buffer;
        return DM_OK;
    }
}

static void metal_buffer_free(void *device, void *buffer) {
    (void)device;
    @autoreleasepool {
        (void)(__bridge_transfer id<MTLBuffer>)buffer; // drops the core's reference
    }
}

static int load_libraries(DMMetalDevice *device) {
    if (device.librariesLoaded) return DM_OK;
    NSError *error = nil;
    if (device.metallibPath != nil) {
        NSURL *url = [NSURL fileURLWithPath:device.metallibPath];
        id<MTLLibrary> library = [device.device newLibraryWithURL:url error:&error];
        if (library != nil) {
            [device.libraries addObject:library];
            device.librariesLoaded = YES;
            return DM_OK;
        }
        if (device.sources.count == 0)
            return dm_set_error(DM_ERR_COMPILE, "Metal: cannot load %s: %s",
                                device.metallibPath.UTF8String, describe(error));
    }
    if (device.sources.count == 0)
        return dm_set_error(DM_ERR_COMPILE,
                            "Metal: no kernels (no .metallib and no .metal sources installed)");
    MTLCompileOptions *options = [MTLCompileOptions new];
    // Fast math (Metal's default) assumes no NaN or infinity, reassociates sums and swaps in
    // approximate exp/log: results would leave the CPU reference, and the NaN guards of
    // training would compile away (what drives Darknet's -Ofast CPU training to NaN).
    // mathMode is declared by the macOS 15 SDK only: an older SDK's compiler must not see it
    // (@available is a run-time check), and a newer OS run by an older build gets the
    // deprecated switch, which it still honours.
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
    if (@available(macOS 15.0, *)) {
        options.mathMode = MTLMathModeSafe;
    } else
#endif
    {
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
        options.fastMathEnabled = NO;
#pragma clang diagnostic pop
    }
    for (NSUInteger i = 0; i < device.sources.count; i++) {
        error = nil;
        id<MTLLibrary> library = [device.device newLibraryWithSource:device.sources[i]
                                                             options:options
                                                               error:&error];
        if (library == nil) {
            [device.libraries removeAllObjects];
            return dm_set_error(DM_ERR_COMPILE, "Metal: %s does not compile: %s",
                                device.sourceNames[i].UTF8String, describe(error));
        }
        [device.libraries addObject:library];
    }
    device.librariesLoaded = YES;
    return DM_OK;
}

static int metal_pipeline_create(void *handle, const char *name, void **out,
                                 dm_driver_pipeline_facts *facts) {
    @autoreleasepool {
        DMMetalDevice *device = (__bridge DMMetalDevice *)handle;
        int rc = load_libraries(device);
        if (rc != DM_OK) return rc;
        NSString *function_name = [NSString stringWithUTF8String:name];
        if (function_name == nil)
            return dm_set_error(DM_ERR_INVALID, "Metal: kernel name is not UTF-8");
        id<MTLFunction> function = nil;
        for (NSUInteger i = 0; i < device.libraries.count && function == nil; i++)
            function = [device.libraries[i] newFunctionWithName:function_name];
        if (function == nil)
            return dm_set_error(DM_ERR_NOT_FOUND, "no kernel named '%s' in the Metal library",
                                name);
        NSError *error = nil;
        id<MTLComputePipelineState> pipeline =
            [device.device newComputePipelineStateWithFunction:function error:&error];
        if (pipeline == nil)
            return dm_set_error(DM_ERR_COMPILE, "Metal: pipeline of kernel '%s' failed: %s", name,
                                describe(error));
        facts->max_total_threads = (uint32_t)pipeline.maxTotalThreadsPerThreadgroup;
        facts->execution_width = (uint32_t)pipeline.threadExecutionWidth;
        facts->static_tg_memory = (uint32_t)pipeline.staticThreadgroupMemoryLength;
        *out = (__bridge_retained void *)pipeline;
        return DM_OK;
    }
}

static void metal_pipeline_free(void *device, void *pipeline) {
    (void)device;
    @autoreleasepool {
        (void)(__bridge_transfer id<MTLComputePipelineState>)pipeline;
    }
}

static int metal_command_begin(void *handle, void **out) {
    @autoreleasepool {
        DMMetalDevice *device = (__bridge DMMetalDevice *)handle;
        DMMetalCommand *command = [DMMetalCommand new];
        command.buffer = [device.queue commandBuffer];
        if (command.buffer == nil)
            return dm_set_error(DM_ERR_RESOURCE, "Metal: cannot create a command buffer");
        *out = (__bridge_retained void *)command;
        return DM_OK;
    }
}

static id<MTLComputeCommandEncoder> open_encoder(DMMetalCommand *command) {
    if (command.encoder == nil) command.encoder = [command.buffer computeCommandEncoder];
    return command.encoder;
}

/* Timed dispatches per counter sample buffer (two samples each; 4096 samples of 8 bytes is
 * the most some GPUs allow in one buffer). */
#define DM_TIMED_PER_SAMPLE_BUFFER 2048

static id<MTLCounterSet> timestamp_counters(id<MTLDevice> device) {
    NSArray<id<MTLCounterSet>> *sets = device.counterSets;
    for (NSUInteger i = 0; i < sets.count; i++)
        if ([sets[i].name isEqualToString:MTLCommonCounterSetTimestamp]) return sets[i];
    return nil;
}

/* A new encoder whose start and end are sampled into the next two samples (the open encoder,
 * if any, is ended first). nil with the error set when it cannot be made. */
static id<MTLComputeCommandEncoder> timed_encoder(DMMetalDevice *device, DMMetalCommand *command) {
    if (command.encoder != nil) {
        [command.encoder endEncoding];
        command.encoder = nil;
    }
    NSUInteger slot = device.timedCount % DM_TIMED_PER_SAMPLE_BUFFER;
    if (slot == 0) {
        MTLCounterSampleBufferDescriptor *descriptor = [MTLCounterSampleBufferDescriptor new];
        descriptor.counterSet = timestamp_counters(device.device);
        descriptor.storageMode = MTLStorageModeShared;
        descriptor.sampleCount = 2 * DM_TIMED_PER_SAMPLE_BUFFER;
        NSError *error = nil;
        id<MTLCounterSampleBuffer> samples =
            [device.device newCounterSampleBufferWithDescriptor:descriptor error:&error];
        if (samples == nil) {
            dm_set_error(DM_ERR_RESOURCE, "Metal: cannot create a counter sample buffer: %s",
                         describe(error));
            return nil;
        }
        [device.sampleBuffers addObject:samples];
    }
    MTLComputePassDescriptor *pass = [MTLComputePassDescriptor computePassDescriptor];
    MTLComputePassSampleBufferAttachmentDescriptor *attachment = pass.sampleBufferAttachments[0];
    attachment.sampleBuffer = device.sampleBuffers[device.sampleBuffers.count - 1];
    attachment.startOfEncoderSampleIndex = 2 * slot;
    attachment.endOfEncoderSampleIndex = 2 * slot + 1;
    id<MTLComputeCommandEncoder> encoder = [command.buffer computeCommandEncoderWithDescriptor:pass];
    if (encoder == nil) {
        dm_set_error(DM_ERR_RESOURCE, "Metal: cannot create a timed compute encoder");
        return nil;
    }
    device.timedCount++;
    return encoder;
}

/* Binds and dispatches one validated dispatch; `pipeline` nil keeps the state already set. */
static void encode_one(id<MTLComputeCommandEncoder> encoder, id<MTLComputePipelineState> pipeline,
                       const dm_driver_dispatch *d) {
    if (pipeline != nil) [encoder setComputePipelineState:pipeline];
    if (d->args_size > 0) [encoder setBytes:d->args length:d->args_size atIndex:0];
    for (int i = 0; i < d->n_indices; i++) {
        if (d->buffers[i] == NULL) continue;
        [encoder setBuffer:(__bridge id<MTLBuffer>)d->buffers[i]
                    offset:d->offsets[i]
                   atIndex:(NSUInteger)i];
    }
    for (int i = 0; i < d->n_tg_memory; i++)
        if (d->tg_memory[i] > 0)
            [encoder setThreadgroupMemoryLength:d->tg_memory[i] atIndex:(NSUInteger)i];
    MTLSize size = MTLSizeMake(d->grid[0], d->grid[1], d->grid[2]);
    MTLSize group = MTLSizeMake(d->group[0], d->group[1], d->group[2]);
    if (d->mode == DM_DISPATCH_THREADGROUPS)
        [encoder dispatchThreadgroups:size threadsPerThreadgroup:group];
    else
        [encoder dispatchThreads:size threadsPerThreadgroup:group];
}

static int metal_encode(void *handle, void *command_handle, void *pipeline_handle,
                        const dm_driver_dispatch *d) {
    @autoreleasepool {
        DMMetalDevice *device = (__bridge DMMetalDevice *)handle;
        DMMetalCommand *command = (__bridge DMMetalCommand *)command_handle;
        if (device.profiling) {
            id<MTLComputeCommandEncoder> timed = timed_encoder(device, command);
            if (timed == nil) return DM_ERR_RESOURCE;
            encode_one(timed, (__bridge id<MTLComputePipelineState>)pipeline_handle, d);
            [timed endEncoding];
            return DM_OK;
        }
        id<MTLComputeCommandEncoder> encoder = open_encoder(command);
        if (encoder == nil)
            return dm_set_error(DM_ERR_RESOURCE, "Metal: cannot create a compute encoder");
        encode_one(encoder, (__bridge id<MTLComputePipelineState>)pipeline_handle, d);
        return DM_OK;
    }
}

/* A prepared list: one autorelease pool for all of it, and the pipeline state set only when
 * it changes (consecutive dispatches of one kernel are common: im2col/GEMM pairs aside,
 * routes copy input after input). */
static int metal_encode_batch(void *handle, void *command_handle, const dm_driver_item *items,
                              int n, int *n_done) {
    *n_done = 0;
    @autoreleasepool {
        DMMetalDevice *device = (__bridge DMMetalDevice *)handle;
        DMMetalCommand *command = (__bridge DMMetalCommand *)command_handle;
        if (device.profiling) {
            for (int i = 0; i < n; i++) {
                int rc = metal_encode(handle, command_handle, items[i].pipeline, &items[i].dispatch);
                if (rc != DM_OK) return rc;
                *n_done = i + 1;
            }
            return DM_OK;
        }
        id<MTLComputeCommandEncoder> encoder = open_encoder(command);
        if (encoder == nil)
            return dm_set_error(DM_ERR_RESOURCE, "Metal: cannot create a compute encoder");
        void *current = NULL;
        for (int i = 0; i < n; i++) {
            void *p = items[i].pipeline;
            encode_one(encoder, p == current ? nil : (__bridge id<MTLComputePipelineState>)p,
                       &items[i].dispatch);
            current = p;
        }
        *n_done = n;
        return DM_OK;
    }
}

static int metal_commit(void *handle, void *command_handle) {
    (void)handle;
    @autoreleasepool {
        DMMetalCommand *command = (__bridge DMMetalCommand *)command_handle;
        if (command.encoder != nil) {
            [command.encoder endEncoding];
            command.encoder = nil;
        }
        [command.buffer commit];
        return DM_OK;
    }
}

static int metal_wait(void *handle, void *command_handle) {
    (void)handle;
    @autoreleasepool {
        DMMetalCommand *command = (__bridge_transfer DMMetalCommand *)command_handle;
        id<MTLCommandBuffer> buffer = command.buffer;
        [buffer waitUntilCompleted];
        if (buffer.status == MTLCommandBufferStatusError)
            return dm_set_error(DM_ERR_EXECUTION, "Metal command buffer failed: %s",
                                describe(buffer.error));
        if (buffer.status != MTLCommandBufferStatusCompleted)
            return dm_set_error(DM_ERR_EXECUTION,
                                "Metal command buffer ended in status %ld instead of completed",
                                (long)buffer.status);
        return DM_OK;
    }
}

static void metal_discard(void *handle, void *command_handle) {
    (void)handle;
    @autoreleasepool {
        DMMetalCommand *command = (__bridge_transfer DMMetalCommand *)command_handle;
        if (command.encoder != nil) [command.encoder endEncoding];
        command.encoder = nil;
        command.buffer = nil;
    }
}

static int metal_profile_start(void *handle) {
    @autoreleasepool {
        DMMetalDevice *device = (__bridge DMMetalDevice *)handle;
        if (![device.device supportsCounterSampling:MTLCounterSamplingPointAtStageBoundary] ||
            timestamp_counters(device.device) == nil)
            return dm_set_error(DM_ERR_UNSUPPORTED,
                                "%s cannot sample GPU timestamps at encoder boundaries",
                                device.device.name.UTF8String);
        device.sampleBuffers = [NSMutableArray array];
        device.timedCount = 0;
        MTLTimestamp cpu = 0, gpu = 0;
        [device.device sampleTimestamps:&cpu gpuTimestamp:&gpu];
        device.cpuStart = cpu;
        device.gpuStart = gpu;
        device.profiling = YES;
        return DM_OK;
    }
}

/* GPU timestamps are in the GPU's own ticks: scaled by how far the CPU's clock (ns) moved
 * against the GPU's over the profile. */
static int metal_profile_stop(void *handle, uint64_t *ns, size_t capacity, size_t *n,
                              dm_profile_copies *copies) {
    @autoreleasepool {
        DMMetalDevice *device = (__bridge DMMetalDevice *)handle;
        device.profiling = NO;
        copies->bytes = copies->ns = copies->count = 0;
        MTLTimestamp cpu = 0, gpu = 0;
        [device.device sampleTimestamps:&cpu gpuTimestamp:&gpu];
        double scale = 1.0;
        if (gpu > device.gpuStart && cpu > device.cpuStart)
            scale = (double)(cpu - device.cpuStart) / (double)(gpu - device.gpuStart);
        NSUInteger total = device.timedCount;
        *n = total;
        for (NSUInteger b = 0; b < device.sampleBuffers.count; b++) {
            NSUInteger first = b * DM_TIMED_PER_SAMPLE_BUFFER;
            NSUInteger count = total - first < DM_TIMED_PER_SAMPLE_BUFFER
                                   ? total - first : DM_TIMED_PER_SAMPLE_BUFFER;
            NSData *data = [device.sampleBuffers[b] resolveCounterRange:NSMakeRange(0, 2 * count)];
            if (data == nil || data.length < 2 * count * sizeof(MTLCounterResultTimestamp))
                return dm_set_error(DM_ERR_EXECUTION, "Metal: the GPU timestamps could not be read");
            const MTLCounterResultTimestamp *t = (const MTLCounterResultTimestamp *)data.bytes;
            for (NSUInteger i = 0; i < count && first + i < capacity; i++) {
                uint64_t start = t[2 * i].timestamp, end = t[2 * i + 1].timestamp;
                int valid = start != MTLCounterErrorValue && end != MTLCounterErrorValue &&
                            end >= start;
                ns[first + i] = valid ? (uint64_t)((double)(end - start) * scale + 0.5) : 0;
            }
        }
        device.sampleBuffers = nil;
        device.timedCount = 0;
        return DM_OK;
    }
}

static const dm_driver metal_driver = {
    .name = "Metal",
    .device_create = metal_device_create,
    .device_destroy = metal_device_destroy,
    .buffer_alloc = metal_buffer_alloc,
    .buffer_wrap = metal_buffer_wrap,
    .buffer_free = metal_buffer_free,
    .pipeline_create = metal_pipeline_create,
    .pipeline_free = metal_pipeline_free,
    .command_begin = metal_command_begin,
    .check = NULL,
    .encode = metal_encode,
    .encode_batch = metal_encode_batch,
    .commit = metal_commit,
    .wait = metal_wait,
    .discard = metal_discard,
    .set_thread_order = NULL,
    .profile_start = metal_profile_start,
    .profile_stop = metal_profile_stop,
};

const dm_driver *dm_metal_driver(void) { return &metal_driver; }
