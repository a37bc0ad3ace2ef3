"""Model side: checkpoint config and presets, the VLA as ordered blocks, its stages at a split layer, loaders."""

from ..util.numerics import warm_vector_math

# oneMKL's vector math chooses its kernels on this thread, before a model's first multi-threaded sin / cos / exp
# (util/numerics.py says what happened without it)
warm_vector_math()
