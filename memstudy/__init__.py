"""memstudy: measure and compose GPU-memory techniques for training on very large images."""
__version__ = "0.1.0"
