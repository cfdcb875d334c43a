"""Stand-in: upstream imports AutoTokenizer but its tokenizer is tiktoken-based."""


class AutoTokenizer:
    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        raise RuntimeError("transformers stand-in: not available in parity tests")
