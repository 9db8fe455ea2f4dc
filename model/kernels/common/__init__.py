"""Pieces every kernel family uses: programmatic dependent launch, RMSNorm, in-kernel dequantisation, the Gumbel draw."""
