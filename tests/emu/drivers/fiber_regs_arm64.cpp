// Checks that the AArch64 fiber switch preserves every callee-saved register (x19..x28,
// d8..d15) and the stack pointer: the main context loads known values, switches to a fiber that
// overwrites all of them before switching back, then reads them again. Prints "ok" or the
// registers that changed.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "fiber.h"

#if !defined(__aarch64__) || defined(EMU_FIBER_UCONTEXT)
#error "this check is for the AArch64 assembly switch"
#endif

// Named from the assembly below, hence C linkage. g_after receives x19..x28, the bit patterns of
// d8..d15, and sp before and after the switch.
extern "C" {
emu_fiber g_main;
emu_fiber g_fiber;
uint64_t g_after[20];
}
static int g_rounds;

static void fiber_body(void *arg) {
    emu_fiber_entered(&g_fiber, nullptr, nullptr);
    int *rounds = static_cast<int *>(arg);
    for (;;) {
        ++*rounds;
        // Values live only until the switch: what the main context sees afterwards must come
        // from its own saved frame, not from here.
        asm volatile(
            "mov x19, #0x7777\n mov x20, x19\n mov x21, x19\n mov x22, x19\n mov x23, x19\n"
            "mov x24, x19\n mov x25, x19\n mov x26, x19\n mov x27, x19\n mov x28, x19\n"
            "fmov d8, #-2.0\n fmov d9, d8\n fmov d10, d8\n fmov d11, d8\n fmov d12, d8\n"
            "fmov d13, d8\n fmov d14, d8\n fmov d15, d8\n" ::
                : "x19", "x20", "x21", "x22", "x23", "x24", "x25", "x26", "x27", "x28", "d8",
                  "d9", "d10", "d11", "d12", "d13", "d14", "d15");
        emu_fiber_switch(&g_fiber, &g_main, 0);
    }
}

// Loads x19 + i into x(19 + i) and 1.0 + i into d(8 + i), switches to the fiber through
// emu_fiber_switch(&g_main, &g_fiber, 0), then stores the registers and sp into g_after.
static void switch_with_known_registers() {
    asm volatile(
        "mov x19, #19\n mov x20, #20\n mov x21, #21\n mov x22, #22\n mov x23, #23\n"
        "mov x24, #24\n mov x25, #25\n mov x26, #26\n mov x27, #27\n mov x28, #28\n"
        "fmov d8, #1.0\n fmov d9, #2.0\n fmov d10, #3.0\n fmov d11, #4.0\n"
        "fmov d12, #5.0\n fmov d13, #6.0\n fmov d14, #7.0\n fmov d15, #8.0\n"
        "adrp x9, g_after\n add x9, x9, :lo12:g_after\n mov x10, sp\n str x10, [x9, #144]\n"
        "adrp x0, g_main\n add x0, x0, :lo12:g_main\n"
        "adrp x1, g_fiber\n add x1, x1, :lo12:g_fiber\n"
        "mov w2, #0\n bl emu_fiber_switch\n"
        "adrp x9, g_after\n add x9, x9, :lo12:g_after\n"
        "stp x19, x20, [x9, #0]\n stp x21, x22, [x9, #16]\n stp x23, x24, [x9, #32]\n"
        "stp x25, x26, [x9, #48]\n stp x27, x28, [x9, #64]\n"
        "stp d8, d9, [x9, #80]\n stp d10, d11, [x9, #96]\n"
        "stp d12, d13, [x9, #112]\n stp d14, d15, [x9, #128]\n"
        "mov x10, sp\n str x10, [x9, #152]\n"
        :
        :
        : "x0", "x1", "x2", "x3", "x4", "x5", "x6", "x7", "x8", "x9", "x10", "x11", "x12",
          "x13", "x14", "x15", "x16", "x17", "x19", "x20", "x21", "x22", "x23", "x24", "x25",
          "x26", "x27", "x28", "x30", "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8",
          "v9", "v10", "v11", "v12", "v13", "v14", "v15", "v16", "v17", "v18", "v19", "v20",
          "v21", "v22", "v23", "v24", "v25", "v26", "v27", "v28", "v29", "v30", "v31", "cc",
          "memory");
}

int main() {
    const size_t size = 64 * 1024;
    void *stack = aligned_alloc(16, size);
    if (!stack) return 2;
    emu_fiber_make(&g_fiber, stack, size, fiber_body, &g_rounds);
    int bad = 0;
    for (int round = 0; round < 3; ++round) {  // the first switch starts the fiber
        switch_with_known_registers();
        for (int i = 0; i < 10; ++i) {
            if (g_after[i] != (uint64_t)(19 + i)) {
                printf("round %d: x%d = %#llx\n", round, 19 + i, (unsigned long long)g_after[i]);
                ++bad;
            }
        }
        for (int i = 0; i < 8; ++i) {
            double d;
            __builtin_memcpy(&d, &g_after[10 + i], sizeof d);
            if (d != 1.0 + i) {
                printf("round %d: d%d = %g\n", round, 8 + i, d);
                ++bad;
            }
        }
        if (g_after[18] != g_after[19]) {
            printf("round %d: sp moved from %#llx to %#llx\n", round,
                   (unsigned long long)g_after[18], (unsigned long long)g_after[19]);
            ++bad;
        }
    }
    if (g_rounds != 3) {
        printf("fiber ran %d times, expected 3\n", g_rounds);
        ++bad;
    }
    printf("backend=%s\n%s\n", emu_fiber_backend(), bad ? "FAILED" : "ok");
    free(stack);
    return bad ? 1 : 0;
}
