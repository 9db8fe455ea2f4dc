"""v4serve decode_worker."""
