"""`python -m train ...` (train/__main__.py) and the training library, imported as specdistill.train."""
