"""The Metal path: device queries, memory statistics and counters (``darknet_metal.metal``).

Every function takes ``device``: ``"metal"`` (the Apple GPU, macOS builds), ``"emu"`` (the
CPU emulator of the Metal compute model that runs the same kernels on any OS) or ``"cuda"``
(the same Metal kernels translated to CUDA and run on an NVIDIA GPU: a verification device
for the kernels' results, whose results and speed are not an Apple GPU's; available only
where the CUDA driver, an NVIDIA GPU and a build with the translated kernels are present).
One device of each kind is shared by the whole process: networks loaded with
``device="emu"`` and these functions see the same pool, counters and command stream.

Memory figures are bytes the driver holds (buffers in use plus buffers kept in the pool for
reuse), rounded to the pool's size classes.

Owns: the shim (``_shim``, private to this package), the kernel registry and the packing
of dispatches. May import: ``errors``, ``model`` (activation ids).
"""

from __future__ import annotations

import threading
from typing import Any

from darknet_metal.errors import DeviceError

__all__ = [
    "aligned_empty",
    "device_info",
    "device_lock",
    "device_name",
    "empty_cache",
    "get_device",
    "is_available",
    "max_memory_allocated",
    "memory_allocated",
    "recommended_max_memory",
    "reset_peak_memory_stats",
    "stats",
    "synchronize",
]

KINDS = ("metal", "emu", "cuda")

_devices: dict[str, Any] = {}
_creating = threading.Lock()
# One command stream per device: a pass encodes, commits and waits on it as a whole.
_device_locks = {kind: threading.RLock() for kind in KINDS}

_UNAVAILABLE_METAL = (
    "device 'metal' is not available: {why}. Metal needs macOS on Apple silicon; use "
    "device='emu' to run the same Metal kernels in the CPU emulator, or use 'cpu' for the "
    "CPU reference"
)
_UNAVAILABLE_CUDA = (
    "device 'cuda' is not available: {why}. It needs an NVIDIA GPU with its driver and a "
    "build made where nvcc was found; use device='emu' to run the same kernels in the CPU "
    "emulator"
)


def _load_shim() -> Any:
    try:
        from darknet_metal.metal import _shim
    except ImportError as e:
        raise DeviceError(
            f"the Metal shim extension is not built ({e}); build it with `pip install -e .` or "
            "`python setup.py build_ext --inplace`, or use device='cpu'"
        ) from None
    return _shim


def aligned_empty(shape: tuple[int, ...], dtype: Any, alignment: int) -> Any:
    """An uninitialised host array of ``shape`` and ``dtype`` whose data starts on an
    ``alignment``-byte boundary (a page, for arrays a device uses in place)."""
    return _load_shim().aligned_empty(shape, dtype, alignment)


def get_device(device: str = "metal") -> Any:
    """The process-wide ``darknet_metal.metal._shim.Device`` of kind ``device``, created on
    first use. Raises DeviceError if that kind is unknown or not available here."""
    if device not in KINDS:
        raise DeviceError(f"unknown device {device!r}; expected one of {', '.join(KINDS)}")
    found = _devices.get(device)
    if found is not None and not found.closed:
        return found
    with _creating:
        found = _devices.get(device)
        if found is not None and not found.closed:
            return found
        return _create(device)


def device_lock(device: str) -> threading.RLock:
    """The lock that serialises work on the process-wide device ``device``: a network's
    forward pass holds it from encoding to reading its outputs back, so passes of different
    networks on one device never interleave on its command stream."""
    if device not in KINDS:
        raise DeviceError(f"unknown device {device!r}; expected one of {', '.join(KINDS)}")
    return _device_locks[device]


def _shim_available(shim: Any, device: str) -> tuple[bool, str | None]:
    """``(shim.available(device), None)``, or ``(False, why)`` when the shim raises (an
    extension built before the kind existed does not know it)."""
    try:
        return bool(shim.available(device)), None
    except Exception as e:
        return False, (f"the shim extension was built without the {device!r} kind ({e}); "
                       "rebuild it")


