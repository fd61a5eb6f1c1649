"""Former home of the cfg parser: ``darknet_metal.model.cfg``.

Kept for one release so that ``import darknet_metal.cfg`` keeps working; it warns once and
hands on every public name of ``darknet_metal.model.cfg``.
"""

import warnings

from darknet_metal.model.cfg import *  # noqa: F403
from darknet_metal.model.cfg import __all__  # noqa: F401

warnings.warn("darknet_metal.cfg is now darknet_metal.model.cfg; the old path goes "
              "in the next release", DeprecationWarning, stacklevel=2)
