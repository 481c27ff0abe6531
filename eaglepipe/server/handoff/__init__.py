"""What the server and its clients share: request ids, the dump files in the handoff dir and the
writer that puts them there (the reference server and the SGLang hook both use it)."""
