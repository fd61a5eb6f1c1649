"""Running programs: the program vocabulary layers emit into (``program``: tensors, kernel and
host steps), the memory planner (``memory``), the training arrays programs bind
(``train_state``), what the executors need of a layer (``layer.Layer``) and of each other
(``backend``), the CPU executor (``cpu_backend``), the GPU executor (``gpu_backend``, with its
pass rings in ``pass_ring``) and the kept training programs (``plans``).

Owns: how a pass or a training step runs on a device, whatever the layers are. May import:
``errors``, ``model``, ``cpu`` (the native steps) and ``metal`` (the shim and the kernel
registry); never ``ops`` (layers reach it through the ``Layer`` protocol) nor anything above.
"""
