"""v4serve kvtransfer."""
