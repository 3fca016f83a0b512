"""The built-in codecs, one module per codec family: each declares its recipe config class, its kernel
constraints and capabilities, and registers its spec (moec/registry.py) in its own module, naming its
calibration and runtime halves (calibrate/<family>.py, runtime/<family>.py) by "module:attribute"
strings that are resolved on first use.

These modules import nothing but the standard library, moec.errors, moec.formats and moec.registry, so
that the runtime can read a codec's config class (a packed manifest's `kv` section is built through it)
without importing any calibration code. moec/registry.py imports every module of this package at its
first lookup; nothing lists them.
"""
