# cython: language_level=3
"""Python interface of the host shim: devices, buffers, kernel dispatch and prepared
dispatch lists (``Device.dispatch_list``).

``Device("emu")`` runs the kernels on the CPU emulator of the Metal compute model (every OS);
``Device("metal")`` runs them on the Apple GPU (macOS builds only); ``Device("cuda")`` runs
the same kernels, translated to CUDA, on an NVIDIA GPU (a verification device: machines with
the NVIDIA driver where nvcc is found). The emulator's kernels and the CUDA modules are
compiled on the first use of their device (``kernel_build``).
Work is encoded into a command buffer and runs asynchronously; reading a buffer (or
``synchronize``) waits for the work that uses it. Every failure raises
``darknet_metal.errors.DeviceError`` with the shim's message; ``.code`` holds its code.
"""

cimport cython
import os
import re

import numpy as np

from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from darknet_metal.errors import DeviceError
from darknet_metal.metal.kernel_build import cuda_modules, emu_library
from darknet_metal.metal.sources import shader_dirs

_KINDS = {"emu": DM_DEVICE_EMU, "metal": DM_DEVICE_METAL, "cuda": DM_DEVICE_CUDA}
_KIND_LIST = "'emu', 'metal' or 'cuda'"
_ORDERS = {"forward": DM_ORDER_FORWARD, "reverse": DM_ORDER_REVERSE, "random": DM_ORDER_RANDOM}
_ORDER_NAMES = {v: k for k, v in _ORDERS.items()}
_MODES = {"threads": DM_DISPATCH_THREADS, "threadgroups": DM_DISPATCH_THREADGROUPS}
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)

ERROR_CODES = {
    DM_ERR_INVALID: "invalid",
    DM_ERR_NOT_FOUND: "not_found",
    DM_ERR_UNAVAILABLE: "unavailable",
    DM_ERR_UNSUPPORTED: "unsupported",
    DM_ERR_RESOURCE: "resource",
    DM_ERR_EXECUTION: "execution",
    DM_ERR_COMPILE: "compile",
}


cdef int _raise(int rc) except -1:
    """Raises DeviceError carrying the thread's shim message when rc is an error code."""
    if rc == DM_OK:
        return 0
    message = dm_last_error().decode("utf-8", "replace") or f"shim error {rc}"
    err = DeviceError(message)
    err.code = rc
    err.kind = ERROR_CODES.get(rc, "unknown")
    raise err


def available(kind: str) -> bool:
    """True if a device of ``kind`` ("emu", "metal" or "cuda") can be created here: compiled
    into this extension and, for "cuda", the NVIDIA driver and a GPU present
    (``unavailable_reason`` says what is missing)."""
    if kind not in _KINDS:
        raise DeviceError(f"unknown device kind {kind!r}; expected {_KIND_LIST}")
    return bool(dm_device_available(_KINDS[kind]))


def unavailable_reason(kind: str) -> str:
    """Why ``available(kind)`` is False ("" when it is True)."""
    if available(kind):
        return ""
    return dm_last_error().decode("utf-8", "replace")


def size_class(nbytes: int) -> int:
    """Bytes the pool allocates for a request of ``nbytes`` (4 classes per power of two,
    at least 256)."""
    if nbytes < 0:
        raise DeviceError(f"negative buffer size {nbytes}")
    return dm_size_class(nbytes)


def shader_sources() -> list:
    """``(name, text)`` of every ``*.metal`` file in ``shader_dirs()``, with local
    ``#include "x.h"`` lines replaced by the header's text (a library compiled from a string
    has no include path)."""
    out = []
    for directory in shader_dirs():
        if not os.path.isdir(directory):
            continue
        for name in sorted(n for n in os.listdir(directory) if n.endswith(".metal")):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                text = f.read()
            out.append((name, _inline_includes(text, directory, name)))
    return out


