"""Stand-in: librosa is imported by upstream's codec module but unused at inference."""
