"""Training: Darknet's learning-rate schedule (``schedule``), what training does with each cfg
key (``keys``); the parameter updates are native steps in ``darknet_metal.cpu.update``."""

from darknet_metal.training.schedule import learning_rate

__all__ = ["learning_rate"]
