"""Former home of Darknet's JSON detection output: ``darknet_metal.inference.detection_json``.

Kept for one release so that ``import darknet_metal.detection_json`` keeps working; it warns
once and hands on every public name of ``darknet_metal.inference.detection_json``.
"""

import warnings

from darknet_metal.inference.detection_json import *  # noqa: F403
from darknet_metal.inference.detection_json import __all__  # noqa: F401

warnings.warn("darknet_metal.detection_json is now darknet_metal.inference.detection_json; "
              "the old path goes in the next release", DeprecationWarning, stacklevel=2)
