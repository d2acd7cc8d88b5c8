"""Everything that touches megatron-core lives in this package.

Importing it installs the CPU/gloo compatibility shims when CUDA is absent (they must precede
the first `import megatron.core`); with CUDA present it changes nothing.
"""

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()
