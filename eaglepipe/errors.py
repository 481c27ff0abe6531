"""The one exception type for errors a user can cause.

Scripts catch `PipelineError`, print its message on one line and exit non-zero, so every
user-facing failure reads as a sentence naming the row, file, key, port or process involved.
"""


class PipelineError(Exception):
    """An error the user can fix; the message names what is wrong and where."""
