"""Pure-Python twin of fastserve._faults as a release build has it: every check does nothing."""

ENABLED = False


def check_copy():
    """A state copy is about to take its memory (never refused here)."""


def check_fill():
    """A prompt fill has added its tokens to the batch (never fails here)."""


def check_step():
    """A step with work is about to run its forward pass (never blocks here)."""


def settings():
    return {}
