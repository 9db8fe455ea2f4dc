"""v4serve cluster."""
