"""Drafters: the models that propose tokens for the frozen target to verify.

Importing the package imports every drafter module, so each one registers itself (base.register).
A new drafter is one module here plus its line below and conf/drafter/<name>.yaml.
"""
from drafters import eagle, eagle3, medusa, ngram, small_lm  # noqa: F401  (registration side effects)
