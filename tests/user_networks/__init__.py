"""Users' own networks for model.factory tests."""
