"""Metal path: kernel registry (and, once built, the shim wrapper)."""
