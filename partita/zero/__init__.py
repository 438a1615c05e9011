"""ZeRO data parallelism: partition math, gradient reducer, sharded optimizer, stage policy."""
