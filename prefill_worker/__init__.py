"""v4serve prefill_worker."""
