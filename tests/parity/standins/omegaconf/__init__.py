"""Stand-in: OmegaConf is imported by upstream's codec module but unused at inference."""


class OmegaConf:
    @staticmethod
    def register_new_resolver(*args, **kwargs):
        return None
