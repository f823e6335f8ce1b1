"""The frozen target: loading it from an HF id, a folder, a GGUF or a packaged file (model.py), its
identity for caches (identity.py), the dtype and threads it runs with (precision.py), and the CPU
kernels of its decoding forwards (attention.py, prepack.py)."""
