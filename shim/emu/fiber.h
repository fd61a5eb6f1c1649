/* Minimal stackful coroutines ("fibers") for the threads of one emulated threadgroup.
 *
 * The default is a hand-written context switch for x86-64 and arm64 that saves only the
 * callee-saved registers (much cheaper than swapcontext, which also saves the signal mask
 * with a system call). Define EMU_FIBER_UCONTEXT to use <ucontext.h> instead. */
#ifndef DM_EMU_FIBER_H
#define DM_EMU_FIBER_H

#include <stddef.h>

/* EMU_ASAN: built with AddressSanitizer (GCC or Clang), so fiber switches must be announced. */
#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif

#if !defined(EMU_FIBER_UCONTEXT) && !defined(__x86_64__) && !defined(__aarch64__)
#define EMU_FIBER_UCONTEXT 1
#endif

#ifdef EMU_FIBER_UCONTEXT
#include <ucontext.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef struct emu_fiber {
    void *sp;         /* saved stack pointer (assembly switch) */
    void *stack;      /* lowest usable address of the stack, NULL for a thread's own stack */
    size_t size;      /* usable bytes */
    void *asan_fake;  /* AddressSanitizer's fake-stack handle while switched out */
#ifdef EMU_FIBER_UCONTEXT
    ucontext_t uc;
#endif
} emu_fiber;

/* Prepares `f` to run fn(arg) on [stack, stack + size) at its first switch-in. fn must never
 * return: it ends by switching away for good. */
void emu_fiber_make(emu_fiber *f, void *stack, size_t size, void (*fn)(void *), void *arg);

/* Saves the running context into `from` and resumes `to`. `from_exits` tells
 * AddressSanitizer that `from` will never be resumed. */
void emu_fiber_switch(emu_fiber *from, emu_fiber *to, int from_exits);

/* Must be the first call of a fiber's entry function (AddressSanitizer bookkeeping); returns
 * the stack bounds of the context that switched in, so the scheduler's stack is known. */
void emu_fiber_entered(emu_fiber *self, const void **prev_bottom, size_t *prev_size);

/* Name of the switch implementation compiled in ("x86_64-asm", "arm64-asm", "ucontext"). */
const char *emu_fiber_backend(void);

#ifdef __cplusplus
}
#endif
#endif
