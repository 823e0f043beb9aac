"""The training loop (:mod:`.trainer`: resume, step, log, evaluate, checkpoint, stop) and
what it trains with (:mod:`.components`: built once per attempt from the config and the
worker's runtime). ``python -m train`` (:mod:`train.__main__`) runs it."""
