"""Offline side: model sources, data, layer-sequential capture, fitting functions, recipes, packing.

The only package (with moec.cli) that imports transformers and datasets.
"""
