"""The one exception type every module may raise and import (it imports nothing of batchspec)."""


class BatchspecError(Exception):
    """An error the user can act on (bad input, missing files, incompatible models).

    The CLI prints its message as one line instead of a traceback.
    """
