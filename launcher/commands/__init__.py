"""The commands besides ``train`` and ``launch``: ``doctor`` (with its package and
communication checks) and ``rendezvous`` (the standalone store).
"""
