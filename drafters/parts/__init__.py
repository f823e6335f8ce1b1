"""The parts drafters are built from, shared by several of them: the draft head and its pruned
vocabulary (head.py, vocab.py), the drafter's KV cache (cache.py), the step-by-step drafting loop
(drafting.py) and its batched rows (rows.py), parallel and block drafting (parallel.py), trees
(tree.py), training anchors (anchors.py), the EAGLE-3 family backbone (fused.py), named layers
(layers.py), training attention (attention.py), sampling (sampling.py), and the export layouts'
shared writers (layouts.py, fused_layouts.py)."""
