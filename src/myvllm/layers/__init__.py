"""Step 1 of the six: the building blocks that the model files assemble.

Import from the submodules (``from myvllm.layers.linear import QKVParallelLinear``); this
package deliberately does not import them all, so that e.g. the sampler can be used without
loading the attention kernels.
"""
