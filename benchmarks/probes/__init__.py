"""One-off probes and A/B investigations, kept runnable but not maintained as benchmarks.

Each module answered one question (does the scanned driver cost time, can the host copy
overlap the MLP, which save path is faster, ...); the maintained benchmarks are the
modules in ``benchmarks/`` itself. Run one with ``python -m benchmarks.probes.<name>``;
their results stay in ``benchmarks/results/`` (see its README.md).
"""
