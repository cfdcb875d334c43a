"""Stand-in: only referenced by descript-audio-codec's file helpers."""
