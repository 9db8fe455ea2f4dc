"""Placement policies: small pure scorers `(request, endpoints) -> scores in [0, 1]`, one per file,
combined by `picker.pick`, and the decode-first P/D decision. `router/placement.py` wires them."""