def _inline_includes(text: str, directory: str, name: str, seen=None) -> str:
    """Replaces ``#include "x.h"`` lines by the header's text, recursively; a header already
    inlined in this source becomes an empty line (as its include guard would make it)."""
    if seen is None:
        seen = set()

    def replace(match):
        header = match.group(1)
        path = os.path.join(directory, header)
        if not os.path.isfile(path):
            raise DeviceError(f"{name}: included header {header!r} not found in {directory}")
        if header in seen:
            return ""
        seen.add(header)
        with open(path, encoding="utf-8") as f:
            return _inline_includes(f.read(), directory, header, seen)

    return _INCLUDE.sub(replace, text)


def metallib_path():
    """The precompiled ``darknet_metal.metallib`` next to this extension, or None."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "darknet_metal.metallib")
    return path if os.path.isfile(path) else None


def _dim3(value, what: str):
    t = (value,) if isinstance(value, int) else tuple(int(v) for v in value)
    if not 1 <= len(t) <= 3:
        raise DeviceError(f"{what} must have 1 to 3 dimensions, got {value!r}")
    t = t + (1,) * (3 - len(t))
    for v in t:
        if v < 1 or v > 0xFFFFFFFF:
            raise DeviceError(f"{what} {value!r}: every dimension must be in 1..2**32-1")
    return t


cdef class Device:
    """A compute device: ``Device("emu")`` (CPU emulator), ``Device("metal")`` (Apple GPU) or
    ``Device("cuda")`` (the same kernels on an NVIDIA GPU, for verification).

    ``emu_threads`` sets the emulator's host threads (<= 0: all cores). The emulator's thread
    order inside threadgroups starts from ``DARKNET_METAL_EMU_ORDER`` (forward, reverse,
    random, random:SEED) and can be changed with ``set_thread_order``.
    """

    def __cinit__(self, str kind="emu", *, int emu_threads=0):
        self._ptr = NULL
        if kind not in _KINDS:
            raise DeviceError(f"unknown device kind {kind!r}; expected {_KIND_LIST}")
        self.kind = kind
        cdef dm_device_options options
        memset(&options, 0, sizeof(options))
        options.emu_threads = emu_threads
        keep = []
        cdef const char **srcs = NULL
        cdef const char **names = NULL
        cdef const char **modules = NULL
        if kind == "emu" or (kind == "cuda" and dm_device_available(DM_DEVICE_CUDA)):
            # Compiled on first use (kernel_build); the CUDA driver takes the kernels' tables
            # from the emulator's library.
            library_bytes = os.fsencode(emu_library())
            keep.append(library_bytes)
            options.kernel_library = <const char *>library_bytes
        if kind == "cuda" and dm_device_available(DM_DEVICE_CUDA):
            paths = [os.fsencode(p) for p in cuda_modules()]
            if paths:
                modules = <const char **>malloc(len(paths) * sizeof(char *))
                if modules == NULL:
                    raise MemoryError()
                for i, path_bytes in enumerate(paths):
                    keep.append(path_bytes)
                    modules[i] = <const char *>path_bytes
                options.module_paths = modules
                options.n_modules = len(paths)
        if kind == "metal" and dm_device_available(DM_DEVICE_METAL):
            lib = metallib_path()
            if lib is not None:
                lib_bytes = os.fsencode(lib)
                keep.append(lib_bytes)
                options.metallib_path = <const char *>lib_bytes
            sources = shader_sources()
            if sources:
                srcs = <const char **>malloc(len(sources) * sizeof(char *))
                names = <const char **>malloc(len(sources) * sizeof(char *))
                if srcs == NULL or names == NULL:
                    free(srcs)
                    free(names)
                    raise MemoryError()
                for i, (name, text) in enumerate(sources):
                    name_bytes = name.encode()
                    text_bytes = text.encode()
                    keep.append(name_bytes)
                    keep.append(text_bytes)
                    names[i] = <const char *>name_bytes
                    srcs[i] = <const char *>text_bytes
                options.sources = srcs
                options.source_names = names
                options.n_sources = len(sources)
        try:
            _raise(dm_device_create(_KINDS[kind], &options, &self._ptr))
        finally:
            free(srcs)
            free(names)
            free(modules)

    def __dealloc__(self):
        if self._ptr != NULL:
            dm_device_destroy(self._ptr)
            self._ptr = NULL

    cdef int _check(self) except -1:
        if self._ptr == NULL:
            raise DeviceError(f"the {self.kind} device was closed")
        return 0

    def close(self) -> None:
        """Waits for pending work and frees the device; its buffers become unusable."""
        if self._ptr != NULL:
            dm_device_destroy(self._ptr)
            self._ptr = NULL

    @property
    def closed(self) -> bool:
        return self._ptr == NULL

    @property
    def info(self) -> dict:
        """Facts: name, unified_memory, recommended_working_set (bytes),
        max_threads_per_threadgroup, max_threadgroup_memory (bytes), apple7,
        simdgroup_matrix, page_size (bytes)."""
        self._check()
        cdef dm_device_info info
        _raise(dm_device_get_info(self._ptr, &info))
        return {
            "name": info.name.decode("utf-8", "replace"),
            "kind": self.kind,
            "unified_memory": bool(info.unified_memory),
            "recommended_working_set": info.recommended_working_set,
            "max_threads_per_threadgroup": info.max_threads_per_threadgroup,
            "max_threadgroup_memory": info.max_threadgroup_memory,
            "apple7": bool(info.apple7),
            "simdgroup_matrix": bool(info.simdgroup_matrix),
            "page_size": info.page_size,
        }

    @property
    def name(self) -> str:
        return self.info["name"]

    def stats(self) -> dict:
        """Counters and memory statistics (see ``dm_stats`` in shim/dm_shim.h); bytes are
        size-class bytes, encode_ns is host time spent encoding dispatches."""
        self._check()
        cdef dm_stats s
        _raise(dm_device_get_stats(self._ptr, &s))
        return {
            "kernels_dispatched": s.kernels_dispatched,
            "command_buffers_committed": s.command_buffers_committed,
            "waits": s.waits,
            "bytes_uploaded": s.bytes_uploaded,
            "bytes_downloaded": s.bytes_downloaded,
            "pool_hits": s.pool_hits,
            "pool_misses": s.pool_misses,
            "cpu_fallbacks": s.cpu_fallbacks,
            "pipelines_built": s.pipelines_built,
            "encode_ns": s.encode_ns,
            "allocated_bytes": s.allocated_bytes,
            "peak_allocated_bytes": s.peak_allocated_bytes,
            "live_buffers": s.live_buffers,
            "live_bytes": s.live_bytes,
            "pooled_buffers": s.pooled_buffers,
            "pooled_bytes": s.pooled_bytes,
            "peak_in_flight": s.peak_in_flight,
            "driver_copies": s.driver_copies,
            "driver_copy_bytes": s.driver_copy_bytes,
        }

    def profile_begin(self) -> None:
        """Starts timing every dispatch (after waiting for the work already committed);
        ``profile_end`` gives the times. DeviceError where the driver cannot time dispatches
        or a profile is already being taken."""
        self._check()
        cdef dm_device *ptr = self._ptr
        cdef int rc
        with nogil:
            rc = dm_profile_begin(ptr)
        _raise(rc)

    def profile_end(self) -> tuple:
        """Commits, waits and stops timing: ``(records, copies)``, ``records`` a list of
        ``(kernel name, tag, device ns)`` per dispatch since ``profile_begin`` in encode order,
        ``copies`` a dict of the driver's own host copies in the window (``bytes``, ``ns``,
        ``count``; CUDA's host synchronisation, zero on the other devices)."""
        self._check()
        cdef dm_device *ptr = self._ptr
        cdef const dm_profile_record *records = NULL
        cdef size_t n = 0
        cdef dm_profile_copies copies
        cdef int rc
        with nogil:
            rc = dm_profile_end(ptr, &records, &n, &copies)
        _raise(rc)
        out = [(records[i].kernel.decode(), records[i].tag, records[i].device_ns)
               for i in range(n)]
        return out, {"bytes": copies.bytes, "ns": copies.ns, "count": copies.count}

    @property
    def profiling(self) -> bool:
        """Whether a profile is being taken."""
        self._check()
        return bool(dm_profile_active(self._ptr))

    def reset_peak(self) -> None:
        """Restarts ``peak_allocated_bytes`` from the current allocation."""
        self._check()
        _raise(dm_device_reset_peak(self._ptr))

    def reset_counters(self) -> None:
        """Sets dispatch, commit, wait, byte, pool and fallback counters to zero."""
        self._check()
        _raise(dm_device_reset_counters(self._ptr))

    def empty_cache(self) -> None:
        """Frees every pooled (released) buffer; waits first if pending work uses one."""
        self._check()
        _raise(dm_device_empty_cache(self._ptr))

    def count_fallback(self, n: int = 1) -> None:
        """Records ``n`` layers run on the CPU instead of the device."""
        self._check()
        _raise(dm_device_count_fallback(self._ptr, n))

    def set_commit_every(self, n: int) -> None:
        """Commits the command buffer automatically every ``n`` dispatches (0: never)."""
        self._check()
        if n < 0:
            raise DeviceError(f"commit interval must be >= 0, got {n}")
        _raise(dm_device_set_commit_every(self._ptr, n))

    def set_thread_order(self, order: str, seed: int = 0) -> None:
        """Emulator only: run the threads of each group ``forward``, ``reverse`` or in a
        seeded ``random`` order between synchronisation points."""
        self._check()
        if order not in _ORDERS:
            raise DeviceError(f"unknown thread order {order!r}; expected one of {list(_ORDERS)}")
        if seed < 0:
            raise DeviceError(f"seed must be >= 0, got {seed}")
        _raise(dm_device_set_thread_order(self._ptr, _ORDERS[order], seed))

    @property
    def thread_order(self) -> tuple:
        """``(order, seed)`` in effect."""
        self._check()
        cdef int order = 0
        cdef uint64_t seed = 0
        _raise(dm_device_get_thread_order(self._ptr, &order, &seed))
        return _ORDER_NAMES[order], seed

    def commit(self) -> None:
        """Commits the current command buffer (end of a pass) without waiting."""
        self._check()
        _raise(dm_device_commit(self._ptr))

    def synchronize(self) -> None:
        """Commits and waits for all work; raises the first failure of that work. Other
        Python threads run meanwhile (the wait releases the GIL)."""
        self._check()
        cdef dm_device *ptr = self._ptr
        cdef int rc
        with nogil:
            rc = dm_device_synchronize(ptr)
        _raise(rc)

    def buffer(self, nbytes: int) -> Buffer:
        """An uninitialised buffer of ``nbytes`` bytes from the pool."""
        return Buffer(self, nbytes)

    def upload(self, array, *, zero_copy: bool = False) -> Buffer:
        """A buffer holding a copy of ``array`` (any dtype). With ``zero_copy`` and a
        page-aligned C-contiguous array, the buffer uses the array's memory instead (no copy;
        the device then reads and writes the array itself)."""
        arr = np.asarray(array)
        if zero_copy and is_page_aligned(arr, self.info["page_size"]):
            return Buffer.wrap(self, arr)
        arr = np.ascontiguousarray(arr)
        buf = Buffer(self, arr.nbytes)
        buf.write(arr)
        return buf

    def pipeline_info(self, name: str) -> dict:
        """Builds (once) the pipeline of kernel ``name``: max_total_threads,
        execution_width, static_tg_memory (bytes)."""
        self._check()
        cdef dm_pipeline *p = NULL
        _raise(dm_pipeline_get(self._ptr, name.encode(), &p))
        return {
            "name": dm_pipeline_name(p).decode(),
            "max_total_threads": dm_pipeline_max_threads(p),
            "execution_width": dm_pipeline_execution_width(p),
            "static_tg_memory": dm_pipeline_static_tg_memory(p),
        }

    def dispatch(
        self,
        kernel_name: str,
        args_bytes,
        buffers,
        grid,
        threadgroup,
        threadgroup_mem=(),
        *,
        mode: str = "threads",
        offsets=None,
        tag: int = 0,
    ) -> None:
        """Encodes kernel ``kernel_name`` into the current command buffer.

        ``args_bytes`` (bytes-like, or None) is bound at buffer index 0 by value;
        ``buffers[i]`` (Buffer or None for unbound) at index i + 1 (index i when there are
        no argument bytes), with ``offsets[i]`` bytes. ``grid`` counts threads
        (``mode="threads"``, dispatchThreads) or threadgroups (``mode="threadgroups"``);
        ``threadgroup`` is threads per group (1-3 dims); ``threadgroup_mem[i]`` is the byte
        length of ``[[threadgroup(i)]]`` memory. ``tag`` (0 to 2**64 - 1) labels the
        dispatch in profiles (``profile_end``). Nothing runs until a commit and a wait.
        """
        self._check()
        _submit(self, NULL, kernel_name, args_bytes, buffers, grid, threadgroup,
                threadgroup_mem, mode, offsets, _tag(tag))

    def dispatch_list(self, capacity: int = 0) -> DispatchList:
        """An empty prepared dispatch list for this device (``capacity``: dispatches to make
        room for; it grows as needed). See ``DispatchList``."""
        return DispatchList(self, capacity)

    def __repr__(self) -> str:
        if self._ptr == NULL:
            return f"<Device {self.kind} (closed)>"
        return f"<Device {self.kind}: {self.name}>"


