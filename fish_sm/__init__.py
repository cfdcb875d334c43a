"""fish-sm: serve OpenAudio S1-mini text-to-speech on SageMaker, fast."""

__version__ = "0.1.0"
