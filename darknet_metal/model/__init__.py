"""A network's description as files hold it: the cfg parser and its key schema, the
activation names, ``.weights`` reading and writing, the bundled models and their weights
cache, and the layer table ``summary`` prints.

Owns: what a Darknet network *is* on disk, before anything runs. May import: ``errors``,
``files``, ``arguments`` (nothing that computes: the ops, executors and devices sit above it;
where it needs a layer's attributes it names them in a protocol, as ``weights.StoredLayer``).
"""
