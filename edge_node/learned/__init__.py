"""The learned stage-0 router: features, model, training and evaluation (numpy only)."""
