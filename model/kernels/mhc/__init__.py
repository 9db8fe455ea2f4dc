"""Manifold-constrained hyper-connections: the residual streams' entry and exit kernels."""
