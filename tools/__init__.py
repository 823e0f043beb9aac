"""Project tooling: the tested Python behind ``scripts/`` (not part of the installed package).

- :mod:`.stages`: run named stages with time limits, record each as it ends;
- :mod:`.gpu_check`: ``scripts/gpu-check``, the check on a real GPU machine;
- :mod:`.image_test`: ``scripts/image-test``, builds the images and runs them (the engine
  in :mod:`.oci`, what it concludes in :mod:`.image_checks`);
- :mod:`.locks`: reading the hash-locked requirement files.

Everything here uses the standard library only: ``gpu_check`` runs with whatever Python
a bare GPU machine has.
"""
