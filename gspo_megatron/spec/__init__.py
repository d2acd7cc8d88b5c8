"""Plain data shared by the trainer, the engines and the tools: no megatron-core, no side effects
on import (the CPU shims are applied by whoever starts megatron)."""
