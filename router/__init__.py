"""v4serve router."""
