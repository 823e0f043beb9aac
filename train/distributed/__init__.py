"""How a rank runs among the others: its device, process group and collectives
(:mod:`.ranks`), the model's wrapping for its strategy (DDP, DataParallel, FSDP)
with activation checkpointing and state dicts that keep portable names
(:mod:`.parallel`), and mixed precision (:mod:`.precision`).
"""
