"""The embedded rollout engine: generation from the policy's own weights, in the trainer's
processes (`in_process.EmbeddedEngine`) or in a generator process of its own
(`generator.GeneratorProcessEngine`, rollout.mode one_step_off / async)."""
