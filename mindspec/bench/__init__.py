"""``mindspec bench``: speed measured side by side (interleaved rounds, medians), written as JSON
and PNG. Benchmarks are not tests: they report numbers and never fail on a time."""
