"""Container-first, reproducible PyTorch training.

Importing the package is cheap (no torch): the launcher validates configs with
:mod:`train.core.config` before any worker starts.
"""

__version__ = "0.1.0"
