// Fiber context switch: assembly for x86-64 / arm64 (System V and Apple ABIs), ucontext
// otherwise. AddressSanitizer is told about every switch so that it tracks the right stack.
#include "fiber.h"

#include <stdint.h>
#include <string.h>

#ifdef EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__APPLE__)
#define EMU_SYM(name) "_" #name
#define EMU_TYPE(name) ""
#else
#define EMU_SYM(name) #name
#define EMU_TYPE(name) ".type " #name ", @function\n"
#endif

#ifndef EMU_FIBER_UCONTEXT

extern "C" void emu_fiber_swap(void **save_sp, void *new_sp);
extern "C" void emu_fiber_start(void);

#if defined(__x86_64__)
// Frame layout (from the saved sp upward): mxcsr+x87 control word, r15, r14, r13, r12, rbx,
// rbp, return address. A new fiber starts in emu_fiber_start with r12 = arg, r13 = fn.
asm(".text\n"
    ".globl " EMU_SYM(emu_fiber_swap) "\n" EMU_TYPE(emu_fiber_swap)
    ".p2align 4\n" EMU_SYM(emu_fiber_swap) ":\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    subq $8, %rsp\n"
    "    stmxcsr (%rsp)\n"
    "    fnstcw 4(%rsp)\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    ldmxcsr (%rsp)\n"
    "    fldcw 4(%rsp)\n"
    "    addq $8, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".globl " EMU_SYM(emu_fiber_start) "\n" EMU_TYPE(emu_fiber_start)
    ".p2align 4\n" EMU_SYM(emu_fiber_start) ":\n"
    "    .cfi_startproc\n"
    "    .cfi_undefined rip\n"
    "    movq %r12, %rdi\n"
    "    callq *%r13\n"
    "    ud2\n"
    "    .cfi_endproc\n");

static const size_t kFrameWords = 8;

static void init_frame(void **sp, void (*fn)(void *), void *arg) {
    uint32_t csr[2];
    asm volatile("stmxcsr %0" : "=m"(csr[0]));
    asm volatile("fnstcw %0" : "=m"(*(uint16_t *)&csr[1]));
    memcpy(&sp[0], csr, 8);
    sp[1] = nullptr;                           // r15
    sp[2] = nullptr;                           // r14
    sp[3] = (void *)fn;                        // r13
    sp[4] = arg;                               // r12
    sp[5] = nullptr;                           // rbx
    sp[6] = nullptr;                           // rbp: ends frame-pointer walks
    sp[7] = (void *)&emu_fiber_start;          // return address
}

#elif defined(__aarch64__)
// Frame layout: x19..x28, x29 (fp), x30 (lr), d8..d15; 176 bytes. A new fiber starts in
// emu_fiber_start with x19 = arg, x20 = fn (reached by `ret`, so it needs no landing pad).
// `hint #34` is `bti c`: built with -mbranch-protection, this object is marked BTI-compatible
// and a call through a PLT stub (`br x17`) must land on it; it is a no-op on other cores.
asm(".text\n"
    ".globl " EMU_SYM(emu_fiber_swap) "\n" EMU_TYPE(emu_fiber_swap)
    ".p2align 2\n" EMU_SYM(emu_fiber_swap) ":\n"
    "    hint #34\n"
    "    sub sp, sp, #176\n"
    "    stp x19, x20, [sp, #0]\n"
    "    stp x21, x22, [sp, #16]\n"
    "    stp x23, x24, [sp, #32]\n"
    "    stp x25, x26, [sp, #48]\n"
    "    stp x27, x28, [sp, #64]\n"
    "    stp x29, x30, [sp, #80]\n"
    "    stp d8, d9, [sp, #96]\n"
    "    stp d10, d11, [sp, #112]\n"
    "    stp d12, d13, [sp, #128]\n"
    "    stp d14, d15, [sp, #144]\n"
    "    mov x9, sp\n"
    "    str x9, [x0]\n"
    "    mov sp, x1\n"
    "    ldp x19, x20, [sp, #0]\n"
    "    ldp x21, x22, [sp, #16]\n"
    "    ldp x23, x24, [sp, #32]\n"
    "    ldp x25, x26, [sp, #48]\n"
    "    ldp x27, x28, [sp, #64]\n"
    "    ldp x29, x30, [sp, #80]\n"
    "    ldp d8, d9, [sp, #96]\n"
    "    ldp d10, d11, [sp, #112]\n"
    "    ldp d12, d13, [sp, #128]\n"
    "    ldp d14, d15, [sp, #144]\n"
    "    add sp, sp, #176\n"
    "    ret\n"
    ".globl " EMU_SYM(emu_fiber_start) "\n" EMU_TYPE(emu_fiber_start)
    ".p2align 2\n" EMU_SYM(emu_fiber_start) ":\n"
    "    .cfi_startproc\n"
    "    .cfi_undefined x30\n"
    "    mov x0, x19\n"
    "    blr x20\n"
    "    brk #0\n"
    "    .cfi_endproc\n");