def _cuda_unavailable(shim: Any) -> DeviceError:
    """The DeviceError for an unavailable "cuda" device, with the shim's reason: creating
    the device anyway says what is missing (driver library, GPU or translated kernels)."""
    why = "the shim reports no usable cuda device"
    try:
        created = shim.Device("cuda")
    except Exception as e:  # the shim's reason, whatever it raised
        why = str(e).strip() or why
    else:
        # Created although reported unavailable: do not keep it.
        created.close()
    return DeviceError(_UNAVAILABLE_CUDA.format(why=why))


def _create(device: str) -> Any:
    shim = _load_shim()
    available, unknown = _shim_available(shim, device)
    if not available:
        if device == "cuda":
            if unknown is not None:
                raise DeviceError(_UNAVAILABLE_CUDA.format(why=unknown))
            raise _cuda_unavailable(shim)
        if device == "metal":
            why = unknown or "this build has no Metal driver"
            raise DeviceError(_UNAVAILABLE_METAL.format(why=why))
        raise DeviceError(unknown or f"device {device!r} is not compiled into this build")
    try:
        created = shim.Device(device)
    except DeviceError as e:
        if device == "metal":
            raise DeviceError(_UNAVAILABLE_METAL.format(why=str(e))) from None
        if device == "cuda":
            raise DeviceError(_UNAVAILABLE_CUDA.format(why=str(e))) from None
        raise
    _devices[device] = created
    return created


def is_available(device: str = "metal") -> bool:
    """True if a device of this kind can be used in this process."""
    try:
        get_device(device)
    except DeviceError:
        return False
    return True


def device_name(device: str = "metal") -> str:
    """The device's name (the GPU's, or the emulator's with its host thread count)."""
    return str(get_device(device).info["name"])


def device_info(device: str = "metal") -> dict[str, Any]:
    """Device facts: name, unified_memory, recommended_working_set (bytes),
    max_threads_per_threadgroup, max_threadgroup_memory (bytes), apple7, simdgroup_matrix,
    page_size (bytes)."""
    return dict(get_device(device).info)


def recommended_max_memory(device: str = "metal") -> int:
    """Bytes the device recommends as its working set (Metal's
    ``recommendedMaxWorkingSetSize``; 0 when the emulator sets no limit)."""
    return int(get_device(device).info["recommended_working_set"])


def memory_allocated(device: str = "metal") -> int:
    """Bytes the driver currently holds: buffers in use plus pooled ones."""
    return int(get_device(device).stats()["allocated_bytes"])


def max_memory_allocated(device: str = "metal") -> int:
    """Peak of ``memory_allocated`` since the device was created or the last
    ``reset_peak_memory_stats``."""
    return int(get_device(device).stats()["peak_allocated_bytes"])


def reset_peak_memory_stats(device: str = "metal") -> None:
    """Restarts ``max_memory_allocated`` from the current allocation."""
    get_device(device).reset_peak()


def empty_cache(device: str = "metal") -> None:
    """Frees the pooled buffers (those no network or array is using)."""
    get_device(device).empty_cache()


def synchronize(device: str = "metal") -> None:
    """Commits pending work and waits until the device has finished all of it."""
    get_device(device).synchronize()


def stats(device: str = "metal") -> dict[str, int]:
    """Counters since the device was created: ``kernels_dispatched``,
    ``command_buffers_committed``, ``waits`` (host waits for the device),
    ``bytes_uploaded``/``bytes_downloaded``, ``pool_hits``/``pool_misses`` (buffer requests
    served from the pool / newly allocated), ``cpu_fallbacks`` (layers run on the CPU),
    ``pipelines_built``, ``encode_ns`` (host nanoseconds spent encoding dispatches, one by one
    or as prepared lists), ``peak_in_flight`` (most command buffers committed and not yet
    waited for at once; reset to the current number by ``reset_counters``), and memory:
    ``allocated_bytes``, ``peak_allocated_bytes``, ``live_buffers``, ``live_bytes``,
    ``pooled_buffers``, ``pooled_bytes``."""
    return {k: int(v) for k, v in get_device(device).stats().items()}
