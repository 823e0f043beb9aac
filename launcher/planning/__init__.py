"""Planning: the environment read once, and the launch plan made from the config, the
hardware and the environment (pure data: argv and env for torchrun).
"""