static const size_t kFrameWords = 22;

static void init_frame(void **sp, void (*fn)(void *), void *arg) {
    memset(sp, 0, kFrameWords * sizeof(void *));
    sp[0] = arg;                          // x19
    sp[1] = (void *)fn;                   // x20
    sp[10] = nullptr;                     // x29: ends frame-pointer walks
    sp[11] = (void *)&emu_fiber_start;    // x30
}
#endif

extern "C" void emu_fiber_make(emu_fiber *f, void *stack, size_t size, void (*fn)(void *),
                               void *arg) {
    f->stack = stack;
    f->size = size;
    f->asan_fake = nullptr;
    uintptr_t top = ((uintptr_t)stack + size) & ~(uintptr_t)15;
    void **sp = (void **)(top - kFrameWords * sizeof(void *));
    init_frame(sp, fn, arg);
    f->sp = sp;
}

static inline void raw_switch(emu_fiber *from, emu_fiber *to) { emu_fiber_swap(&from->sp, to->sp); }

extern "C" const char *emu_fiber_backend(void) {
#if defined(__x86_64__)
    return "x86_64-asm";
#else
    return "arm64-asm";
#endif
}

#else  // EMU_FIBER_UCONTEXT

// makecontext passes int arguments only: the pointers travel split in two halves.
static void uc_entry(int fn_hi, int fn_lo, int arg_hi, int arg_lo) {
    uintptr_t fn = ((uintptr_t)(uint32_t)fn_hi << 32) | (uint32_t)fn_lo;
    uintptr_t arg = ((uintptr_t)(uint32_t)arg_hi << 32) | (uint32_t)arg_lo;
    ((void (*)(void *))fn)((void *)arg);
}

extern "C" void emu_fiber_make(emu_fiber *f, void *stack, size_t size, void (*fn)(void *),
                               void *arg) {
    f->stack = stack;
    f->size = size;
    f->asan_fake = nullptr;
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = stack;
    f->uc.uc_stack.ss_size = size;
    f->uc.uc_link = nullptr;
    uintptr_t p = (uintptr_t)fn, a = (uintptr_t)arg;
    makecontext(&f->uc, (void (*)())uc_entry, 4, (int)(uint32_t)(p >> 32), (int)(uint32_t)p,
                (int)(uint32_t)(a >> 32), (int)(uint32_t)a);
}

static inline void raw_switch(emu_fiber *from, emu_fiber *to) { swapcontext(&from->uc, &to->uc); }

extern "C" const char *emu_fiber_backend(void) { return "ucontext"; }

#endif

extern "C" void emu_fiber_switch(emu_fiber *from, emu_fiber *to, int from_exits) {
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(from_exits ? nullptr : &from->asan_fake, to->stack, to->size);
    raw_switch(from, to);
    __sanitizer_finish_switch_fiber(from->asan_fake, nullptr, nullptr);
#else
    (void)from_exits;
    raw_switch(from, to);
#endif
}

extern "C" void emu_fiber_entered(emu_fiber *self, const void **prev_bottom, size_t *prev_size) {
    (void)self;
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, prev_bottom, prev_size);
#else
    if (prev_bottom) *prev_bottom = nullptr;
    if (prev_size) *prev_size = 0;
#endif
}
