"""The loader tuner's trainer side: it measures a tuned loader and applies the decisions
of core/tuner/ to it, between iterators or mid-epoch where the order allows.

tuning (LoaderTuning: one tuned loader), epoch (an epoch's figures), budget (the memory,
/dev/shm, file and process room), order (whether a change keeps the batches' order),
switch (a worker pool changed between two batches), iterator (a tuned loader's iterator).
"""
