// Runs the kernel oob_read over a heap buffer of exactly n floats, so that AddressSanitizer
// sees the read past its end.
#include <stdio.h>
#include <stdlib.h>

#include "emu.h"

int main() {
    const int n = 64;
    float *x = static_cast<float *>(malloc(n * sizeof(float)));
    float *out = static_cast<float *>(malloc(n * sizeof(float)));
    for (int i = 0; i < n; ++i) x[i] = (float)i;
    emu_device *dev = emu_device_create(1);
    const emu_kernel_info *k = emu_find_kernel("oob_read");
    if (!dev || !k) {
        fprintf(stderr, "setup failed: %s\n", emu_last_error());
        return 2;
    }
    void *buffers[2] = {x, out};
    emu_dispatch_desc d = {};
    d.kernel = k;
    d.buffers = buffers;
    d.n_buffers = 2;
    d.size[0] = n;
    d.size[1] = d.size[2] = 1;
    d.group[0] = 32;
    d.group[1] = d.group[2] = 1;
    int rc = emu_dispatch(dev, &d);
    printf("dispatch returned %d\n", rc);
    emu_device_destroy(dev);
    free(x);
    free(out);
    return 0;
}
