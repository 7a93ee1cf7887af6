"""The ``commwire`` command line (click)."""

from .main import cli, main

__all__ = ["cli", "main"]
