"""Megatron-core plumbing: process groups, the model, the training engine, checkpoints of model
chunks, weights into and out of model chunks (weight_loading, weight_export), the conversion
check (verify). megatron-core is imported here and, besides, only by the embedded rollout
engine, which generates with this package's model in place (rollout/embedded/in_process.py,
decoders.py); the import-linter contract in pyproject.toml says so and tests/test_layers.py
checks it. gspo_megatron.checkpoint (file formats, mappings, conversion) imports none of it.

The CPU/gloo compatibility shims (`cpu_compat.apply()`) must be installed before the first
`import megatron.core`; the code that starts megatron calls it (gspo-train, gspo-logprobs, the
conversion check, benchmarks, test workers), never an import. Importing this package only makes
an import of megatron-core before that call an error that says so.
"""

from gspo_megatron.megatron import cpu_compat

cpu_compat.refuse_import_before_apply()
