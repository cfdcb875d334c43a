"""Stand-in: argbind decorates descript-audio-codec's command-line helpers."""


def bind(*args, **kwargs):
    def wrap(fn):
        return fn

    return wrap
