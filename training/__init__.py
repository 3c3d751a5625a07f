"""Training of EAGLE draft heads, beside the model definitions (models/) it trains against."""
