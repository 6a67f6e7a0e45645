"""Exceptions a caller of the core may want to handle."""


class ZOCheckError(Exception):
    """Base class of every error zocheck-ray raises on purpose."""


class StateMismatchError(ZOCheckError, ValueError):
    """A state's names, order, shapes or dtypes do not match the records' configuration."""


class RecordSequenceError(ZOCheckError, ValueError):
    """Step records are out of order, have a gap, or do not follow the state's step."""


class CorruptRecordError(ZOCheckError, ValueError):
    """A step record's bytes fail their CRC or do not parse."""


class NonFiniteError(ZOCheckError, ValueError):
    """A scalar that must be finite (lr, eps, projected gradient, loss) is not."""
