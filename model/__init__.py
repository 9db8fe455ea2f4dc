"""v4serve model."""
