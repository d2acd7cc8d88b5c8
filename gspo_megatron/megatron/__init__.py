"""Everything that touches megatron-core lives in this package.

The CPU/gloo compatibility shims (`cpu_compat.apply()`) must be installed before the first
`import megatron.core`; the code that starts megatron calls it (gspo-train, gspo-logprobs, the
conversion check, benchmarks, test workers), never an import. Importing this package only makes
an import of megatron-core before that call an error that says so.
"""

from gspo_megatron.megatron import cpu_compat

cpu_compat.refuse_import_before_apply()
