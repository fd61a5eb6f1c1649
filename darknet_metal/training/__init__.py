"""Training: ``Trainer`` (one iteration of a network: mini-batches forward and backward, then
the update), Darknet's learning-rate schedule (``schedule``), what training does with each
cfg key (``keys``), the data loader (``loading``), checkpoints, the training run and its
command (``session``, ``run``, ``cli``) and training across processes (``distributed``).

Owns: everything that changes a network's parameters. May import: ``errors``, ``files``,
``arguments``, ``model``, ``ops``, ``runtime``, ``cpu``, ``inference`` (images and boxes),
``datasets``, ``evaluation``, and ``network`` (to load the network a run trains; the trainer
reaches a network only through ``trainer.TrainableNetwork``).
"""

from darknet_metal.training.schedule import learning_rate
from darknet_metal.training.trainer import Gradients, StepReport, Trainer

__all__ = ["Gradients", "StepReport", "Trainer", "learning_rate"]
