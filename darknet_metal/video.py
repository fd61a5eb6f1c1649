"""Former home of video files through a detection stream: ``darknet_metal.inference.video``.

Kept for one release so that ``import darknet_metal.video`` keeps working; it warns once and
hands on every public name of ``darknet_metal.inference.video``.
"""

import warnings

from darknet_metal.inference.video import *  # noqa: F403
from darknet_metal.inference.video import __all__  # noqa: F401

warnings.warn("darknet_metal.video is now darknet_metal.inference.video; the old path goes in "
              "the next release", DeprecationWarning, stacklevel=2)
