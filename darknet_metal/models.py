"""Former home of the bundled models and their weights cache: ``darknet_metal.model.bundled``.

Kept for one release so that ``import darknet_metal.models`` keeps working; it warns once and
hands on every public name of ``darknet_metal.model.bundled``.
"""

import warnings

from darknet_metal.model.bundled import *  # noqa: F403
from darknet_metal.model.bundled import __all__  # noqa: F401

warnings.warn("darknet_metal.models is now darknet_metal.model.bundled; the old path goes "
              "in the next release", DeprecationWarning, stacklevel=2)
