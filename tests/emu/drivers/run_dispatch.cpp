// Runs one dispatch described on the command line over buffers held in files, then writes
// every buffer back to its file. Used where the emulator cannot be loaded into Python (an
// executable built for another architecture and run under a user-mode emulator).
//
//   run_dispatch KERNEL MODE ORDER SEED SX SY SZ GX GY GZ BUFFER_FILE...
//
// MODE: 0 threads, 1 threadgroups; ORDER: 0 forward, 1 reverse, 2 random. Prints the fiber
// backend, then "rc=<code>" and, on failure, the runtime's message on the next line.
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "emu.h"
#include "fiber.h"

static bool read_file(const char *path, std::vector<unsigned char> &out) {
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    unsigned char chunk[4096];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) out.insert(out.end(), chunk, chunk + n);
    fclose(f);
    return true;
}

static bool write_file(const char *path, const std::vector<unsigned char> &data) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(data.data(), 1, data.size(), f) == data.size();
    return fclose(f) == 0 && ok;
}

int main(int argc, char **argv) {
    if (argc < 11) {
        fprintf(stderr, "usage: %s KERNEL MODE ORDER SEED SX SY SZ GX GY GZ BUFFER_FILE...\n",
                argv[0]);
        return 2;
    }
    printf("backend=%s\n", emu_fiber_backend());
    const emu_kernel_info *k = emu_find_kernel(argv[1]);
    emu_device *dev = emu_device_create(2);
    if (!k || !dev) {
        fprintf(stderr, "setup failed: %s\n", emu_last_error());
        return 2;
    }
    int n_buffers = argc - 11;
    std::vector<std::vector<unsigned char>> data(n_buffers);
    std::vector<void *> ptrs(n_buffers > 0 ? n_buffers : 1, nullptr);
    for (int i = 0; i < n_buffers; ++i) {
        if (!read_file(argv[11 + i], data[i])) {
            fprintf(stderr, "cannot read %s\n", argv[11 + i]);
            return 2;
        }
        // Padding keeps a vector load that straddles the end of a buffer inside the allocation.
        data[i].resize(data[i].size() + 64);
        ptrs[i] = data[i].data();
    }
    emu_dispatch_desc d = {};
    d.kernel = k;
    d.buffers = ptrs.data();
    d.n_buffers = n_buffers;
    d.mode = atoi(argv[2]);
    d.order = atoi(argv[3]);
    d.seed = strtoull(argv[4], nullptr, 10);
    for (int j = 0; j < 3; ++j) {
        d.size[j] = (uint32_t)strtoul(argv[5 + j], nullptr, 10);
        d.group[j] = (uint32_t)strtoul(argv[8 + j], nullptr, 10);
    }
    int rc = emu_dispatch(dev, &d);
    printf("rc=%d\n", rc);
    if (rc != 0) printf("%s\n", emu_last_error());
    for (int i = 0; i < n_buffers; ++i) {
        data[i].resize(data[i].size() - 64);
        if (!write_file(argv[11 + i], data[i])) {
            fprintf(stderr, "cannot write %s\n", argv[11 + i]);
            return 2;
        }
    }
    emu_device_destroy(dev);
    return 0;
}
