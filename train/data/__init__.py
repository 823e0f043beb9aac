"""The data a run trains on: each kind's datasets (:mod:`.builders`; several token files,
local or in object storage, as one dataset: :mod:`.tokenshards` and :mod:`.shardcache`;
objects for the user's own code: :mod:`.remote`), the global sample order every rank
takes its slice of (:mod:`.order`), and the DataLoader that feeds a rank
(:mod:`.loader`; with replica groups, along a prediction of what each step reads:
:mod:`.prefetch`). The file checks the launcher makes before any worker starts are
torch-free, in :mod:`train.core.datasets.datafiles`, :mod:`train.core.datasets.tokenfiles` and
:mod:`train.core.datasets.tokenscan`.
"""
