"""Zero-code mode: every DataLoader of a process instrumented without a code change.

hooks (the public __init__ and __iter__ of torch's DataLoader and its subclasses),
registry (what the hooks remember, and the exit report), holders (loaders that hold a
loader, such as webdataset's WebLoader).
"""
