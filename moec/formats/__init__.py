"""Bit packing, the packed checkpoint (manifest + safetensors) and format enums.

Imports neither moec.runtime nor moec.calibrate: a reader of the format needs only this package.
"""
