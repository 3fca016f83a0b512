"""moec: offline compression of Mixture-of-Experts language models, with a small Triton runtime."""

__version__ = "0.1.0"
