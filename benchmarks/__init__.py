"""fish-sm's benchmarks and experiments: scripts run on a GPU box, never imported by fish_sm and
not in its wheel. See benchmarks/README.md."""
