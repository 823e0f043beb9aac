"""The files a dataset is made of, read and checked the same way by the launcher (before
any worker starts) and the worker: each ``data.kind``'s files (:mod:`.datafiles`), a
token dataset's files and objects (:mod:`.tokenfiles`), the largest token id of each
(:mod:`.tokenscan`) and what reading them fetches per epoch (:mod:`.footprint`). The
datasets themselves, with torch, are :mod:`train.data`'s."""
