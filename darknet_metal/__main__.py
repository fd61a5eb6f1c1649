"""``python -m darknet_metal``: the ``darknet-metal`` command line."""

import sys

from darknet_metal.cli import main

sys.exit(main())
