"""Stand-in: hydra is only used by upstream's config-driven loaders."""
