from . import util
