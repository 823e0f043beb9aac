"""The model room: what a run trains and how it learns, built from the config.

- :mod:`.builtin`: the built-in kinds (mlp, cnn, gpt) and the user's factory
  (``model.kind: custom``), pure: a config in, an ``nn.Module`` out;
- :mod:`.hf`: ``model.kind: hf``, a transformers architecture named by the config;
- :mod:`.losses`: the objective (a built-in loss or the user's ``train.loss``);
- :mod:`.optim`: the optimizer, the learning-rate schedule and gradient clipping;
- :mod:`.autobatch`: ``train.micro_batch_size: auto``, the largest micro-batch that fits.

``train.models.build_model`` (named in every export's ``model.json``) and
``train.models:<kind>`` keep their paths.
"""

from train.models.builtin import (
    GPT,
    MLP,
    ConvNet,
    build_model,
    cnn,
    count_parameters,
    from_factory,
    gpt,
    mlp,
)

__all__ = ["GPT", "MLP", "ConvNet", "build_model", "cnn", "count_parameters", "from_factory",
           "gpt", "mlp"]
