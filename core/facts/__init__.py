"""Facts about the machine, one module each, read in one place for every package.

cores (physical cores, the cgroup CPU quota), shm (the shared-memory filesystem),
memory (host memory), storage (what a path's filesystem sits on). Standard library and
psutil only; the exporter's collectors, the instrumented loader's preflight and the
doctor all read them from here.
"""