def _tag(tag) -> int:
    if not isinstance(tag, int) or not 0 <= tag < 2**64:
        raise DeviceError(f"a dispatch tag is an integer in [0, 2**64), got {tag!r}")
    return tag


cdef int _submit(Device dev, dm_dispatch_list *dlist, kernel_name, args_bytes, buffers, grid,
                 threadgroup, threadgroup_mem, mode, offsets, uint64_t tag) except -1:
    """Checks one dispatch's Python arguments, builds its descriptor and encodes it
    (``dlist`` NULL) or adds it to the dispatch list ``dlist``."""
    if mode not in _MODES:
        raise DeviceError(f"unknown dispatch mode {mode!r}; expected 'threads' or "
                          "'threadgroups'")
    g = _dim3(grid, "grid")
    t = _dim3(threadgroup, "threadgroup")
    tgm = tuple(int(v) for v in threadgroup_mem)
    if len(tgm) > DM_MAX_TG_MEMORY_ARGS:
        raise DeviceError(f"{len(tgm)} threadgroup memory lengths; at most "
                          f"{DM_MAX_TG_MEMORY_ARGS}")
    for v in tgm:
        if v < 0 or v > 0xFFFFFFFF:
            raise DeviceError(f"threadgroup memory length {v} out of range")
    args = b"" if args_bytes is None else bytes(args_bytes)
    bufs = list(buffers)
    if offsets is not None and len(offsets) != len(bufs):
        raise DeviceError(f"{len(offsets)} offsets for {len(bufs)} buffers")
    for i, b in enumerate(bufs):
        if b is not None and not isinstance(b, Buffer):
            raise DeviceError(f"kernel {kernel_name!r}: buffers[{i}] is a "
                              f"{type(b).__name__}, not a Buffer")
        if b is not None and (<Buffer>b).device is not dev:
            raise DeviceError(f"kernel {kernel_name!r}: buffers[{i}] belongs to another "
                              "device")
        if b is not None and (<Buffer>b)._ptr == NULL:
            raise DeviceError(f"kernel {kernel_name!r}: buffers[{i}] was released")
    cdef dm_pipeline *p = NULL
    _raise(dm_pipeline_get(dev._ptr, kernel_name.encode(), &p))
    cdef int n = len(bufs)
    cdef dm_buffer **handles = <dm_buffer **>malloc(max(n, 1) * sizeof(dm_buffer *))
    cdef size_t *offs = <size_t *>malloc(max(n, 1) * sizeof(size_t))
    if handles == NULL or offs == NULL:
        free(handles)
        free(offs)
        raise MemoryError()
    cdef dm_dispatch_desc desc
    cdef const unsigned char *args_ptr = args
    try:
        for i in range(n):
            handles[i] = NULL
            if bufs[i] is not None:
                handles[i] = (<Buffer>bufs[i])._ptr
            offs[i] = 0 if offsets is None else int(offsets[i])
        memset(&desc, 0, sizeof(desc))
        desc.args = args_ptr if len(args) else NULL
        desc.args_size = len(args)
        desc.buffers = handles
        desc.offsets = offs
        desc.n_buffers = n
        desc.first_buffer_index = 1 if len(args) else 0
        for i in range(3):
            desc.grid[i] = g[i]
            desc.group[i] = t[i]
        desc.mode = _MODES[mode]
        for i, v in enumerate(tgm):
            desc.tg_memory[i] = v
        desc.n_tg_memory = len(tgm)
        desc.tag = tag
        if dlist == NULL:
            _raise(dm_dispatch(dev._ptr, p, &desc))
        else:
            _raise(dm_dispatch_list_add(dlist, p, &desc))
    finally:
        free(handles)
        free(offs)
    return 0


