"""The hidden-state server side: the reference server, its capture hooks and fault switch."""
