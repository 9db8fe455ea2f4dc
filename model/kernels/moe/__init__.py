"""Mixture-of-experts kernels: the gate, the packed expert layout, the fused decode, grouped and prefill paths."""
