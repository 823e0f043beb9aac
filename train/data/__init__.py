"""The data a run trains on: each kind's datasets (:mod:`.builders`), the global sample
order every rank takes its slice of (:mod:`.order`), and the DataLoader that feeds a
rank (:mod:`.loader`). The file checks the launcher makes before any worker starts are
torch-free, in :mod:`train.core.datafiles`.
"""
