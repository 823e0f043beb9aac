"""The image's launcher: detect hardware, plan the torchrun invocation, run it.

``entrypoint.py`` dispatches here. Nothing in this package imports torch at module
import time (``entrypoint.py --help`` must answer at once), and the parent process
never initialises CUDA or HIP: hardware is found through NVML, amd-smi/rocm-smi and
sysfs, and torch is imported lazily only to read what the installed build supports.
"""
