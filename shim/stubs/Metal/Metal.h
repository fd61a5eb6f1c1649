/* Stub: the subset of Metal used by shim/drivers/metal_driver.m (macOS 13.3 SDK signatures:
 * MTLTypes.h, MTLResource.h, MTLBuffer.h, MTLDevice.h, MTLLibrary.h, MTLCommandQueue.h,
 * MTLCommandBuffer.h, MTLCommandEncoder.h, MTLComputeCommandEncoder.h,
 * MTLComputePipeline.h, MTLCounters.h, MTLComputePass.h). For compile checks only. */
#ifndef DM_STUB_METAL_H
#define DM_STUB_METAL_H

#import <Foundation/Foundation.h>

#define MTL_EXTERN extern __attribute__((visibility("default")))

NS_ASSUME_NONNULL_BEGIN

/* MTLTypes.h */
typedef struct {
    NSUInteger width, height, depth;
} MTLSize;

static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
    MTLSize size = {width, height, depth};
    return size;
}

/* MTLResource.h */
typedef NS_ENUM(NSUInteger, MTLCPUCacheMode) {
    MTLCPUCacheModeDefaultCache = 0,
    MTLCPUCacheModeWriteCombined = 1,
};

typedef NS_ENUM(NSUInteger, MTLStorageMode) {
    MTLStorageModeShared = 0,
    MTLStorageModeManaged = 1,
    MTLStorageModePrivate = 2,
    MTLStorageModeMemoryless = 3,
};

#define MTLResourceCPUCacheModeShift 0
#define MTLResourceStorageModeShift 4

typedef NS_OPTIONS(NSUInteger, MTLResourceOptions) {
    MTLResourceCPUCacheModeDefaultCache = MTLCPUCacheModeDefaultCache << MTLResourceCPUCacheModeShift,
    MTLResourceCPUCacheModeWriteCombined = MTLCPUCacheModeWriteCombined << MTLResourceCPUCacheModeShift,
    MTLResourceStorageModeShared = MTLStorageModeShared << MTLResourceStorageModeShift,
    MTLResourceStorageModeManaged = MTLStorageModeManaged << MTLResourceStorageModeShift,
    MTLResourceStorageModePrivate = MTLStorageModePrivate << MTLResourceStorageModeShift,
};

@protocol MTLDevice;

@protocol MTLResource <NSObject>
@property (nullable, copy, atomic) NSString *label;
@property (readonly) id<MTLDevice> device;
@end

/* MTLBuffer.h */
@protocol MTLBuffer <MTLResource>
@property (readonly) NSUInteger length;
- (void *)contents NS_RETURNS_INNER_POINTER;
@end

/* MTLLibrary.h */
@protocol MTLFunction <NSObject>
@property (readonly) NSString *name;
@end

#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
/* The 15 SDK: mathMode appears and fastMathEnabled is deprecated. */
typedef NS_ENUM(NSInteger, MTLMathMode) {
    MTLMathModeSafe = 0,
    MTLMathModeRelaxed = 1,
    MTLMathModeFast = 2,
} API_AVAILABLE(macos(15.0));

@interface MTLCompileOptions : NSObject
@property (readwrite, nonatomic) BOOL fastMathEnabled
    API_DEPRECATED("Use mathMode instead", macos(10.11, 15.0));
@property (readwrite, nonatomic) MTLMathMode mathMode API_AVAILABLE(macos(15.0));
@end
#else
/* The 13.3 SDK: no MTLMathMode, no mathMode. */
@interface MTLCompileOptions : NSObject
@property (readwrite, nonatomic) BOOL fastMathEnabled;
@end
#endif

@protocol MTLLibrary <NSObject>
- (nullable id<MTLFunction>)newFunctionWithName:(NSString *)functionName;
@property (readonly) NSArray<NSString *> *functionNames;
@end

/* MTLComputePipeline.h */
@protocol MTLComputePipelineState <NSObject>
@property (readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property (readonly) NSUInteger threadExecutionWidth;
@property (readonly) NSUInteger staticThreadgroupMemoryLength;
@end

/* MTLCommandEncoder.h */
@protocol MTLCommandEncoder <NSObject>
- (void)endEncoding;
@end

/* MTLComputeCommandEncoder.h */
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void *)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)dispatchThreads:(MTLSize)threadsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end

/* MTLCounters.h */
typedef NSString *MTLCommonCounterSet;
MTL_EXTERN MTLCommonCounterSet const MTLCommonCounterSetTimestamp;

typedef NS_ENUM(NSUInteger, MTLCounterSamplingPoint) {
    MTLCounterSamplingPointAtStageBoundary = 0,
    MTLCounterSamplingPointAtDrawBoundary = 1,
    MTLCounterSamplingPointAtDispatchBoundary = 2,
    MTLCounterSamplingPointAtTileDispatchBoundary = 3,
    MTLCounterSamplingPointAtBlitBoundary = 4,
};

typedef struct {
    uint64_t timestamp;
} MTLCounterResultTimestamp;

#define MTLCounterErrorValue ((uint64_t)-1)

typedef uint64_t MTLTimestamp;

