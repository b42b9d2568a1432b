"""A serving stack built the way SGLang is, and the hang shapes it can be put in.

See README.md in this directory: each shape, its truth, and how the real stack waits.
"""
