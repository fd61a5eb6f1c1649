"""Former home of the activation names and ids: ``darknet_metal.model.activations``.

Kept for one release so that ``import darknet_metal.activations`` keeps working; it warns once and
hands on every public name of ``darknet_metal.model.activations``.
"""

import warnings

from darknet_metal.model.activations import *  # noqa: F403
from darknet_metal.model.activations import __all__  # noqa: F401

warnings.warn("darknet_metal.activations is now darknet_metal.model.activations; the old path goes "
              "in the next release", DeprecationWarning, stacklevel=2)
