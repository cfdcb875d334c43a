"""Model packages: building one from a checkpoint, archiving it, and verifying it before use."""
