"""Training data: Darknet's detection loading and augmentation, batches made by workers.

- :func:`settings_from_cfg` / :class:`LoaderSettings`: the cfg values that decide loading;
- :class:`Loader`: batches ``(x, truths)`` per iteration, prepared ahead by worker threads,
  reproducible from a seed whatever the number of workers;
- :func:`load_batch`: the same batch made in the calling thread;
- :func:`random_size`: ``random=1``'s input size for an iteration.

Owns: turning dataset samples into training batches. May import: ``errors``, ``model``,
``ops`` (which keys an op leaves to the loader), ``trainer.keys``, ``datasets`` and
``inference``; nothing of networks or their executors.
"""

from .batch import Batch, SampleSource, load_batch, load_slot
from .loader import Loader
from .settings import LoaderSettings, settings_from_cfg
from .sizes import random_size

__all__ = [
    "Batch",
    "Loader",
    "LoaderSettings",
    "SampleSource",
    "load_batch",
    "load_slot",
    "random_size",
    "settings_from_cfg",
]
