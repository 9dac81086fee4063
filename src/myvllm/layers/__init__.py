"""Step 1: the building blocks of the model files. Import from the submodules: this package
imports none of them, so e.g. the sampler loads without the attention kernels.
"""
