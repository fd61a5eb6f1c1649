/* Stub: the subset of Foundation used by shim/drivers/metal_driver.m (macOS 13.3 SDK
 * signatures). For compile checks only. */
#ifndef DM_STUB_FOUNDATION_H
#define DM_STUB_FOUNDATION_H

/* <AvailabilityInternal.h>: the SDK's own version, what `#if` on an API's SDK tests. The
 * stubs stand for the 13.3 SDK unless DM_STUB_SDK says otherwise (150000: the 15 SDK). */
#ifndef DM_STUB_SDK
#define DM_STUB_SDK 130300
#endif
#define __MAC_OS_X_VERSION_MAX_ALLOWED DM_STUB_SDK

#include <stddef.h>
#include <stdint.h>

#define NS_ASSUME_NONNULL_BEGIN _Pragma("clang assume_nonnull begin")
#define NS_ASSUME_NONNULL_END _Pragma("clang assume_nonnull end")
#define NS_RETURNS_RETAINED __attribute__((ns_returns_retained))
#define NS_RETURNS_INNER_POINTER __attribute__((objc_returns_inner_pointer))
#define FOUNDATION_EXPORT extern
#define NS_ENUM(_type, _name) enum _name : _type _name; enum _name : _type
#define NS_OPTIONS(_type, _name) enum _name : _type _name; enum _name : _type
/* <os/availability.h>, macOS only: enough for clang's availability checks. */
#define API_AVAILABLE(macos_version) __attribute__((availability(macos_version)))
#define macos(v) macos, introduced = v
/* API_DEPRECATED(message, macos(introduced, deprecated)), macOS only. */
#define API_DEPRECATED(why, range) DM_STUB_DEPRECATED_(why, DM_STUB_##range)
#define DM_STUB_DEPRECATED_(why, range) DM_STUB_DEPRECATED__(why, range)
#define DM_STUB_DEPRECATED__(why, from, to) \
    __attribute__((availability(macos, introduced = from, deprecated = to, message = why)))
#define DM_STUB_macos(from, to) from, to

typedef long NSInteger;
typedef unsigned long NSUInteger;
#define NSUIntegerMax __LONG_MAX__ * 2UL + 1UL

/* arm64 macOS: BOOL is bool. */
typedef _Bool BOOL;
#define nil ((id)0)
#define YES __objc_yes
#define NO __objc_no

NS_ASSUME_NONNULL_BEGIN

@class NSString;

@protocol NSObject
- (BOOL)isEqual:(id)object;
@property (readonly) NSUInteger hash;
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject> {
    Class isa;
}
+ (instancetype)new;
+ (instancetype)alloc;
- (instancetype)init;
@end

typedef struct _NSRange {
    NSUInteger location;
    NSUInteger length;
} NSRange;

static inline NSRange NSMakeRange(NSUInteger loc, NSUInteger len) {
    NSRange r = {loc, len};
    return r;
}

@interface NSString : NSObject
@property (readonly) NSUInteger length;
- (BOOL)isEqualToString:(NSString *)aString;
- (nullable instancetype)initWithUTF8String:(const char *)nullTerminatedCString;
+ (nullable instancetype)stringWithUTF8String:(const char *)nullTerminatedCString;
@property (nullable, readonly) const char *UTF8String NS_RETURNS_INNER_POINTER;
@end

@interface NSError : NSObject
@property (readonly, copy) NSString *domain;
@property (readonly) NSInteger code;
@property (readonly, copy) NSString *localizedDescription;
@end

@interface NSData : NSObject
@property (readonly) NSUInteger length;
@property (readonly) const void *bytes NS_RETURNS_INNER_POINTER;
@end

@interface NSURL : NSObject
+ (NSURL *)fileURLWithPath:(NSString *)path;
@end

@interface NSArray<__covariant ObjectType> : NSObject
@property (readonly) NSUInteger count;
- (ObjectType)objectAtIndex:(NSUInteger)index;
- (ObjectType)objectAtIndexedSubscript:(NSUInteger)idx;
+ (instancetype)array;
@end

@interface NSMutableArray<ObjectType> : NSArray<ObjectType>
- (void)addObject:(ObjectType)anObject;
- (void)removeAllObjects;
@end

FOUNDATION_EXPORT NSUInteger NSPageSize(void);

NS_ASSUME_NONNULL_END

#endif