@protocol MTLCounterSet <NSObject>
@property (readonly) NSString *name;
@end

@interface MTLCounterSampleBufferDescriptor : NSObject
@property (readwrite, retain) id<MTLCounterSet> counterSet;
@property (readwrite) MTLStorageMode storageMode;
@property (readwrite) NSUInteger sampleCount;
@end

@protocol MTLCounterSampleBuffer <NSObject>
@property (readonly) NSUInteger sampleCount;
- (nullable NSData *)resolveCounterRange:(NSRange)range;
@end

/* MTLComputePass.h */
@interface MTLComputePassSampleBufferAttachmentDescriptor : NSObject
@property (nullable, nonatomic, retain) id<MTLCounterSampleBuffer> sampleBuffer;
@property (nonatomic) NSUInteger startOfEncoderSampleIndex;
@property (nonatomic) NSUInteger endOfEncoderSampleIndex;
@end

@interface MTLComputePassSampleBufferAttachmentDescriptorArray : NSObject
- (MTLComputePassSampleBufferAttachmentDescriptor *)objectAtIndexedSubscript:(NSUInteger)attachmentIndex;
@end

@interface MTLComputePassDescriptor : NSObject
+ (MTLComputePassDescriptor *)computePassDescriptor;
@property (readonly) MTLComputePassSampleBufferAttachmentDescriptorArray *sampleBufferAttachments;
@end

/* MTLCommandBuffer.h */
typedef NS_ENUM(NSUInteger, MTLCommandBufferStatus) {
    MTLCommandBufferStatusNotEnqueued = 0,
    MTLCommandBufferStatusEnqueued = 1,
    MTLCommandBufferStatusCommitted = 2,
    MTLCommandBufferStatusScheduled = 3,
    MTLCommandBufferStatusCompleted = 4,
    MTLCommandBufferStatusError = 5,
};

@protocol MTLCommandBuffer <NSObject>
- (void)commit;
- (void)waitUntilCompleted;
@property (readonly) MTLCommandBufferStatus status;
@property (nullable, readonly) NSError *error;
- (nullable id<MTLComputeCommandEncoder>)computeCommandEncoder;
- (nullable id<MTLComputeCommandEncoder>)computeCommandEncoderWithDescriptor:(MTLComputePassDescriptor *)computePassDescriptor;
@end

/* MTLCommandQueue.h */
@protocol MTLCommandQueue <NSObject>
- (nullable id<MTLCommandBuffer>)commandBuffer;
@end

/* MTLDevice.h */
typedef NS_ENUM(NSInteger, MTLGPUFamily) {
    MTLGPUFamilyApple1 = 1001,
    MTLGPUFamilyApple2 = 1002,
    MTLGPUFamilyApple3 = 1003,
    MTLGPUFamilyApple4 = 1004,
    MTLGPUFamilyApple5 = 1005,
    MTLGPUFamilyApple6 = 1006,
    MTLGPUFamilyApple7 = 1007,
    MTLGPUFamilyApple8 = 1008,
    MTLGPUFamilyApple9 = 1009,
    MTLGPUFamilyMac2 = 2002,
    MTLGPUFamilyCommon1 = 3001,
    MTLGPUFamilyCommon2 = 3002,
    MTLGPUFamilyCommon3 = 3003,
    MTLGPUFamilyMetal3 = 5001,
};

@protocol MTLDevice <NSObject>
@property (readonly) NSString *name;
@property (readonly) MTLSize maxThreadsPerThreadgroup;
@property (readonly) BOOL hasUnifiedMemory;
@property (readonly) uint64_t recommendedMaxWorkingSetSize;
@property (readonly) NSUInteger maxThreadgroupMemoryLength;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily;
@property (readonly, nullable) NSArray<id<MTLCounterSet>> *counterSets;
- (BOOL)supportsCounterSampling:(MTLCounterSamplingPoint)samplingPoint;
- (nullable id<MTLCounterSampleBuffer>)newCounterSampleBufferWithDescriptor:(MTLCounterSampleBufferDescriptor *)descriptor error:(__autoreleasing NSError **)error;
- (void)sampleTimestamps:(MTLTimestamp *)cpuTimestamp gpuTimestamp:(MTLTimestamp *)gpuTimestamp;
- (nullable id<MTLCommandQueue>)newCommandQueue;
- (nullable id<MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options;
- (nullable id<MTLBuffer>)newBufferWithBytesNoCopy:(void *)pointer length:(NSUInteger)length options:(MTLResourceOptions)options deallocator:(void (^ __nullable)(void *pointer, NSUInteger length))deallocator;
- (nullable id<MTLLibrary>)newLibraryWithURL:(NSURL *)url error:(__autoreleasing NSError **)error;
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString *)source options:(nullable MTLCompileOptions *)options error:(__autoreleasing NSError **)error;
- (nullable id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction error:(__autoreleasing NSError **)error;
@end

MTL_EXTERN id<MTLDevice> __nullable MTLCreateSystemDefaultDevice(void) NS_RETURNS_RETAINED;

NS_ASSUME_NONNULL_END

#endif
