"""One iteration of training a network: ``Trainer`` (mini-batches forward and backward, then
the update), Darknet's learning-rate schedule (``schedule``) and what training does with each
cfg key (``keys``). ``Network``'s training calls are conveniences over it; a training run
(``darknet_metal.training``) drives it.

Owns: what changes a network's parameters in one step. May import: ``errors``, ``arguments``,
``model``, ``ops``, ``runtime``, ``cpu``; a network is reached only through
``trainer.TrainableNetwork``.
"""

from darknet_metal.trainer.schedule import learning_rate
from darknet_metal.trainer.trainer import Gradients, StepReport, Trainer

__all__ = ["Gradients", "StepReport", "Trainer", "learning_rate"]
