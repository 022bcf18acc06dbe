"""flashsgd: large-minibatch, massively data-parallel synchronous SGD on PyTorch."""

__version__ = "0.1.0"
