"""Former home of training data loading and augmentation: ``darknet_metal.training.loading``.

Kept for one release so that ``import darknet_metal.loading`` keeps working; it warns once and
hands on every public name of ``darknet_metal.training.loading``.
"""

import warnings

from darknet_metal.training.loading import *  # noqa: F403
from darknet_metal.training.loading import __all__  # noqa: F401

warnings.warn("darknet_metal.loading is now darknet_metal.training.loading; the old path goes "
              "in the next release", DeprecationWarning, stacklevel=2)
