"""The kernel table, one module per shader file: ``kernels/<family>.py`` declares the kernels
of ``shaders/<family>.metal``, forward and backward.

Each module exports ``SOURCE`` (its ``.metal`` file name), ``KERNELS`` (its float32 kernels,
as ``darknet_metal.metal.kernel_spec.Kernel``) and ``HALF_TWINS`` (those of its forward
kernels that the shader also instantiates for half storage). ``darknet_metal.metal.registry``
assembles them; ``shorthand`` holds what the tables share.

Owns: what each kernel binds, with which extents and grid. May import: ``metal.kernel_spec``
(the description language), ``model`` (activation ids), ``errors``.
"""