# A dispatch list keeps the buffers it names until its own deallocation (the shim holds them
# until then): the garbage collector must not drop them first.
@cython.no_gc_clear
cdef class DispatchList:
    """A prepared dispatch list: dispatches checked and packed once by ``add``, then encoded
    together, in order, by each ``encode`` (one call into the shim instead of one per
    dispatch). Counters, commits and waits are those of the same ``Device.dispatch`` calls.

    The dispatch list keeps every buffer it binds alive. Releasing one of them explicitly
    makes ``encode`` raise DeviceError (nothing is encoded); its memory returns to the pool
    when the dispatch list is closed. ``close()`` (or garbage collection) frees the dispatch
    list.
    """

    def __cinit__(self, Device device, int capacity=0):
        self._ptr = NULL
        self.device = device
        self._buffers = []
        self._buffer_ids = set()
        device._check()
        if capacity < 0:
            raise DeviceError(f"dispatch list capacity must be >= 0, got {capacity}")
        _raise(dm_dispatch_list_create(device._ptr, capacity, &self._ptr))

    def __dealloc__(self):
        # Safe in any order with the device: a destroyed device detaches its dispatch lists.
        if self._ptr != NULL:
            dm_dispatch_list_destroy(self._ptr)
            self._ptr = NULL

    cdef int _ok(self) except -1:
        if self._ptr == NULL:
            raise DeviceError("the dispatch list was closed")
        self.device._check()
        return 0

    def add(
        self,
        kernel_name: str,
        args_bytes,
        buffers,
        grid,
        threadgroup,
        threadgroup_mem=(),
        *,
        mode: str = "threads",
        offsets=None,
        tag: int = 0,
    ) -> None:
        """Appends one dispatch; the arguments are those of ``Device.dispatch`` and are
        checked the same way, now. The argument bytes are copied."""
        self._ok()
        bufs = list(buffers)
        _submit(self.device, self._ptr, kernel_name, args_bytes, bufs, grid, threadgroup,
                threadgroup_mem, mode, offsets, _tag(tag))
        for b in bufs:
            if b is not None and id(b) not in self._buffer_ids:
                self._buffer_ids.add(id(b))
                self._buffers.append(b)

    def encode(self) -> None:
        """Encodes every dispatch, in order, into the device's current command buffer."""
        self._ok()
        _raise(dm_dispatch_list_encode(self.device._ptr, self._ptr))

    def close(self) -> None:
        """Frees the dispatch list and lets go of its buffers."""
        if self._ptr != NULL:
            dm_dispatch_list_destroy(self._ptr)
            self._ptr = NULL
        self._buffers = []
        self._buffer_ids = set()

    @property
    def closed(self) -> bool:
        return self._ptr == NULL

    def __len__(self) -> int:
        return dm_dispatch_list_size(self._ptr)

    def __repr__(self) -> str:
        if self._ptr == NULL:
            return "<DispatchList (closed)>"
        return (f"<DispatchList of {dm_dispatch_list_size(self._ptr)} dispatches on "
                f"{self.device.kind}>")


