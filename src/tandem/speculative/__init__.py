"""Speculative decoding: draft-tree building (tree.py) and acceptance on the tree (verify.py), as pure functions."""
