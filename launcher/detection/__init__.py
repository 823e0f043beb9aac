"""Detection: what the machine has (GPUs of each vendor, RDMA, the torch build, the
machine's I/O checks) and whether this torch build can drive it; nothing here starts a
process that trains.
"""