def is_page_aligned(array, page_size: int) -> bool:
    """True if ``array`` is C-contiguous and starts on a page boundary."""
    arr = np.asarray(array)
    return bool(arr.flags["C_CONTIGUOUS"]) and arr.nbytes > 0 and (
        arr.__array_interface__["data"][0] % page_size == 0
    )


def aligned_empty(shape, dtype=np.float32, page_size: int = 16384) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a ``page_size`` boundary
    (16 KiB: the page size of Apple-silicon macOS, a multiple of 4 KiB), so
    ``Device.upload(..., zero_copy=True)`` can use it without a copy."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.empty(count * dt.itemsize + page_size, dtype=np.uint8)
    start = (-raw.__array_interface__["data"][0]) % page_size
    return raw[start:start + count * dt.itemsize].view(dt).reshape(shape)


# A wrapped buffer's array must outlive the release in __dealloc__, which waits for work
# that still copies into it: the garbage collector must not drop the array first.
@cython.no_gc_clear
cdef class Buffer:
    """Device memory (shared with the host). ``Buffer(device, nbytes)`` comes from the pool;
    ``Buffer.wrap(device, array)`` uses a page-aligned array's memory without a copy.
    Reads wait for the device work that uses the buffer; ``release()`` returns it to the
    pool (also on garbage collection)."""

    def __cinit__(self, Device device, size_t nbytes=0, *, bint _wrap=False):
        self._ptr = NULL
        self.device = device
        self._host = None
        if _wrap:
            return
        device._check()
        _raise(dm_buffer_create(device._ptr, nbytes, &self._ptr))

    @staticmethod
    def wrap(Device device, array) -> Buffer:
        """Zero-copy buffer over ``array`` (C-contiguous, page-aligned, writeable); the
        array is kept alive by the buffer. Raises DeviceError if it cannot be wrapped."""
        device._check()
        arr = np.asarray(array)
        if not arr.flags["C_CONTIGUOUS"] or not arr.flags["WRITEABLE"]:
            raise DeviceError("only C-contiguous writeable arrays can be wrapped without a copy")
        cdef Buffer buf = Buffer.__new__(Buffer, device, 0, _wrap=True)
        cdef size_t address = arr.__array_interface__["data"][0]
        _raise(dm_buffer_wrap(device._ptr, <void *>address, arr.nbytes, &buf._ptr))
        buf._host = arr
        return buf

    cdef int _ok(self) except -1:
        if self._ptr == NULL:
            raise DeviceError("the buffer was released")
        self.device._check()
        return 0

    def __dealloc__(self):
        if self._ptr != NULL and self.device is not None and self.device._ptr != NULL:
            dm_buffer_release(self._ptr)
        self._ptr = NULL

    def release(self) -> None:
        """Returns the buffer to the device's pool (a wrapped buffer waits for pending work
        that uses the array)."""
        if self._ptr != NULL and self.device._ptr != NULL:
            dm_buffer_release(self._ptr)
        self._ptr = NULL
        self._host = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    @property
    def nbytes(self) -> int:
        self._ok()
        return dm_buffer_size(self._ptr)

    @property
    def capacity(self) -> int:
        """Bytes actually allocated (the size class)."""
        self._ok()
        return dm_buffer_capacity(self._ptr)

    @property
    def wrapped(self) -> bool:
        self._ok()
        return bool(dm_buffer_is_wrapped(self._ptr))

    @property
    def address(self) -> int:
        """Host address of the contents (for zero-copy checks)."""
        self._ok()
        return <size_t>dm_buffer_contents(self._ptr)

    def write(self, array, offset: int = 0) -> None:
        """Copies ``array``'s bytes into the buffer at byte ``offset`` (waits first if
        queued work uses the buffer)."""
        self._ok()
        arr = np.ascontiguousarray(array)
        cdef const unsigned char[::1] view = arr.reshape(-1).view(np.uint8)
        cdef const void *src = &view[0] if view.shape[0] else NULL
        _raise(dm_buffer_write(self._ptr, offset, src, view.shape[0]))

    def read(self, dtype=np.float32, shape=None, offset: int = 0) -> np.ndarray:
        """A new array with the contents from byte ``offset``: ``shape`` elements of
        ``dtype`` (default: all remaining whole elements). Waits for the device."""
        self._ok()
        dt = np.dtype(dtype)
        if shape is None:
            shape = ((dm_buffer_size(self._ptr) - offset) // dt.itemsize,)
        out = np.empty(shape, dtype=dt)
        self.read_into(out, offset)
        return out

    def read_into(self, out, offset: int = 0) -> None:
        """Copies ``out.nbytes`` bytes from byte ``offset`` into the C-contiguous array
        ``out``. Waits for the device."""
        self._ok()
        if not out.flags["C_CONTIGUOUS"] or not out.flags["WRITEABLE"]:
            raise DeviceError("read_into needs a C-contiguous writeable array")
        cdef unsigned char[::1] view = out.reshape(-1).view(np.uint8)
        cdef void *dst = &view[0] if view.shape[0] else NULL
        cdef dm_buffer *ptr = self._ptr
        cdef size_t at = offset
        cdef size_t n = view.shape[0]
        cdef int rc
        with nogil:  # the wait for the device lets other Python threads run
            rc = dm_buffer_read(ptr, at, dst, n)
        _raise(rc)

    def sync(self, *, write: bool = False) -> None:
        """Waits for the device work that uses this buffer and makes a wrapped array
        current for the host; with ``write``, the host may then change the array, and the
        device sees the changes from its next dispatch that uses it (change it before
        that)."""
        self._ok()
        cdef dm_buffer *ptr = self._ptr
        cdef int rc
        cdef bint for_write = write
        with nogil:  # the wait for the device lets other Python threads run
            rc = dm_buffer_sync_write(ptr) if for_write else dm_buffer_sync(ptr)
        _raise(rc)

    def set_resident(self) -> None:
        """The device may keep this wrapped array (and every wrap sharing its memory) in
        memory of its own between uses: the host sees the device's changes after ``sync()``
        and the device sees the host's after ``sync(write=True)``, nothing is copied
        otherwise. Where the device uses host memory in place, nothing changes."""
        self._ok()
        _raise(dm_buffer_set_resident(self._ptr))

    def flush(self, offset: int, nbytes: int) -> None:
        """The host wrote bytes [offset, offset + nbytes) of this resident wrapped array
        (after ``sync()``): a device with memory of its own starts copying them now, before
        the work committed next, while the host goes on writing the rest. Nothing to do
        where the device uses host memory in place. DeviceError (kind "invalid") for a range
        outside the buffer or a buffer that does not wrap an array."""
        self._ok()
        if offset < 0 or nbytes < 0:
            raise DeviceError(f"flush: offset {offset} and nbytes {nbytes} must be >= 0")
        _raise(dm_buffer_flush(self._ptr, offset, nbytes))

    def __repr__(self) -> str:
        if self._ptr == NULL:
            return "<Buffer (released)>"
        return f"<Buffer {dm_buffer_size(self._ptr)} bytes on {self.device.kind}>"
