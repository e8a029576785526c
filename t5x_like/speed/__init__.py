"""Speed benchmarks behind `t5x-like bench`: tokens/s, step time, MFU, kernels, peers.

Not the task benchmarks (GLUE, SuperGLUE, SQuAD): those are `t5x_like/benchmarks/`.
"""
