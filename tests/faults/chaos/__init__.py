"""Many starts and random faults against multi-rank gspo-train runs (docs/CHECKPOINTS.md,
"Chaos soak"): `jobs` launches a job and watches its processes, `storm` starts many jobs in one
run directory, `schedule` draws a seeded history of faults, `faults` throws them, `invariants`
checks what a history left, `soak` runs histories and tabulates them."""
