"""What rank 0 tells the user about a run: metrics fanned out (:mod:`.metrics`) to the
console (:mod:`.console`), ``metrics.jsonl``, TensorBoard (:mod:`.board`) and the
optional experiment trackers (:mod:`.trackers`), and the run's manifest
(:mod:`.manifest`).
"""
