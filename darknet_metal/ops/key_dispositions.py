"""The words an op uses for what training does with each of its kind's cfg keys.

Each op lists its kind's keys in ``training_keys`` (key -> one of these, or the reason a
non-default value is refused); ``darknet_metal.trainer.keys`` tables the ``[net]`` keys and
those every layer takes, and checks a cfg against both when training starts.

- ``IMPLEMENTED``: training does what Darknet does with it;
- ``REFUSED``: not implemented; a value other than the default raises ``CfgError`` at the
  key's line, with the reason;
- ``DATA``: read by the data loader (augmentation, image sizes), not by a training step on
  prepared batches;
- ``NO_EFFECT``: a setting of Darknet's CUDA build or its console output that changes no
  number (memory limits, CUDA graphs, chart scale), accepted and ignored;
- ``INFERENCE_ONLY``: a key that only changes inference.
"""

IMPLEMENTED = "implemented"
REFUSED = "refused"
DATA = "data"
NO_EFFECT = "no effect"
INFERENCE_ONLY = "inference only"
