"""Attention kernels: sparse MQA over the paged pools, the lightning indexer, the compressor, RoPE, pool I/O."""
