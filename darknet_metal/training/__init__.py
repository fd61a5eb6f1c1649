"""Training runs: the data loader (``loading``), checkpoints, the training run and its command
(``session``, ``run``, ``cli``, ``from_model``, ``cfg_command``), its progress output
(``progress``) and training across processes (``distributed``). One iteration of a network
is ``darknet_metal.trainer``'s, below the network.

Owns: a run that trains a network over a dataset. May import: ``errors``, ``files``,
``arguments``, ``model``, ``ops``, ``runtime``, ``cpu``, ``inference`` (images and boxes),
``datasets``, ``evaluation``, ``trainer``, and ``network`` (to load the network a run trains).
"""
