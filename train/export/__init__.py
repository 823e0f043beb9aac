"""The export: a run's model as plain files usable without this trainer, and back.

- :mod:`.writing`: the newest valid checkpoint's (or step-N's) weights and ``model.json``
  (``python -m train.export RUN_DIR``, :mod:`.__main__`);
- :mod:`.loading`: :func:`load_model`, the model rebuilt from an export;
- :mod:`.layout`: the files' names and formats (``model.pt``, ``model.safetensors``,
  save_pretrained's layout) and ``model.json``'s text;
- :mod:`.safetensors_io`: the safetensors format, read and written with torch alone;
- :mod:`.tokenizer`: the tokenizer a run's token files were made with, for ``AutoTokenizer``.

``from train.export import load_model`` is the API documented in docs/your-code.md.
"""

from train.export.loading import load_model
from train.export.writing import export

__all__ = ["export", "load_model"]
