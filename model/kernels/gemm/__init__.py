"""Dense FP8 block-scaled products and dynamic activation quantisation."""
