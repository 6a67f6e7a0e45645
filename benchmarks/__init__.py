"""zocheck-ray's benchmarks: programs that print tables and write JSON, each against a baseline
measured in the same run. They live beside the package (not installed with it) and use it
through its public names.

    python -m benchmarks --help                            # the benchmarks
    python -m benchmarks all --out benchmarks/results      # the suite: JSON, Markdown, figures
    python -m benchmarks replay --json benchmarks/results/replay.json

From a checkout, `zocheck-ray bench ...` runs the same command line.
"""
