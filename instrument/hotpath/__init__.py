"""The per-batch path: what runs once a batch in the training loop and in its workers.

base (the types, in C where _hotpath.c was built, else in Python), iterator (the iterator
the loop takes), recorder (what it records, binned off the loop), batch (counting and
moving a batch), transfer (a timed to_device()), workerblock (a worker's row of the
shared block), layout (the constants the C and Python builds share).
"""
